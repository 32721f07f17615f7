"""Episode records: what one harness run on one task did. Plain dataclasses, JSON round-trippable;
they become RSFT training rows (the ``train=True`` calls of sessions whose verdict passes) and the
proposer's archive of traces."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(kw_only=True)
class ModelCallRecord:
    call_index: int
    session_id: str
    messages: list[dict[str, str]]
    settings: dict[str, Any]
    train: bool
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # schemas shown
    text: str = ""
    raw_text: str = ""
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None
    weights_version: int = 0  # the backend's weights when it sampled this completion


@dataclasses.dataclass(kw_only=True)
class ToolCallRecord:
    name: str
    arguments: dict[str, Any]
    result: Any = None
    error: str | None = None
    latency_s: float = 0.0
    after_call: int = 0  # model calls the episode had made when this tool was called


# How a session's verdict was decided (``SessionVerdict.origin``):
ANSWER = "answer"  # its completion carries the submitted answer: the episode's reward
VERIFIED = "verified"  # scored by the domain on its own last trained completion
PLAYED = "played"  # supplied an action the environment played (chess): the episode's reward
UNSCORED = "unscored"  # the domain cannot score it alone: never trained
FLAGGED = "flagged"  # the prompt audit flagged its episode: never trained
ORIGINS = (ANSWER, VERIFIED, PLAYED, UNSCORED, FLAGGED)


@dataclasses.dataclass(kw_only=True)
class SessionVerdict:
    """The verifier's word on one conversation that has trained (``train=True``) completions.
    ``reward`` None: not scored, so not trained. Decided by ``harness.verdicts`` in the trusted
    process; RSFT trains a session's tokens only when ``reward`` is above its threshold."""

    session_id: str
    reward: float | None
    origin: str
    detail: str = ""


@dataclasses.dataclass(kw_only=True)
class EpisodeRecord:
    """``stop_reason``: answered | no_answer | answer_not_in_completion | budget:<name> | timeout |
    error | sandbox_violation | output_limit | memory_limit | worker_died (the episode process
    died: its signal in ``error``) | protocol_error (a malformed frame) | static_check |
    harness_load | solved | failed (chess). ``turns``: the longer of the longest conversation
    (calls of one session) and the number of environment actions (tool calls)."""

    task_id: str
    domain: str
    sample_index: int = 0
    calls: list[ModelCallRecord] = dataclasses.field(default_factory=list)
    tool_calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    answer: str | None = None
    answer_in_completion: bool = False
    extracted: str | None = None
    reward: float = 0.0
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    score_s: float = 0.0  # trusted verifier and prompt audit time, in the main process
    stop_reason: str = ""
    error: str | None = None
    gold_in_prompt: bool = False
    answer_from_harness: bool = (
        False  # the submitted answer was written into a prompt by the harness
    )
    reruns: int = 0
    output: str = ""
    sessions: list[SessionVerdict] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpisodeRecord:
        d = dict(d)
        d["calls"] = [ModelCallRecord(**c) for c in d.get("calls", [])]
        d["tool_calls"] = [ToolCallRecord(**t) for t in d.get("tool_calls", [])]
        d["sessions"] = [SessionVerdict(**v) for v in d.get("sessions", [])]
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> EpisodeRecord:
        return cls.from_dict(json.loads(s))


@dataclasses.dataclass(kw_only=True)
class EvalSummary:
    """What the search archive stores next to a harness: success rate up, mean turns down."""

    n: int
    success_rate: float
    format_rate: float
    mean_turns: float
    prompt_tokens: int
    completion_tokens: int
    errors: dict[str, int]
    gold_in_prompt: int
    answer_from_harness: int = 0
    mean_calls: float = 0.0  # model calls per episode (the search's ``calls`` cost axis)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def task_rewards(records: list[EpisodeRecord], tasks: Sequence[Any]) -> list[float]:
    """Per task (in ``tasks`` order) the mean reward of its episodes; 0 for a task without any.
    Their mean is mean@k when every task ran k episodes."""
    by: dict[str, list[float]] = {}
    for r in records:
        by.setdefault(r.task_id, []).append(r.reward)
    return [sum(by[t.id]) / len(by[t.id]) if t.id in by else 0.0 for t in tasks]


def mean_at_k(records: list[EpisodeRecord], tasks: Sequence[Any]) -> float:
    """Per task the mean reward over its episodes, averaged over tasks (the paper's mean@k)."""
    scores = task_rewards(records, tasks)
    return sum(scores) / len(scores) if scores else 0.0


def summarize(records: list[EpisodeRecord]) -> EvalSummary:
    n = len(records)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None or r.stop_reason.startswith(("budget", "timeout", "sandbox")):
            key = r.stop_reason.split(":")[0] or "error"
            errors[key] = errors.get(key, 0) + 1
    return EvalSummary(
        n=n,
        success_rate=sum(r.reward for r in records) / max(n, 1),
        format_rate=sum(r.extracted is not None for r in records) / max(n, 1),
        mean_turns=sum(r.turns for r in records) / max(n, 1),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        completion_tokens=sum(r.completion_tokens for r in records),
        errors=errors,
        gold_in_prompt=sum(r.gold_in_prompt for r in records),
        answer_from_harness=sum(r.answer_from_harness for r in records),
        mean_calls=sum(len(r.calls) for r in records) / max(n, 1),
    )
