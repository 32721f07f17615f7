"""The rollout engine: continuous batching over N decode slots (see docs/engine.md)."""

from whale_jax.engine.device import DecodeState, DeviceEngine, Prefix, cache_bytes_per_slot
from whale_jax.engine.engine import Engine, EngineConfig
from whale_jax.engine.requests import GREEDY, Completion, Request, RequestError, Sampling
from whale_jax.engine.sampling import request_key, sample

__all__ = [
    "GREEDY",
    "Completion",
    "DecodeState",
    "DeviceEngine",
    "Engine",
    "EngineConfig",
    "Prefix",
    "Request",
    "RequestError",
    "Sampling",
    "cache_bytes_per_slot",
    "request_key",
    "sample",
]
