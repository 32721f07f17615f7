"""Proposer backends behind one interface (``base.Proposer``)."""
