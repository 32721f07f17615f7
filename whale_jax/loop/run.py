"""The WHALE loop: weight phases (RSFT under the accepted harness) and harness phases
(Meta-Harness search under the latest weights), alternating as the method and schedule say
(``schedule.py``), with mean@k evaluation, cost accounting, Orbax checkpoints and resume.

``run(config)`` is the whole of it, in plain functions over one explicit record (``build.Run``):

- ``preflight``: everything the run needs, tried before the model loads (the data and plan among
  it);
- ``build``: every part, made once (data, plan, model, trainer, engine, executor, archive,
  proposer, checkpoints, metrics);
- ``state``: a fresh start or a resume (``LoopState``, config.json), the metric line of each event;
- ``evaluate``: mean@k with the current weights and harness;
- ``phases``: a weight phase and a harness phase;
- ``saving``: checkpoints and the run directory's mirror;
- ``hosts``: what every host must agree on, and a harness phase across hosts.

One engine, one executor and one trainer serve the whole run; the weight trajectory (weights,
AdamW state, data cursor, step count) is continuous across cycles. The run directory layout is in
docs/loop.md.

Resume: a run directory with a checkpoint continues from it (the same flags; a changed config is
refused unless ``allow_config_change``): the metrics file is cut back to the checkpointed line,
harness phases the checkpoint has not reached are moved aside, a harness phase in progress
resumes from its archive without re-evaluating finished candidates.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax

from harness.files import write_json
from whale_jax.loop import schedule as sched
from whale_jax.loop.build import Run, build, close
from whale_jax.loop.config import RunConfig
from whale_jax.loop.evaluate import evaluate
from whale_jax.loop.hosts import sync_harness
from whale_jax.loop.phases import harness_phase, weight_phase
from whale_jax.loop.preflight import preflight
from whale_jax.loop.saving import push_mirror, save, save_on_preemption
from whale_jax.loop.state import Preempted, emit, start_or_resume

__all__ = ["PREEMPTED_EXIT", "Preempted", "run"]

PREEMPTED_EXIT = 143  # 128 + SIGTERM: "stopped by preemption; rerun the same command to resume"


def run(
    config: RunConfig,
    *,
    log: Callable[[str], None] | None = None,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Runs (or resumes, or reprints) the run ``config`` describes; returns its summary. ``log``
    receives one line per event (stdout by default). Raises ``Preempted`` after SIGTERM."""
    r = build(config, preflight(config), log=log)

    def on_term(signum, frame) -> None:
        if r.term_at is None:
            r.term_at = time.monotonic()
            r.print_fn("SIGTERM: stopping at the next safe point (saving if time allows)")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        resumed = start_or_resume(r, allow_config_change)
        if r.board_client is not None:
            sync_harness(r)
        s = r.state
        if s.done:
            if r.warm is not None:
                r.warm.cancel()  # nothing will roll out
            r.say("this run is already finished")
            summary = finish(r)
            push_mirror(r)
            return summary
        if not resumed:
            emit(r, "start", config_hash=s.config_hash, splits=r.data.sizes(),
                 total_steps=r.plan.total_steps, method=r.plan.method)  # fmt: skip
            s.phase = sched.next_phase(r.plan, s.phases, s.step)
            evaluate(r, "start")
        while s.phase is not None:
            kind = s.phase
            if kind == sched.WEIGHT:
                weight_phase(r)
            else:
                harness_phase(r)
            s.phases.append(kind)
            s.phase = sched.next_phase(r.plan, s.phases, s.step)
            s.phase_start, s.phase_rewards = s.step, []
            emit(r, "phase_end", phase_kind=kind, phase_index=len(s.phases), next=s.phase)
            evaluate(r, f"end of phase {len(s.phases)} ({kind})")
            r.mappings.check()
            if s.phase is not None:
                r.say(f"next: {s.phase} phase")
            # A harness phase changes no weights and its archive is its own checkpoint.
            if r.trainer is None or kind == sched.WEIGHT:
                save(r)
        s.done = True
        emit(r, "end", best=s.best)
        save(r, wait=True)
        summary = finish(r)
        push_mirror(r)  # the summary and the report
        return summary
    except Preempted:
        save_on_preemption(r)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        close(r)


def finish(r: Run) -> dict[str, Any]:
    """summary.json (and the report on host 0) from the metrics file and the state."""
    from whale_jax.loop.metrics import read_metrics

    lines = read_metrics(r.metrics.path)
    evals = [x for x in lines if x["kind"] == "eval"]
    summary = {
        "run_dir": os.path.abspath(r.root),
        "initial": evals[0] if evals else None,
        "final": evals[-1] if evals else None,
        "best": r.state.best,
        "steps": r.state.step,
        "phases": r.state.phases,
        "cost": r.state.counters,
        "harness": dataclasses.asdict(r.state.harness),
    }
    write_json(os.path.join(r.root, "summary.json"), summary)
    # Across hosts only host 0's archive holds the search's candidates: its report alone.
    if r.config.report and jax.process_index() == 0:
        from whale_jax.loop.report import write_report

        summary["report"] = write_report([r.root], os.path.join(r.root, "report"))
    return summary
