"""whale_jax: WHALE (Weight-Harness Alternating LEarning) in JAX/Flax."""

from whale_jax.io.load import LoadedModel, load_model, random_model, source_of
from whale_jax.models.config import ModelConfig
from whale_jax.models.transformer import DecodeCache, Transformer

__all__ = [
    "DecodeCache",
    "LoadedModel",
    "ModelConfig",
    "Transformer",
    "load_model",
    "random_model",
    "source_of",
]
