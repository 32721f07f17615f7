"""Seed harnesses h0, one per domain. They are data: read as text and run in the sandbox."""
