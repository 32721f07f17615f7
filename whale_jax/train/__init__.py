"""RSFT, the weight phase: rows from records (``rows``), packed microbatches (``packing``), the
token-mean NLL with chunked logits (``loss``), the sharded AdamW update (``trainer``) and one
rejection-sampling step through the harness and the engine (``rsft``)."""

from whale_jax.train.rows import Row, kept_episodes, rows_from_records
from whale_jax.train.rsft import DataCursor, RSFTConfig, rsft_step
from whale_jax.train.trainer import OptimConfig, TrainConfig, Trainer, UpdateMetrics

__all__ = [
    "DataCursor",
    "OptimConfig",
    "RSFTConfig",
    "Row",
    "TrainConfig",
    "Trainer",
    "UpdateMetrics",
    "kept_episodes",
    "rows_from_records",
    "rsft_step",
]
