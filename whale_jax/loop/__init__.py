"""The WHALE loop: configuration (``config``), task splits (``data``), phase switching
(``schedule``), checkpoints (``checkpoint``), metrics and progress (``metrics``), the loop itself
(``run``) and the report (``report``). The entry point is ``python -m whale_jax.main``."""
