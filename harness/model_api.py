"""The contract between harness code and a chat model: typed requests, results, a backend protocol.

Harness code never holds a backend. It calls ``model.chat(...)`` on a proxy inside the sandboxed
worker; the call travels over IPC to the executor in the main process, which checks budgets and
calls ``ChatBackend.chat`` from a thread pool. The rollout engine (whale_jax) implements
``ChatBackend``; ``harness.backends`` holds small real backends for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How one completion is sampled; ``enable_thinking=None`` keeps the chat template's default."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 20
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()
    enable_thinking: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar or a tuple of strings: a shallow copy (asdict's deep copy costs
        # ~10x this on every model call).
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingSettings:
        return cls(
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k", 20)),
            max_new_tokens=int(d.get("max_new_tokens", 1024)),
            stop=tuple(str(s) for s in d.get("stop", ())),
            enable_thinking=d.get("enable_thinking"),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RngKey:
    """What a request *is*: the engine derives its sampling RNG from this, never from arrival."""

    run_seed: int
    step: int
    task_id: str
    sample_index: int
    call_index: int

    def as_tuple(self) -> tuple[int, int, str, int, int]:
        return (self.run_seed, self.step, self.task_id, self.sample_index, self.call_index)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """One model call. ``session_id`` names a conversation: a later call of the same session sends
    the full message list, extended; the backend may continue the cached token sequence instead of
    re-rendering it. ``max_prompt_tokens`` is the trusted prompt budget: a backend refuses (error
    ``prompt_too_long``) rather than generate from a longer prompt."""

    episode_id: str
    session_id: str
    messages: tuple[dict[str, str], ...]
    settings: SamplingSettings
    train: bool
    rng: RngKey
    max_prompt_tokens: int | None = None
    # Function schemas the model may call (JSON objects, e.g. {"type": "function", "function":
    # {"name", "description", "parameters"}}), rendered by the chat template into the prompt.
    tools: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatResult:
    """``text`` is what the harness sees (any thinking block removed); ``raw_text`` is the whole
    completion. Token ids are the exact ones sampled, so training never re-tokenises."""

    text: str
    raw_text: str
    prompt_ids: tuple[int, ...] = ()
    completion_ids: tuple[int, ...] = ()
    finish_reason: str = "stop"  # stop | length | error | prompt_too_long
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    weights_version: int = 0  # which weights sampled it (the engine counts its updates)


@runtime_checkable
class ChatBackend(Protocol):
    """Anything that answers chat requests. Called concurrently from many threads."""

    def chat(self, request: ChatRequest) -> ChatResult: ...
