"""WHALE's Python side outside the compiled graph: the harness contract, the sandboxed executor and
the domains. Nothing here imports jax; sandboxed workers import only this package's light
modules."""
