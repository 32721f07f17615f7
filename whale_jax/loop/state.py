"""The loop's state: ``LoopState`` (everything a resume needs, checkpointed as JSON beside the
weights), starting fresh or resuming it (``start_or_resume``), the run's config file, the accepted
harness's source, and the metric line every event writes (``emit``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from harness.files import read_json, write_atomic, write_json
from whale_jax.loop import schedule as sched
from whale_jax.loop.config import (
    ConfigError,
    config_diff,
    config_hash,
    hashed_view,
    strip_operational,
)
from whale_jax.loop.metrics import TensorBoard
from whale_jax.train.rsft import DataCursor

if TYPE_CHECKING:
    from whale_jax.loop.build import Run

COUNTERS = (
    "weight_episodes", "weight_tokens", "weight_s",
    "harness_episodes", "harness_tokens", "harness_s",
    "eval_episodes", "eval_tokens", "eval_s",
    "proposer_calls", "proposer_tokens",
)  # fmt: skip


class Preempted(Exception):
    """SIGTERM arrived; the run saved what it could and stops."""


@dataclasses.dataclass(frozen=True)
class AcceptedHarness:
    """The harness the run uses now: its id (``h0``, an initial file's name, or
    ``phase-NNN/<candidate>``) and the path of its source under the run directory."""

    id: str
    path: str


@dataclasses.dataclass
class LoopState:
    """Everything the loop needs to continue, checkpointed as JSON beside the weights."""

    config_hash: str
    seed: int
    step: int = 0  # RSFT steps done
    trainer_step: int = 0  # optimizer updates applied
    phases: list[str] = dataclasses.field(default_factory=list)  # finished phases, in order
    phase: str | None = None  # the phase in progress (or next to start)
    phase_start: int = 0  # RSFT step at which the current weight phase began
    phase_rewards: list[float] = dataclasses.field(default_factory=list)  # its steps' rewards
    harness: AcceptedHarness | None = None  # set as the run starts
    cursor: dict[str, int] = dataclasses.field(default_factory=dict)
    counters: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COUNTERS, 0)
    )
    best: dict[str, Any] = dataclasses.field(default_factory=dict)
    last_eval: list[Any] = dataclasses.field(default_factory=list)  # [step, harness id]
    metrics_lines: int = 0
    checkpoint: int = 0  # index of the save this state was written into
    best_checkpoint: int | None = None
    done: bool = False
    wall_s: float = 0.0  # run time over all process starts

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in d.items() if k in fields}
        if kept.get("harness"):
            kept["harness"] = AcceptedHarness(**kept["harness"])
        return cls(**kept)


def emit(run: Run, kind: str, **fields: Any) -> dict[str, Any]:
    s = run.state
    for name, value in run.data.domain.costs().items():  # e.g. judge calls since the last line
        s.counters[name] = s.counters.get(name, 0) + value - run.domain_costs.get(name, 0)
        run.domain_costs[name] = value
    wall = s.wall_s + time.monotonic() - run.t_start
    record = {"kind": kind, "step": s.step, "epoch": round(run.cursor.epochs_done(len(run.data.train)), 6),
              "harness": s.harness.id if s.harness else None, "time": round(time.time(), 3), "wall_s": round(wall, 3),
              "cost": dict(s.counters), **fields}  # fmt: skip
    run.metrics.write(record)
    s.metrics_lines = run.metrics.lines
    run.dirty = True
    if run.tb is not None:
        flat = {f"{kind}/{k}": v for k, v in fields.items() if isinstance(v, int | float)}
        flat |= {f"cost/{k}": v for k, v in s.counters.items()}
        run.tb.scalars(s.step, flat)
    return record


def config_file(run: Run) -> str:
    return os.path.join(run.root, "config.json")


def start_or_resume(run: Run, allow_config_change: bool) -> bool:
    """Loads the newest readable checkpoint (True) or starts fresh (False)."""
    c, h = run.config, config_hash(run.config)
    old = read_json(config_file(run)) if os.path.exists(config_file(run)) else {}
    restored = run.checkpoints.restore(run.trainer)
    saved_in = old.get("checkpoint_dir")
    if restored is None and saved_in and saved_in != c.checkpoint_dir:
        # Starting over would discard the run's metrics and phases: its checkpoints are
        # elsewhere (the default directory follows --run_dir_mirror).
        raise ConfigError(
            f"{run.root}: this run keeps its checkpoints in {saved_in}, but they now resolve "
            f"to {c.checkpoint_dir}, which holds none (--checkpoint_dir or --run_dir_mirror "
            f"changed); pass --checkpoint_dir={saved_in} to resume, or choose a new --run_dir"
        )
    if restored is None:
        if run.metrics.lines:
            run.say(f"no checkpoint: starting over ({run.metrics.lines} metric lines of an "
                     "unsaved start discarded)")  # fmt: skip
            run.metrics.truncate(0)
        discard_phases_after(run, 0)
        run.state = LoopState(config_hash=h, seed=c.seed)
        run.state.harness = initial_harness(run)
        run.cursor = DataCursor(seed=c.seed)
        write_config(run, h)
        run.tb = TensorBoard(os.path.join(run.root, "tensorboard")) if c.tensorboard else None
        return False
    index, raw = restored
    state = LoopState.from_dict(raw)
    if state.config_hash != h:
        diff = config_diff(strip_operational(old.get("config", {})), hashed_view(c))
        if not allow_config_change:
            raise ConfigError(
                f"{run.root}: this run was started with another configuration (checkpoint "
                f"{index}); changed: {'; '.join(diff) or 'unknown'}. Rerun with the original "
                "flags, choose a new --run_dir, or pass --allow_config_change to continue "
                "with the new settings"
            )
        run.say(f"config changed on resume (allowed): {'; '.join(diff)}")
        state.config_hash = h
        write_config(run, h)
    elif saved_in != c.checkpoint_dir:  # resumed from checkpoints moved by --checkpoint_dir
        write_config(run, h)
    run.state = state
    run.cursor = DataCursor.from_dict(state.cursor) if state.cursor else DataCursor(seed=c.seed)
    dropped = run.metrics.truncate(state.metrics_lines)
    discard_phases_after(run, state.phases.count(sched.HARNESS)
                               + (state.phase == sched.HARNESS))  # fmt: skip
    if run.trainer is not None:
        run.client.engine.set_params(run.trainer.model_state())
    run.tb = (TensorBoard(os.path.join(run.root, "tensorboard"), resumed_step=state.step)
               if c.tensorboard else None)  # fmt: skip
    run.say(f"resumed from checkpoint {index}: step {state.step}, phases done "
             f"{state.phases}, next {state.phase}; {dropped} metric lines after it dropped")  # fmt: skip
    return True


def write_config(run: Run, config_hash_: str) -> None:
    write_json(config_file(run), {"hash": config_hash_, "config": run.config.to_dict(),
                                     "checkpoint_dir": run.config.checkpoint_dir})  # fmt: skip


def initial_harness(run: Run) -> AcceptedHarness:
    rel = os.path.join("archive", "initial.py")
    write_atomic(os.path.join(run.root, rel), run.checked.harness_source)
    return AcceptedHarness(id=run.checked.harness_name, path=rel)


def discard_phases_after(run: Run, keep: int) -> None:
    """Harness phases the checkpoint has not reached move to archive/.discarded/."""
    for phase in run.archive.phases():
        index = int(os.path.basename(phase.root).split("-")[1])
        if index > keep:
            dest = os.path.join(run.archive.root, ".discarded",
                                f"{os.path.basename(phase.root)}-{int(time.time())}")  # fmt: skip
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.move(phase.root, dest)
            run.say(f"{phase.root}: after the checkpoint; moved to {dest}")


def harness_source(run: Run) -> str:
    with open(os.path.join(run.root, run.state.harness.path), encoding="utf-8") as f:
        return f.read()
