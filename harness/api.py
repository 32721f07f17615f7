"""The contract between harness code and a chat model: typed requests, results, a backend protocol.

Harness code never holds a backend. It calls ``model.chat(...)`` on a proxy inside the sandboxed
worker; the call travels over IPC to the executor in the main process, which checks budgets and
calls ``ChatBackend.chat`` from a thread pool. The rollout engine (whale_jax) implements
``ChatBackend``; ``harness.backends`` holds small real backends for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

MAX_TEMPERATURE = 10.0
MAX_COUNT = 1 << 30  # top_k and max_new_tokens
MAX_STOPS, MAX_STOP_CHARS = 16, 200


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How one completion is sampled: the one set of sampling settings and defaults (the paper's:
    temperature 1.0, top-p 1.0, top-k 20). The run's flags, a harness's ``model.chat`` overrides and
    the engine's token-level ``Sampling`` are all this, or built from it by one function.
    ``enable_thinking=None`` keeps the chat template's default."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 20  # 0: off
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()
    enable_thinking: bool | None = None

    def errors(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for every value out of range; the one range check of sampling
        settings, used for the run's flags and for every harness call."""
        out = []
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            out.append(("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0: greedy)"))
        if not 0.0 < self.top_p <= 1.0:
            out.append(("top_p", "must be in (0, 1]"))
        if not 0 <= self.top_k <= MAX_COUNT:
            out.append(("top_k", "must be >= 0 (0: off)"))
        if not 1 <= self.max_new_tokens <= MAX_COUNT:
            out.append(("max_new_tokens", "must be at least 1"))
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            out.append(("stop", f"at most {MAX_STOPS} stop strings of {MAX_STOP_CHARS} characters"))
        return out

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar or a tuple of strings: a shallow copy (asdict's deep copy costs
        # ~10x this on every model call).
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingSettings:
        """The settings ``d`` names, the defaults for the rest (types coerced, ranges unchecked)."""
        s = cls()
        return cls(
            temperature=float(d.get("temperature", s.temperature)),
            top_p=float(d.get("top_p", s.top_p)),
            top_k=int(d.get("top_k", s.top_k)),
            max_new_tokens=int(d.get("max_new_tokens", s.max_new_tokens)),
            stop=tuple(str(x) for x in d.get("stop", s.stop)),
            enable_thinking=d.get("enable_thinking", s.enable_thinking),
        )


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingSettings))


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
    # The executor's ledger decides, once, whether this call continues ``session_id``: its
    # messages are that session's last call's messages, that call's reply and new messages, with
    # the same tools. A backend trusts it (it may append only the new messages' tokens).
    continues: bool = False


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budgets:
    """Trusted per-episode budgets, counted and enforced in the main process whatever a harness
    does. Defaults are WHALE's. ``passage_tokens`` is counted in whitespace-separated words (the tool
    side holds no tokenizer); every other token count comes from the backend's tokenizer. A call's
    prompt is capped at ``prompt_tokens`` when it starts a conversation and at ``prompt_tokens +
    response_tokens`` when it continues one."""

    def prompt_cap(self, continuing: bool) -> int:
        return self.prompt_tokens + (self.response_tokens if continuing else 0)

    assistant_tokens: int = 8192  # completion tokens summed over all calls of an episode
    prompt_tokens: int = 2048  # a conversation's first prompt
    # What a conversation's later prompts may add to that: its own sampled tokens, tool results and
    # feedback (the reference's response region: 8,192 tokens; chess 16,384).
    response_tokens: int = 8192
    passage_tokens: int = 200
    turns: int = 16  # calls in the longest conversation (session) of an episode
    retries: int = 10  # rejected actions (malformed or illegal), summed over the episode
    model_calls: int = 32
    wall_s: float = 600.0  # episode wall time, model waits included
    step_s: float = 60.0  # harness compute between two requests (a hang detector)
    tool_calls: int = 32
