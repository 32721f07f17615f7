"""Checkpoints and the mirror: a save (the mirror pushed first, then Orbax), the save that is due
by steps or minutes, and the save on preemption when the grace period allows it."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import jax

from whale_jax.loop.hosts import agreed

if TYPE_CHECKING:
    from whale_jax.loop.build import Run


def save(run: Run, *, best: bool = False, wait: bool = False) -> None:
    # The engine's shapes so far, for a resume's warm-up (whale_jax/engine/warmup.py); then the
    # mirror: a checkpoint exists only once the mirror holds what it refers to (a push that
    # fails raises before anything of this save happened).
    save_shape_record(run)
    push_mirror(run)
    s = run.state
    s.checkpoint += 1
    if best:
        s.best_checkpoint = s.checkpoint
    s.cursor = run.cursor.to_dict()
    s.trainer_step = run.trainer.step if run.trainer is not None else 0
    s.wall_s += time.monotonic() - run.t_start
    run.t_start = time.monotonic()
    run.checkpoints.save(s.checkpoint, s.to_dict(), run.trainer, best=s.best_checkpoint)
    if wait:
        run.checkpoints.wait()
    run.last_save = time.monotonic()
    run.dirty = False


def save_shape_record(run: Run) -> None:
    """The shapes the engine met, added to the run directory's record, for the next start's
    warm-up: a record only grows (a start that met nothing yet, or stopped early, loses none of
    what its earlier selves met). A record that cannot be read is replaced; one that cannot be
    written is reported."""
    from whale_jax.engine import warmup

    path = os.path.join(run.root, warmup.RECORD_FILE)
    try:
        old = warmup.read_record(path) or {}
    except warmup.RecordError:  # reported by the warm-up at the start
        old = {}
    try:
        warmup.write_record(path, warmup.merge(old, run.client.engine.shape_record()))
    except OSError as e:  # only a restart's warm-up needs it: never a reason to stop a save
        run.say(f"could not write the engine's shapes to {path}: {e}")


def push_mirror(run: Run, *, alone: bool = False) -> None:
    """Host 0 pushes; every host learns whether it failed (and then raises MirrorError), so
    none goes on into a save the others skip. ``alone``: host 0 while the others wait outside
    any collective (a harness phase); it raises its own error."""
    if run.mirror is None:
        return
    from whale_jax.loop.mirror import MirrorError

    error: MirrorError | None = None
    if jax.process_index() == 0:
        t0 = time.monotonic()
        try:
            n = run.mirror.push()
        except MirrorError as e:
            error = e
        else:
            if n["copied"] or n["deleted"]:
                run.say(f"mirror: {n['copied']} files copied, {n['deleted']} deleted "
                         f"({time.monotonic() - t0:.1f}s)")  # fmt: skip
        run.push_s = time.monotonic() - t0
    if alone:
        if error is not None:
            raise error
        return
    if agreed(error is not None):
        raise error or MirrorError(f"--run_dir_mirror={run.config.mirror}: host 0's push "
                                   "failed (its log names why)")  # fmt: skip


def maybe_save(run: Run) -> None:
    ck = run.config.checkpoint
    by_steps = ck.every_steps and run.state.step % ck.every_steps == 0
    by_time = ck.every_minutes and time.monotonic() - run.last_save >= 60 * ck.every_minutes
    if agreed(run.dirty and bool(by_steps or by_time)):  # hosts' clocks differ
        save(run)


def save_on_preemption(run: Run) -> None:
    if not run.dirty:
        run.say("preempted: nothing new since the last checkpoint")
        return
    need = run.checkpoints.estimate_s(run.trainer) + run.push_s  # the mirror goes first
    left = run.config.checkpoint.preemption_grace_s - (time.monotonic() - run.term_at)
    if agreed(need > left):
        run.say(f"preempted: no time to save (a save takes ~{need:.0f}s, {left:.0f}s left "
                 "of the grace); the last complete checkpoint stands")  # fmt: skip
        return
    from whale_jax.loop.mirror import MirrorError

    try:
        save(run, wait=True)
    except MirrorError as e:  # the mirror comes first: no save was made
        run.say(f"preempted: not saved ({e}); the last complete checkpoint stands")
        return
    run.say(f"preempted: saved checkpoint {run.state.checkpoint}")
