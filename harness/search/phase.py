"""One harness phase of WHALE: Meta-Harness search under the current weights.

Iteration 1 evaluates the incoming harness (it stays a candidate, so a phase never makes the
harness worse on its own split). Each later iteration asks the proposer for ``slots`` candidates,
audits each (``harness.search.validate``), scores the valid ones on the harness-search split
through the same executor that drives training, and logs the iteration. At the end the top of the
Pareto frontier (success up, mean turns down) is accepted.

Everything lands in the archive as it happens; an interrupted phase resumes from it: finished
candidates are not evaluated again, an iteration whose proposals were already archived is not
proposed again.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

from harness.domains.base import Domain, Task
from harness.executor import Executor
from harness.records import summarize, task_rewards
from harness.sandbox.static_check import check_source
from harness.search import frontier
from harness.search.archive import Archive, Candidate, Phase, Proposal, summary_dict
from harness.search.proposers.base import Proposer, ProposeRequest
from harness.search.validate import ValidationConfig, validate


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchConfig:
    iterations: int = 6  # I: counting the incoming harness's evaluation as iteration 1
    slots: int = 3  # k: candidates per proposer call
    samples: int = 1  # episodes per search task (the paper: 1)
    trial_tasks: int = 4  # tasks a proposer's trial run of a draft uses
    require_significant: bool = False  # accept a challenger only outside sampling noise
    cost: str = "turns"  # the frontier's cost axis: turns (the paper), tokens or calls
    validation: ValidationConfig = ValidationConfig()
    # "fixed": ``iterations`` in all. "adaptive": at least ``min_proposals`` proposal iterations,
    # then stop once the best search-split score has not improved for ``patience`` of them;
    # never more than ``max_proposals`` (the paper: 5, 2, 15). Never reads validation or test data.
    schedule: str = "fixed"
    min_proposals: int = 5
    patience: int = 2
    max_proposals: int = 15

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.slots < 1 or self.samples < 1:
            raise ValueError("SearchConfig: iterations, slots and samples must be at least 1")
        if self.cost not in frontier.COSTS:
            raise ValueError(
                f"SearchConfig.cost {self.cost!r}: expected {', '.join(frontier.COSTS)}"
            )
        if self.schedule not in ("fixed", "adaptive"):
            raise ValueError(f"SearchConfig.schedule {self.schedule!r}: expected fixed or adaptive")
        if not 1 <= self.min_proposals <= self.max_proposals or self.patience < 1:
            raise ValueError(
                "SearchConfig: need 1 <= min_proposals <= max_proposals, patience >= 1"
            )

    @property
    def last_iteration(self) -> int:
        return self.iterations if self.schedule == "fixed" else self.max_proposals + 1


class PhaseInterrupted(Exception):
    """``interrupt()`` said stop (e.g. preemption); the archive holds everything done so far and a
    new ``HarnessPhase`` on the same directory resumes from it."""


@dataclasses.dataclass(kw_only=True)
class PhaseResult:
    accepted: Candidate
    frontier: list[str]
    candidates: list[Candidate]
    detail: dict[str, Any]


class HarnessPhase:
    def __init__(
        self,
        *,
        archive: Archive,
        index: int,
        domain: Domain,
        executor: Executor,
        search_tasks: Sequence[Task],
        proposer: Proposer,
        skill: str,
        config: SearchConfig = SearchConfig(),
        weights: dict[str, Any] | None = None,
        log: Callable[[str], None] = print,
        interrupt: Callable[[], bool] = lambda: False,
        on_iteration: Callable[[int, Candidate], None] | None = None,
    ):
        self.archive, self.domain, self.executor = archive, domain, executor
        self.tasks = list(search_tasks)
        self.proposer, self.skill, self.config = proposer, skill, config
        self.weights = dict(weights or {})
        self.phase: Phase = archive.phase(index)
        self.log = log
        self.interrupt = interrupt
        self.on_iteration = on_iteration  # (iteration, the frontier's top so far), once logged
        self.trial_episodes = 0

    # ---- evaluation --------------------------------------------------------------------------

    def evaluate(self, cand: Candidate, incoming: str | None) -> None:
        """Audit (proposals only) and score one candidate; writes its verdict to the archive."""
        if self.interrupt():
            raise PhaseInterrupted(f"{self.phase.root}: interrupted before {cand.name}")
        if incoming is not None:
            verdict = validate(cand.source, domain=self.domain, incoming=incoming,
                               search_tasks=self.tasks, executor=self.executor,
                               config=self.config.validation)  # fmt: skip
            if verdict is not None:
                self.phase.reject(cand, *verdict)
                self.log(f"  {cand.name}: rejected by {verdict[0]}: {verdict[1][:160]}")
                return
        t0 = time.monotonic()
        records = self.executor.run(cand.source, self.domain, self.tasks,
                                    samples=self.config.samples,
                                    run_id=f"{os.path.basename(self.phase.root)}/{cand.name}")  # fmt: skip
        summary = summarize(records)
        rewards = task_rewards(records, self.tasks)
        extra = {"weights": self.weights, "eval_s": round(time.monotonic() - t0, 3),
                 "samples": self.config.samples}  # fmt: skip
        self.phase.record(cand, records, summary_dict(summary, rewards, extra))
        self.log(f"  {cand.name}: success {summary.success_rate:.3f}, turns "
                 f"{summary.mean_turns:.2f}, errors {summary.errors}")  # fmt: skip

    def trial(self, source: str) -> dict[str, Any]:
        """A proposer's trial run of a draft on a few search tasks (counted)."""
        violations = check_source(source, allowed_imports=self.domain.allowed_imports)
        if violations:
            return {"static_check": [str(v) for v in violations[:10]]}
        tasks = self.tasks[: self.config.trial_tasks]
        records = self.executor.run(source, self.domain, tasks, run_id="trial")
        self.trial_episodes += len(records)
        worst = next((r for r in records if r.reward == 0), None)
        return {
            "success_rate": summarize(records).success_rate,
            "stop_reasons": [r.stop_reason for r in records],
            "failing_episode": None if worst is None else {
                "stop_reason": worst.stop_reason, "error": (worst.error or "")[-1000:],
                "last_completion": worst.calls[-1].text[-1000:] if worst.calls else "",
                "output": worst.output[-500:]},
        }  # fmt: skip

    # ---- the phase ---------------------------------------------------------------------------

    def run(self, incoming_source: str) -> PhaseResult:
        self.phase.start({"domain": self.domain.name, "weights": self.weights,
                          "search_task_ids": [t.id for t in self.tasks],
                          "config": {"iterations": self.config.iterations,
                                     "schedule": self.config.schedule,
                                     "slots": self.config.slots, "samples": self.config.samples,
                                     "cost": self.config.cost,
                                     "prompt_only": self.config.validation.prompt_only}})  # fmt: skip
        for name in self.phase.drop_incomplete():
            self.log(f"{name}: left incomplete by an interrupted run; removed")
        logged = {e["iteration"] for e in self.phase.iterations()}
        cands = self.phase.candidates()
        if not cands:
            cands = [self.phase.add(Proposal(name="incoming", source=incoming_source,
                                             proposer="incoming"), iteration=1)]  # fmt: skip
        incoming = cands[0]
        if not incoming.finished:
            self.log(f"iteration 1: the incoming harness ({incoming.name})")
            self.evaluate(incoming, None)
        if 1 not in logged:
            self.phase.log_iteration(self._entry(1, [incoming], [], 0.0))
            self._report(1, incoming)
        for it in range(2, self.config.last_iteration + 1):
            if self.stop_early(it):
                break
            if it in logged:
                continue
            if self.interrupt():
                raise PhaseInterrupted(f"{self.phase.root}: interrupted before iteration {it}")
            t0 = time.monotonic()
            mine = [c for c in self.phase.candidates() if c.iteration == it]
            problems: list[str] = []
            if not mine:
                proposals, problems = self.propose(it, incoming.source)
                mine = [self.phase.add(p, iteration=it) for p in proposals]
            self.log(f"iteration {it}: {len(mine)} candidates" +
                     (f" ({'; '.join(problems)[:200]})" if problems else ""))  # fmt: skip
            for cand in mine:
                if not cand.finished:
                    self.evaluate(cand, incoming.source)
            self.phase.log_iteration(self._entry(it, mine, problems, time.monotonic() - t0))
            self._report(it, incoming)
        return self.finish(incoming)

    def _top(self, incoming: Candidate) -> tuple[Candidate, list[str], dict[str, Any]]:
        """The top of the Pareto frontier over the candidates scored so far."""
        cands = self.phase.candidates()
        scored = [(c.name, c.summary) for c in cands if c.summary is not None]
        if not scored:
            raise RuntimeError(f"{self.phase.root}: the incoming harness has no score")
        name, front, detail = frontier.accept(
            scored,
            incoming.name,
            require_significant=self.config.require_significant,
            cost=self.config.cost,
        )
        return next(c for c in cands if c.name == name), front, detail

    def _report(self, it: int, incoming: Candidate) -> None:
        if self.on_iteration is not None:
            self.on_iteration(it, self._top(incoming)[0])

    def stop_early(self, it: int) -> bool:
        """Adaptive schedule: before iteration ``it``, has the best score stalled long enough?"""
        cfg = self.config
        if cfg.schedule != "adaptive" or it - 2 < cfg.min_proposals:
            return False
        best, since = -1.0, 0
        for entry in sorted(self.phase.iterations(), key=lambda e: e["iteration"]):
            if entry["iteration"] >= it:
                break
            top = max(entry["scores"].values(), default=-1.0)
            if top > best:
                best, since = top, 0
            else:
                since += 1
        return since >= cfg.patience

    def propose(self, iteration: int, incoming: str) -> tuple[list[Proposal], list[str]]:
        slot_dir = os.path.join(self.phase.root, "proposals", f"iter-{iteration:03d}")
        shutil.rmtree(slot_dir, ignore_errors=True)  # a crashed proposer's leftovers
        os.makedirs(slot_dir)
        request = ProposeRequest(
            archive_dir=self.archive.root, phase_dir=self.phase.root, slot_dir=slot_dir,
            skill=self.skill, domain=self.domain.name, slots=self.config.slots,
            iteration=iteration, prompt_only=self.config.validation.prompt_only,
            trial=self.trial,
        )  # fmt: skip
        try:
            return self.proposer.propose(request)
        except Exception as e:  # a proposer failure skips its slots; the phase goes on
            return [], [f"proposer {getattr(self.proposer, 'name', '?')} failed: "
                        f"{type(e).__name__}: {e}"[:1000]]  # fmt: skip

    def _entry(self, it: int, cands: list[Candidate], problems: list[str], wall: float) -> dict:
        return {
            "iteration": it,
            "candidates": [c.name for c in cands],
            "valid": [c.name for c in cands if c.valid],
            "scores": {c.name: c.summary["success_rate"] for c in cands if c.summary},
            "rejected": {c.name: c.invalid["audit"] for c in cands if c.invalid},
            "problems": problems,
            "trial_episodes": self.trial_episodes,
            "wall_s": round(wall, 3),
        }

    def finish(self, incoming: Candidate) -> PhaseResult:
        accepted, front, detail = self._top(incoming)
        self.phase.accept(accepted, front, {**detail, "summary": accepted.summary})
        self.log(f"accepted {accepted.name} (success {accepted.summary['success_rate']:.3f}); "
                 f"frontier {front}")  # fmt: skip
        return PhaseResult(accepted=accepted, frontier=front, candidates=self.phase.candidates(),
                           detail=detail)  # fmt: skip
