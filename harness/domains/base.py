"""What every domain provides: tasks, the harness-visible view of a task, tools (trusted, run in the
main process), the verifier and the seed harness h0."""

from __future__ import annotations

import dataclasses
import importlib.resources
from typing import Any

from harness.budgets import Budgets
from harness.records import EpisodeRecord
from harness.verdicts import answer_sessions

# Modules a harness may import in every domain: text handling and arithmetic, nothing that reaches
# files, processes, the network or introspection.
BASE_IMPORTS = frozenset(
    {
        "re", "math", "json", "random", "collections", "itertools", "functools", "statistics",
        "textwrap", "fractions", "decimal", "heapq", "bisect", "typing", "dataclasses", "enum",
        "time", "unicodedata", "difflib", "copy",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """``question`` and ``meta`` are shown to harness code; ``gold`` and ``private`` never are."""

    id: str
    question: str
    gold: Any
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    private: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""


class ToolError(Exception):
    """A tool refused its arguments; the harness sees it as ``tools.ToolError``."""


@dataclasses.dataclass
class EpisodeContext:
    """What trusted tool code may know about its episode: budgets and the completions so far."""

    budgets: Budgets
    completions: list[str] = dataclasses.field(default_factory=list)
    retries: int = 0

    def in_completion(self, text: str) -> bool:
        text = text.strip()
        return bool(text) and any(text in c for c in self.completions)


class Env:
    """Per-episode trusted tool state. ``status`` set by a tool ends the episode's scoring early
    (chess: solved / failed)."""

    status: str | None = None

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any], ctx: EpisodeContext) -> Any:
        raise ToolError(f"unknown tool {name!r}")


class Domain:
    name: str = ""
    allowed_imports: frozenset[str] = BASE_IMPORTS
    tool_names: tuple[str, ...] = ()
    budgets: Budgets = Budgets()
    answer_required: bool = True  # the run() return value is the submission
    action_tools: tuple[str, ...] | None = None  # tools whose calls count as turns (None: all)
    seed_file: str = ""

    def public_view(self, task: Task) -> dict[str, Any]:
        return {"id": task.id, "question": task.question, "meta": dict(task.meta)}

    def new_env(self, task: Task) -> Env:
        return Env()

    def score(self, task: Task, answer: str | None, env: Env) -> tuple[float, str | None]:
        """(reward, extracted answer or None when the format was not met)."""
        raise NotImplementedError

    def score_completion(self, task: Task, text: str) -> float | None:
        """A conversation's own verdict, read from its last trained completion as the reference
        reads a rollout's last assistant message (``harness.verdicts``); None where the domain
        cannot score a conversation alone."""
        return self.score(task, text, Env())[0] if self.answer_required else None

    def credited_sessions(self, task: Task, record: EpisodeRecord, env: Env) -> set[str]:
        """The sessions that take the episode's reward: the one whose completion carries the
        submitted answer."""
        return answer_sessions(record)

    def gold_strings(self, task: Task) -> list[str]:
        gold = task.gold
        return [str(g) for g in gold] if isinstance(gold, (list, tuple)) else [str(gold)]

    def answer_strings(
        self, task: Task, answer: str | None, extracted: str | None, env: Env
    ) -> list[str]:
        """What the episode submitted, as strings the prompt audit looks for
        (``harness.audits``): the extracted answer by default."""
        return [extracted] if extracted else []

    def seed_harness(self) -> str:
        return importlib.resources.files("harness.seeds").joinpath(self.seed_file).read_text()
