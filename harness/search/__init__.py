"""Meta-Harness search: the archive, proposers, candidate validation and Pareto acceptance. Reaches
the model only through the executor's ``ChatBackend``; never imports jax or whale_jax."""
