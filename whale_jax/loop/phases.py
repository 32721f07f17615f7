"""The two phases: a weight phase (RSFT steps under the accepted harness, until the schedule says
the phase is over) and a harness phase (one Meta-Harness search under the current weights; across
hosts, host 0 searches and the others take what it accepts)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

import jax

from harness.domains import skill_text
from harness.search.phase import HarnessPhase, PhaseInterrupted
from whale_jax.loop import schedule as sched
from whale_jax.loop.evaluate import evaluate
from whale_jax.loop.hosts import await_harness_phase, check_term
from whale_jax.loop.metrics import Progress
from whale_jax.loop.saving import maybe_save, push_mirror
from whale_jax.loop.state import AcceptedHarness, Preempted, emit, harness_source
from whale_jax.train.rsft import rsft_step

if TYPE_CHECKING:
    from whale_jax.loop.build import Run


def weight_phase(run: Run) -> None:
    s, c, plan = run.state, run.config, run.plan
    start_step = s.step
    total = (min(plan.phase_steps, plan.total_steps - s.phase_start)
             if plan.alternates and plan.schedule == "fixed"
             else plan.total_steps - s.phase_start)  # fmt: skip
    bar = Progress(total, f"weight phase {s.phases.count(sched.WEIGHT) + 1}",
                   enabled=c.progress, unit="step")  # fmt: skip
    bar.update(s.step - s.phase_start)
    source = harness_source(run)
    try:
        while not sched.weight_phase_over(plan, step=s.step, phase_start=s.phase_start,
                                          rewards=s.phase_rewards):  # fmt: skip
            check_term(run)
            t0 = time.monotonic()  # weight_s: rollouts and updates, not evaluations or saves
            metrics, records = rsft_step(
                s.step + 1, tasks=run.data.train, cursor=run.cursor, source=source,
                domain=run.data.domain, executor=run.executor, trainer=run.trainer,
                engine=run.client.engine, config=c.rsft,
            )  # fmt: skip
            s.step += 1
            s.phase_rewards.append(metrics["mean_reward"])
            s.counters["weight_episodes"] += metrics["episodes"]
            s.counters["weight_tokens"] += metrics["prompt_tokens"] + metrics["completion_tokens"]
            s.counters["weight_s"] += time.monotonic() - t0
            metrics.pop("step", None)
            metrics.pop("epoch", None)
            emit(run, "rsft", **metrics)
            bar.update(1, reward=f"{metrics['mean_reward']:.3f}", kept=metrics["kept"],
                       episodes=int(s.counters["weight_episodes"]))  # fmt: skip
            if plan.eval_every and s.step % plan.eval_every == 0:
                evaluate(run, "periodic")
            run.mappings.check()
            maybe_save(run)
    finally:
        bar.close()
    run.say(f"weight phase done: steps {start_step + 1}..{s.step}" if s.step > start_step
             else "weight phase done")  # fmt: skip


def harness_phase(run: Run) -> None:
    s = run.state
    index = s.phases.count(sched.HARNESS) + 1
    if run.board_client is None:  # one host
        search(run, index, None)
        return
    if jax.process_index() != 0:
        await_harness_phase(run, index)
        return
    from whale_jax.loop.hosts import PhaseBoard

    board = PhaseBoard(run.board_client, run.board_token, index, 0)
    before = dict(s.counters)
    try:
        line = search(run, index, board)
        board.publish({
            "status": "done", "harness": dataclasses.asdict(s.harness), "source": harness_source(run),
            "counters": {k: v - before.get(k, 0) for k, v in s.counters.items()},
            "line": line,
        })  # fmt: skip
    except Preempted:
        board.publish({"status": "preempted"})
        raise
    except BaseException as e:  # the waiting hosts must not wait forever
        if not board.published:
            try:
                board.publish({"status": "failed", "error": f"{type(e).__name__}: {e}"})
            except Exception as e2:  # the phase's own error is the one to raise
                run.say(f"harness phase {index}: could not tell the other hosts: {e2}")
        raise


def search(run: Run, index: int, board) -> dict[str, Any]:
    """The phase itself (host 0, or the only host); returns its metric line's fields."""
    s, c, plan = run.state, run.config, run.plan
    search = dataclasses.replace(
        c.search,
        iterations=sched.harness_iterations(plan),
        schedule=c.schedule.schedule if plan.alternates else "fixed",
        validation=dataclasses.replace(c.search.validation,
                                       prompt_only=plan.method == "fast-slow"),
    )  # fmt: skip
    bar = Progress(search.last_iteration, f"harness phase {index}", enabled=c.progress,
                   unit="iteration")  # fmt: skip

    def log(line: str) -> None:
        run.say(f"harness phase {index}: {line}")
        if line.startswith("iteration"):
            bar.update(1)
            # The archive is the phase's checkpoint: mirrored as each iteration starts (its
            # proposals written, the iteration before evaluated), a VM that loses its disk
            # redoes at most one iteration's evaluations, and no paid proposals. Across
            # hosts only host 0 is here: no agreement (the others wait on the board).
            push_mirror(run, alone=board is not None)

    evaluated: set[str] = set()

    def along(iteration: int, top) -> None:
        """Stagewise: the test score of the frontier's top after each iteration, so the
        best point (E*, I*) can be read off (evaluated again only when the top changes)."""
        name = os.path.basename(phase.phase.root)
        top_id = s.harness.id if top.name == "incoming" else f"{name}/{top.name}"
        if top_id not in evaluated:
            evaluated.add(top_id)
            evaluate(run, "search", candidate=(top_id, top.source), iteration=iteration)

    phase = HarnessPhase(
        archive=run.archive, index=index, domain=run.data.domain, executor=run.executor,
        search_tasks=run.data.search, proposer=run.proposer,
        skill=skill_text(run.data.domain.name), config=search,
        weights={"step": s.step, "trainer_step": run.trainer.step if run.trainer else 0,
                 "weights_version": run.client.engine.weights_version,
                 "model": c.model.model},
        log=log,
        interrupt=lambda: run.term_at is not None or (board is not None
                                                      and board.stop_posted()),
        on_iteration=along if plan.method == "stagewise" else None,
    )  # fmt: skip
    t0 = time.monotonic()
    phase_source = harness_source(run)
    calls0, tokens0 = run.proposer.calls, run.proposer.tokens
    try:
        result = phase.run(phase_source)
    except PhaseInterrupted as e:
        told = "this host" if run.term_at is not None else "another host"
        run.say(f"harness phase {index}: {e} ({told} was told to stop)")
        if run.term_at is None:  # another host was told (its stop on the board)
            run.term_at = time.monotonic()
        raise Preempted() from e
    finally:
        bar.close()
    cands = result.candidates
    episodes = sum(x.summary["n"] for x in cands if x.summary) + phase.trial_episodes
    tokens = sum(x.summary["prompt_tokens"] + x.summary["completion_tokens"]
                 for x in cands if x.summary)  # fmt: skip
    s.counters["harness_episodes"] += episodes
    s.counters["harness_tokens"] += tokens
    s.counters["harness_s"] += time.monotonic() - t0
    s.counters["proposer_calls"] += run.proposer.calls - calls0
    s.counters["proposer_tokens"] += run.proposer.tokens - tokens0
    name = os.path.basename(phase.phase.root)
    if result.accepted.source != phase_source:  # the incoming harness keeps its id
        s.harness = AcceptedHarness(
            id=f"{name}/{result.accepted.name}", path=os.path.join("archive", name, "accepted.py")
        )
    line = dict(phase=index, accepted=s.harness.id,
                success_rate=result.accepted.summary["success_rate"],
                mean_turns=result.accepted.summary["mean_turns"], frontier=result.frontier,
                candidates=len(cands), valid=sum(1 for x in cands if x.valid),
                iterations=len(phase.phase.iterations()), episodes=episodes,
                vs_incoming=result.detail.get("vs_incoming"))  # fmt: skip
    emit(run, "harness_phase", **line)
    return line
