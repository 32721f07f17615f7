"""The Meta-Harness archive: the proposer's memory and the user's audit trail, on disk.

    <root>/
      phase-001/
        phase.json            domain, weights (step, version), search task ids, settings
        iterations.jsonl      one line per iteration: candidates proposed, valid, scores, time
        frontier.json         the Pareto frontier over (success rate up, mean turns down)
        accepted.json         the accepted candidate's name, summary and interval vs the incoming
        accepted.py           its source
        candidates/
          h000-incoming/      the incoming harness (iteration 1), always a candidate
            harness.py        the source
            proposal.json     proposer, iteration, hypothesis, changes
            summary.json      EvalSummary + per-task rewards + interval (written last: complete)
            traces.jsonl      one EpisodeRecord per line (every model call, tool call, output)
            invalid.json      instead of summary.json: the audit that rejected it, and why
      phase-002/ ...

Every file is written atomically (a temporary file in the same directory, then ``os.replace``):
a crash never leaves a half-written file that looks complete. A candidate is finished when its
``summary.json`` or ``invalid.json`` exists; a resumed phase skips finished candidates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable
from typing import Any

from harness.files import read_json, write_atomic, write_json
from harness.records import EpisodeRecord, EvalSummary

_NAME = re.compile(r"^h\d{3}-[a-z0-9][a-z0-9-]{0,40}$")


def slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return (s or "candidate")[:40].strip("-") or "candidate"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Proposal:
    """A candidate as a proposer hands it over."""

    name: str  # short slug; the archive prefixes the candidate number
    source: str
    hypothesis: str = ""
    changes: str = ""
    proposer: str = ""


@dataclasses.dataclass(kw_only=True)
class Candidate:
    name: str
    iteration: int
    source: str
    proposal: dict[str, Any]
    summary: dict[str, Any] | None = None  # EvalSummary fields + "rewards" + "interval"
    invalid: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.summary is not None or self.invalid is not None

    @property
    def valid(self) -> bool:
        return self.summary is not None


class Phase:
    """One harness phase's directory."""

    def __init__(self, root: str):
        self.root = root
        self.candidates_dir = os.path.join(root, "candidates")

    # ---- writing -------------------------------------------------------------------------------

    def start(self, meta: dict[str, Any]) -> None:
        """Create the phase (or check that a resumed one matches ``meta``)."""
        path = os.path.join(self.root, "phase.json")
        if os.path.exists(path):
            old = read_json(path)
            for key in ("domain", "search_task_ids"):
                if old.get(key) != meta.get(key):
                    raise ValueError(
                        f"{path}: resumed phase has a different {key!r}; use a new archive "
                        "directory or the same search split"
                    )
            return
        os.makedirs(self.candidates_dir, exist_ok=True)
        write_json(path, meta)

    def next_name(self, slug_text: str) -> str:
        n = len(self.candidate_names())
        return f"h{n:03d}-{slug(slug_text)}"

    def add(self, proposal: Proposal, iteration: int) -> Candidate:
        name = self.next_name(proposal.name)
        d = os.path.join(self.candidates_dir, name)
        os.makedirs(d, exist_ok=False)
        meta = {"iteration": iteration, "hypothesis": proposal.hypothesis,
                "changes": proposal.changes, "proposer": proposal.proposer,
                "name": proposal.name}  # fmt: skip
        write_atomic(os.path.join(d, "harness.py"), proposal.source)
        write_json(os.path.join(d, "proposal.json"), meta)
        return Candidate(name=name, iteration=iteration, source=proposal.source, proposal=meta)

    def reject(self, cand: Candidate, audit: str, reason: str) -> None:
        cand.invalid = {"audit": audit, "reason": reason[:8000]}
        write_json(os.path.join(self.candidates_dir, cand.name, "invalid.json"), cand.invalid)

    def record(
        self, cand: Candidate, records: list[EpisodeRecord], summary: dict[str, Any]
    ) -> None:
        """Traces first, the summary last: a summary means the candidate is complete."""
        d = os.path.join(self.candidates_dir, cand.name)
        write_atomic(os.path.join(d, "traces.jsonl"), "".join(r.to_json() + "\n" for r in records))
        cand.summary = summary
        write_json(os.path.join(d, "summary.json"), summary)

    def log_iteration(self, entry: dict[str, Any]) -> None:
        path = os.path.join(self.root, "iterations.jsonl")
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        write_atomic(path, old + json.dumps(entry, sort_keys=True) + "\n")

    def iterations(self) -> list[dict[str, Any]]:
        path = os.path.join(self.root, "iterations.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def accept(self, cand: Candidate, frontier: list[str], detail: dict[str, Any]) -> None:
        write_json(os.path.join(self.root, "frontier.json"), {"frontier": frontier})
        write_atomic(os.path.join(self.root, "accepted.py"), cand.source)
        write_json(os.path.join(self.root, "accepted.json"), {"name": cand.name, **detail})

    # ---- reading -------------------------------------------------------------------------------

    def candidate_names(self) -> list[str]:
        if not os.path.isdir(self.candidates_dir):
            return []
        return sorted(n for n in os.listdir(self.candidates_dir) if _NAME.match(n))

    def load(self, name: str) -> Candidate:
        d = os.path.join(self.candidates_dir, name)
        with open(os.path.join(d, "harness.py"), encoding="utf-8") as f:
            source = f.read()
        proposal = read_json(os.path.join(d, "proposal.json"))
        cand = Candidate(name=name, iteration=int(proposal.get("iteration", 0)), source=source,
                         proposal=proposal)  # fmt: skip
        for key in ("summary", "invalid"):
            p = os.path.join(d, f"{key}.json")
            if os.path.exists(p):
                setattr(cand, key, read_json(p))
        return cand

    def drop_incomplete(self) -> list[str]:
        """Removes candidate directories a crash left without their harness or proposal (their
        names would otherwise shift the numbering of the candidates proposed again)."""
        dropped = []
        for name in self.candidate_names():
            d = os.path.join(self.candidates_dir, name)
            if not all(os.path.exists(os.path.join(d, f)) for f in ("harness.py", "proposal.json")):
                shutil.rmtree(d)
                dropped.append(name)
        return dropped

    def candidates(self) -> list[Candidate]:
        out = []
        for name in self.candidate_names():
            try:
                out.append(self.load(name))
            except (OSError, ValueError):
                continue  # a candidate directory a crash left without its files: not a candidate
        return out

    def traces(self, name: str) -> Iterable[EpisodeRecord]:
        path = os.path.join(self.candidates_dir, name, "traces.jsonl")
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield EpisodeRecord.from_json(line)

    def accepted(self) -> Candidate | None:
        path = os.path.join(self.root, "accepted.json")
        return self.load(read_json(path)["name"]) if os.path.exists(path) else None


class Archive:
    """Every harness phase of a run, in order; earlier phases stay readable."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def phases(self) -> list[Phase]:
        names = sorted(n for n in os.listdir(self.root) if re.fullmatch(r"phase-\d{3}", n))
        return [Phase(os.path.join(self.root, n)) for n in names]

    def phase(self, index: int) -> Phase:
        return Phase(os.path.join(self.root, f"phase-{index:03d}"))


def summary_dict(
    summary: EvalSummary, rewards: list[float], extra: dict[str, Any]
) -> dict[str, Any]:
    return {**summary.to_dict(), "rewards": rewards, **extra}
