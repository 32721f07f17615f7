"""Budgets and sessions of one episode, counted in the trusted process: what a model call from harness
code may ask for, which conversation (session) it continues, and what is left afterwards."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from harness.api import MAX_COUNT, MAX_TEMPERATURE, SAMPLING_FIELDS, Budgets, SamplingSettings

ROLES = frozenset({"system", "user", "assistant", "tool"})


class Refused(Exception):
    """A call the budgets refuse: ``budget`` names the budget (the record's ``budget:<name>``)."""

    def __init__(self, budget: str, detail: str):
        super().__init__(detail)
        self.budget, self.detail = budget, detail


def check_messages(messages: Any) -> list[dict[str, str]]:
    """A non-empty list of {"role", "content"} dicts with known roles; copied, extra keys dropped."""
    if not (
        isinstance(messages, list)
        and messages
        and len(messages) <= 4096
        and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def check_settings(given: Any, defaults: SamplingSettings, tokens_left: int) -> SamplingSettings:
    """The harness's overrides on the defaults, each checked for type and range (non-finite or
    huge numbers, bools for numbers, unknown keys: ValueError); ``max_new_tokens`` clipped to what
    is left of the episode's assistant-token budget."""
    if not isinstance(given, dict):
        raise ValueError("settings must be an object")
    unknown = set(given) - SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown settings {sorted(map(str, unknown))[:5]}")
    base = defaults.to_dict()
    for key, value in given.items():
        if key in ("temperature", "top_p"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number")
            if not math.isfinite(value) or not 0.0 <= value <= MAX_TEMPERATURE:
                raise ValueError(f"{key} out of range")
        elif key in ("top_k", "max_new_tokens"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} must be an integer")
            if not 0 <= value <= MAX_COUNT:
                raise ValueError(f"{key} out of range")
        elif key == "stop":
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise ValueError("stop must be a list of strings")
        elif key == "enable_thinking" and value is not None and not isinstance(value, bool):
            raise ValueError("enable_thinking must be true, false or null")
        base[key] = value
    s = SamplingSettings.from_dict(base)
    for key, problem in s.errors():
        raise ValueError(f"{key} {problem}")
    return dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, tokens_left))


def check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """Function schemas for the prompt: a list of at most 16 JSON objects, 32 KiB of JSON in all;
    copied through JSON so nothing but plain data reaches a backend."""
    if (
        not isinstance(tools, list)
        or len(tools) > 16
        or not all(isinstance(t, dict) for t in tools)
    ):
        raise ValueError("tools must be a list of at most 16 objects (function schemas)")
    try:
        text = json.dumps(tools, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tools must be plain JSON: {e}") from None
    if len(text) > 32 << 10:
        raise ValueError("tools: at most 32 KiB of JSON")
    return tuple(json.loads(text))


@dataclasses.dataclass
class Session:
    """One conversation of an episode: the ledger is the one place that decides which calls
    belong to it (``ChatRequest.continues``); the backend, the records and the rows follow."""

    id: str
    prefix: list[dict[str, str]] = dataclasses.field(default_factory=list)
    turns: int = 0
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def continuing(self) -> bool:
        """Whether the call just admitted continues this conversation (it is not its first)."""
        return self.turns > 1


@dataclasses.dataclass
class Ledger:
    """One episode's counters and conversations."""

    budgets: Budgets
    session_prefix: str
    sessions: list[Session] = dataclasses.field(default_factory=list)
    assistant_tokens: int = 0
    model_calls: int = 0
    budget_stop: str | None = None
    refusals: int = 0

    def admit(
        self,
        messages: list[dict[str, str]],
        settings: SamplingSettings,
        tools: tuple[dict[str, Any], ...] = (),
    ) -> Session:
        """The session this call continues (or a new one); raises Refused when over a budget. A
        call continues a session when its messages extend the session's (its messages and the
        reply) and it shows the same tools (they are rendered into the session's first prompt)."""
        b = self.budgets
        if self.model_calls >= b.model_calls:
            raise Refused("model_calls", f"{b.model_calls} calls used")
        if settings.max_new_tokens <= 0:
            raise Refused("assistant_tokens", f"{b.assistant_tokens} used")
        size = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        if size > 64 * b.prompt_cap(True):
            raise Refused("prompt_tokens", "prompt far over the budget")
        session = next(
            (
                s
                for s in self.sessions
                if len(messages) > len(s.prefix)
                and messages[: len(s.prefix)] == s.prefix
                and s.tools == tools
            ),
            None,
        )
        if session is not None and session.turns >= b.turns:
            raise Refused("turns", f"{b.turns} turns used")
        if session is None:
            session = Session(id=f"{self.session_prefix}/s{len(self.sessions)}", tools=tools)
            self.sessions.append(session)
        session.turns += 1
        self.model_calls += 1
        return session

    def refuse(self, refused: Refused) -> bool:
        """Count a refusal; True when the harness has ignored too many (a runaway to stop)."""
        self.budget_stop = self.budget_stop or f"budget:{refused.budget}"
        self.refusals += 1
        return self.refusals > 3

    def remaining(self, session: Session) -> dict[str, int]:
        b = self.budgets
        return {
            "assistant_tokens": b.assistant_tokens - self.assistant_tokens,
            "model_calls": b.model_calls - self.model_calls,
            "turns": b.turns - session.turns,
        }
