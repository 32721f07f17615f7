"""What goes into the engine and what comes out: token-level requests and completions.

Text, chat templates and sessions live above the engine (``whale_jax.engine.chat``, ``whale_jax.engine.client``);
the engine sees token ids, sampling settings, an RNG identity and stop conditions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.api import SamplingSettings

_DEFAULT = SamplingSettings()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """``SamplingSettings`` at the token level, with its defaults: ``temperature <= 0``: greedy;
    ``top_k <= 0``: no top-k; ``top_p = 1``: no top-p."""

    temperature: float = _DEFAULT.temperature
    top_k: int = _DEFAULT.top_k
    top_p: float = _DEFAULT.top_p
    max_new_tokens: int = _DEFAULT.max_new_tokens
    stop_ids: tuple[int, ...] = ()  # in addition to the engine's EOS ids
    stop_strings: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: SamplingSettings, stop_ids: tuple[int, ...] = ()) -> Sampling:
        """The one way from a call's settings to the engine's (thinking is the template's)."""
        return cls(
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            max_new_tokens=settings.max_new_tokens,
            stop_ids=tuple(stop_ids),
            stop_strings=tuple(settings.stop),
        )


GREEDY = Sampling(temperature=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One completion of ``prompt_ids``.

    ``identity`` is what the request *is* (e.g. step, task id, sample index, call index); with the
    engine's seed it fixes the sampling RNG. The engine continues from the longest decode state it
    keeps whose tokens start the prompt (a session's parked state, a shared prompt prefix, the same
    whole prompt) and prefills only the rest. ``snapshots`` are token counts where the prompt's
    prefill may stop to keep a state for later requests (message boundaries the caller knows).
    ``park`` asks the engine to keep this request's final state, owned by that name (``forget``
    drops it). ``cache=False``: neither read nor add to the prefix cache (prefilled from scratch;
    for checks and debugging).
    """

    prompt_ids: tuple[int, ...]
    sampling: Sampling = Sampling()
    identity: tuple[Any, ...] = ()
    snapshots: tuple[int, ...] = ()
    park: str | None = None
    cache: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """``finish_reason``: stop (EOS / stop id / stop string), length (max_new_tokens or the context
    is full), error (bad request; ``error`` says why; nothing was generated) or prompt_too_long.

    ``token_ids`` are exactly the sampled ids, ending with the stop id when one was sampled and
    ending with the token that completed a stop string; ``stop_text_at`` is then the character
    offset of the stop string in the decoded completion, so text-level callers cut exactly there.
    """

    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens continued from a kept state instead of prefilled
    stop_text_at: int | None = None
    error: str | None = None
    weights_version: int = 0  # the engine's weights version that sampled every token


class RequestError(ValueError):
    """A request the engine refuses; reported on its own completion, never raised to others."""

    def __init__(self, message: str, reason: str = "error"):
        super().__init__(message)
        self.reason = reason
