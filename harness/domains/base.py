"""What every domain provides: tasks, the harness-visible view of a task, tools (trusted, run in the
main process), the verifier and the seed harness h0; and what a domain folder's ``load`` works
with (``DataSpec`` in, ``DomainData`` out, ``DataError`` for bad input, the split and data-file
helpers) and its fetch list (``Source``). The registry is ``harness.domains``."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from harness.api import Budgets
from harness.data import DataError
from harness.records import EpisodeRecord
from harness.splits import split_by_hash
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
        (``harness.executor.audits``): the extracted answer by default."""
        return [extracted] if extracted else []

    def seed_harness(self) -> str:
        """h0: the ``h0.py`` beside the module that defines this domain (its folder)."""
        folder = Path(sys.modules[type(self).__module__].__file__ or "").parent
        return (folder / "h0.py").read_text(encoding="utf-8")

    def check(self) -> list[str]:
        """What the domain needs at run time besides its tasks (a retrieval server, say), tried
        before the model loads: one line per check passed; DataError naming the flag at fault."""
        return []

    def costs(self) -> dict[str, int]:
        """Monotone counters of what scoring spent outside the model (searchqa's judge calls and
        tokens); the run adds them to its costs."""
        return {}

    def test_groups(self, tasks: list[Task]) -> dict[str, list[Task]]:
        """The groups the test score is reported by, averaged with equal weight (searchqa: one
        per benchmark); one group by default."""
        return {"test": list(tasks)}


# ---- data: what a domain folder's ``load`` works with ------------------------------------------


class DataSpec(Protocol):
    """The loop's data settings (``whale_jax.loop.config.DataConfig``): ``domain``, ``data_dir``
    ("": the domain's offline tasks), ``split_seed`` and the split sizes; a domain reads its own
    options (e.g. ``retriever_url``) from it as attributes."""

    domain: str
    data_dir: str
    split_seed: int
    train_size: int
    search_size: int
    validation_size: int
    test_size: int


@dataclasses.dataclass
class DomainData:
    domain: Domain
    train: list[Task]
    search: list[Task]
    validation: list[Task]
    test: list[Task]
    source: str  # where the tasks came from, for the run's records
    bad_rows: int = 0

    def test_groups(self) -> dict[str, list[Task]]:
        return self.domain.test_groups(self.test)

    def sizes(self) -> dict[str, int]:
        return {k: len(getattr(self, k)) for k in ("train", "search", "validation", "test")}


@dataclasses.dataclass(frozen=True)
class Source:
    """One file ``python -m whale_jax.fetch_data`` prepares under ``--data_dir``."""

    out: str  # relative path under data_dir
    repo: str  # Hugging Face dataset repo
    patterns: tuple[str, ...]  # files of the repo to fetch
    prepare: str = "rows"  # rows | parquet | gunzip
    data_source: str = ""  # added as a column (searchqa test sets)
    columns: tuple[str, ...] = ()  # keep only these (free-form metadata is dropped)


def data_files(spec: DataSpec, rel: str, what: str) -> list[str]:
    """The files matching ``rel`` under ``--data_dir``; DataError naming the file, the flag and
    the fetch command when there are none."""
    found = sorted(glob.glob(os.path.join(spec.data_dir, rel)))
    if not found:
        raise DataError(
            f"--data_dir={spec.data_dir}: {rel} not found (the {spec.domain} domain's {what} "
            f"data); fetch it with: python -m whale_jax.fetch_data --domain={spec.domain} "
            f"--data_dir={spec.data_dir}, or leave --data_dir empty for the offline tasks"
        )
    return found


def split_tasks(
    spec: DataSpec, pool: Sequence[Task], key: Callable[[Task], str], *, test: bool
) -> dict[str, list[Task]]:
    """The pool's splits by a keyed hash of ``key`` (``harness.splits``): search, validation and,
    with ``test``, test at their sizes; the rest is weight training (``train_size`` of it when
    set). DataError naming the size flag when the pool is too small."""
    sizes = {"search": spec.search_size, "validation": spec.validation_size}
    if test:
        sizes["test"] = spec.test_size
    out = split_by_hash(pool, key, seed=spec.split_seed, sizes=sizes, rest="train")
    for name, want in sizes.items():
        if want and len(out[name]) < want:
            raise DataError(
                f"--{name}_size={want}: the {spec.domain} task pool has only {len(pool)} tasks; "
                f"the {name} split got {len(out[name])}"
            )
    if spec.train_size:
        if len(out["train"]) < spec.train_size:
            raise DataError(
                f"--train_size={spec.train_size}: only {len(out['train'])} tasks remain for "
                "weight training after the other splits"
            )
        out["train"] = out["train"][: spec.train_size]  # the first in hash order: fixed by seed
    if not out["train"]:
        raise DataError(f"--data_dir/--*_size: no {spec.domain} tasks left for weight training")
    return out
