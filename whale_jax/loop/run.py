"""The WHALE loop: weight phases (RSFT under the accepted harness) and harness phases
(Meta-Harness search under the latest weights), alternating as the method and schedule say
(``schedule.py``), with mean@k evaluation, cost accounting, Orbax checkpoints and resume.

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
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import jax

from harness.domains import skill_text
from harness.executor import Executor, ExecutorConfig
from harness.files import read_json, write_atomic, write_json
from harness.records import mean_at_k
from harness.sandbox.jail import Policy
from harness.search.archive import Archive
from harness.search.phase import HarnessPhase, PhaseInterrupted
from whale_jax.compiled import MappingGuard
from whale_jax.loop import schedule as sched
from whale_jax.loop.checkpoint import Checkpoints
from whale_jax.loop.config import (
    ConfigError,
    RunConfig,
    config_diff,
    config_hash,
    hashed_view,
    strip_operational,
)
from whale_jax.loop.data import DomainData, load_domain_data
from whale_jax.loop.metrics import MetricsLog, Progress, TensorBoard
from whale_jax.train.rsft import DataCursor, rsft_step

PREEMPTED_EXIT = 143  # 128 + SIGTERM: "stopped by preemption; rerun the same command to resume"

COUNTERS = (
    "weight_episodes", "weight_tokens", "weight_s",
    "harness_episodes", "harness_tokens", "harness_s",
    "eval_episodes", "eval_tokens", "eval_s",
    "proposer_calls", "proposer_tokens",
)  # fmt: skip


class Preempted(Exception):
    """SIGTERM arrived; the run saved what it could and stops."""


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
    harness: dict[str, Any] = dataclasses.field(default_factory=dict)  # accepted: id, path
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
        return cls(**{k: v for k, v in d.items() if k in fields})


class CountingProposer:
    """Counts a proposer's calls and, for LLM proposers, the tokens their last call reported."""

    def __init__(self, inner):
        self.inner, self.name = inner, getattr(inner, "name", "proposer")
        self.calls = self.tokens = 0

    def propose(self, request):
        try:
            return self.inner.propose(request)
        finally:
            self.calls += 1
            usage = getattr(self.inner, "last_usage", None) or {}
            self.tokens += int(usage.get("prompt_tokens", 0)) + int(
                usage.get("completion_tokens", 0)
            )


def build_proposer(config: RunConfig):
    p = config.proposer
    if p.kind == "offline":
        from harness.search.proposers.offline import OfflineProposer

        return OfflineProposer(seed=config.seed)
    if p.kind == "gemini":
        from harness.search.proposers.gemini_backend import GeminiProposer

        return GeminiProposer(model=p.model, api_key_env=p.api_key_env or "GEMINI_API_KEY",
                              base_url=p.base_url or None, timeout_s=p.timeout_s,
                              seed=config.seed)  # fmt: skip
    if p.kind == "openai":
        from harness.search.proposers.openai_backend import OpenAIProposer

        return OpenAIProposer(model=p.model, base_url=p.base_url or None,
                              api_key_env=p.api_key_env or "OPENAI_API_KEY",
                              timeout_s=p.timeout_s, seed=config.seed)  # fmt: skip
    from harness.search.proposers.command import CommandProposer

    return CommandProposer(p.command, timeout_s=p.timeout_s)


class WhaleRun:
    """``WhaleRun(config).run()``; ``log`` receives one line per event (stdout by default)."""

    def __init__(self, config: RunConfig, *, log: Callable[[str], None] | None = None):
        self.config = config
        self.root = config.run_dir
        self._print = log or (lambda s: print(s, flush=True))
        self._term_at: float | None = None
        self._push_s = 0.0  # the last mirror push's duration (a preemption save pushes first)
        self._t_start = time.monotonic()
        self._last_save = time.monotonic()
        self._dirty = False
        self.mirror = None  # set up in setup() when config.mirror names one
        self._board_client = None  # a harness phase across hosts (setup; whale_jax/loop/hosts.py)
        self._board_token = ""  # this job's prefix of the board's keys (host 0's, at start)
        self._domain_costs: dict[str, int] = {}  # the domain's cost counters as last added
        # CPU runs compile engine programs for each new prompt length; see whale_jax/compiled.py.
        self._mappings = MappingGuard(log=self.say)

    # ---- small helpers -------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self._print(f"[{stamp}] {msg}")
        with open(os.path.join(self.root, "run.log"), "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}\n")

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        s = self.state
        for name, value in self.data.domain.costs().items():  # e.g. judge calls since the last line
            s.counters[name] = s.counters.get(name, 0) + value - self._domain_costs.get(name, 0)
            self._domain_costs[name] = value
        wall = s.wall_s + time.monotonic() - self._t_start
        record = {"kind": kind, "step": s.step, "epoch": round(self.cursor.epochs_done(len(self.data.train)), 6),
                  "harness": s.harness.get("id"), "time": round(time.time(), 3), "wall_s": round(wall, 3),
                  "cost": dict(s.counters), **fields}  # fmt: skip
        self.metrics.write(record)
        s.metrics_lines = self.metrics.lines
        self._dirty = True
        if self.tb is not None:
            flat = {f"{kind}/{k}": v for k, v in fields.items() if isinstance(v, int | float)}
            flat |= {f"cost/{k}": v for k, v in s.counters.items()}
            self.tb.scalars(s.step, flat)
        return record

    def _on_term(self, signum, frame) -> None:
        if self._term_at is None:
            self._term_at = time.monotonic()
            self._print("SIGTERM: stopping at the next safe point (saving if time allows)")

    def _check_term(self) -> None:
        if self._agreed(self._term_at is not None):  # every host stops at the same step
            if self._term_at is None:  # another host was told first
                self._term_at = time.monotonic()
            raise Preempted()

    def _agreed(self, flag: bool) -> bool:
        """``flag`` or-ed over hosts. A choice that leads into a collective (a checkpoint save,
        stopping) is made once, the same on every host: a host that went alone into Orbax's
        barrier, or stopped while the others trained, would hang the job."""
        if jax.process_count() == 1:
            return bool(flag)
        from whale_jax.sharding import process_max

        return bool(process_max(int(bool(flag))))

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        c = self.config
        os.makedirs(self.root, exist_ok=True)
        self.mirror = None
        if c.mirror:
            from whale_jax.loop.mirror import Mirror

            # Before anything is written here: a fresh VM's empty run directory is filled from
            # the mirror, so the resume below finds the config, metrics and archive it needs.
            self.mirror = Mirror(self.root, c.mirror, log=self.say)
            self.mirror.restore()
        self.say(f"run directory {os.path.abspath(self.root)}"
                 + (f", mirrored to {c.mirror}" if c.mirror else ""))  # fmt: skip
        self.data: DomainData = load_domain_data(c.data)
        sizes = self.data.sizes()
        self.say(f"{c.data.domain}: {self.data.source}; splits {sizes}"
                 + (f"; {self.data.bad_rows} bad rows skipped" if self.data.bad_rows else ""))  # fmt: skip
        self.plan = sched.make_plan(c, sizes["train"])
        self.say(f"plan: {self.plan.total_steps} RSFT steps ({c.schedule.epochs} epochs of "
                 f"{sizes['train']} tasks at batch {c.rsft.prompt_batch}), method {c.schedule.method}, "
                 f"{c.schedule.schedule} schedule" +
                 (f" (E = {self.plan.phase_steps} steps, I = {self.plan.iterations})"
                  if c.schedule.schedule == "fixed" else ""))  # fmt: skip

        import jax.numpy as jnp

        from whale_jax.engine.client import EngineClient
        from whale_jax.engine.device import auto_cache_rows, free_device_bytes
        from whale_jax.io.load import load_model

        t0 = time.monotonic()
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[c.model.dtype]
        model, _, tokenizer = load_model(c.model.model, dtype=dtype)
        if tokenizer is None:
            raise ConfigError(f"--model={c.model.model}: the checkpoint ships no tokenizer")
        m = c.model
        self.trainer = None
        if c.trains:  # before the engine, whose cache is sized by the memory left after it
            from whale_jax.train.trainer import Trainer

            self.trainer = Trainer(model, c.train)
        concurrency = m.concurrency or 2 * m.engine_slots
        cache_rows = m.engine_cache_rows or auto_cache_rows(
            model.cfg, m.max_len, slots=m.engine_slots, episodes=concurrency,
            free_bytes=free_device_bytes(), dtype=model.dtype,
        )  # fmt: skip
        self.client = EngineClient(model, tokenizer, slots=m.engine_slots, max_len=m.max_len,
                                   seed=c.seed, cache_rows=cache_rows)  # fmt: skip
        exec_config = ExecutorConfig(
            concurrency=concurrency, default_settings=m.sampling(),
            run_seed=c.seed, **({"sandbox": Policy(mode=m.sandbox)} if m.sandbox else {}),
        )  # fmt: skip
        self.executor = Executor(self.client, exec_config)
        mem = self.client.engine.memory
        self.say(f"model {c.model.model} loaded in {time.monotonic() - t0:.1f}s "
                 f"({model.cfg.num_params() / 1e6:.1f}M parameters); engine: {m.engine_slots} "
                 f"slots, {mem['cache_rows']} cache rows of {mem['slot_bytes'] / 2**20:.1f} MiB")  # fmt: skip
        if c.searches and jax.process_count() > 1:
            from whale_jax.loop.hosts import board_client

            # Host 0 searches alone and the others wait on the coordination service's store
            # (whale_jax/loop/hosts.py): a proposer per host would accept different harnesses.
            self._board_client = board_client()
            if self._board_client is None:
                raise ConfigError(f"--method={c.schedule.method}: a harness phase across hosts "
                                  "needs jax.distributed's key-value store: pass --distributed "
                                  "(a TPU slice, SLURM, Open MPI) or --coordinator_address "
                                  f"(jax {jax.__version__}); or --method=weight-only")  # fmt: skip
        self.archive = Archive(os.path.join(self.root, "archive"))
        # Built on every host, so a missing key stops them all alike; only host 0's proposes.
        self.proposer = CountingProposer(build_proposer(c)) if c.searches else None
        self.checkpoints = Checkpoints(c.checkpoint_dir, keep=c.checkpoint.keep, log=self.say)
        if jax.process_count() > 1:
            self._check_shared_checkpoints()
        self.metrics = MetricsLog(os.path.join(self.root, "metrics.jsonl"))

    def _check_shared_checkpoints(self) -> None:
        """Orbax writes each host's shards of a checkpoint into one directory: a directory local
        to each host would scatter them (and a resume would find none whole). Host 0 writes a
        file there; every host must see it."""
        from etils import epath

        from whale_jax.sharding import process_gather_json

        root = epath.Path(self.config.checkpoint_dir)
        host0 = jax.process_index() == 0
        token = process_gather_json(os.urandom(8).hex() if host0 else "")[0]
        mark = root / f".hosts-{token}"
        if host0:
            root.mkdir(parents=True, exist_ok=True)
            mark.write_text("written by host 0; each host checks it sees it\n")
        process_gather_json(0)  # written before anyone looks
        blind = process_gather_json(not mark.exists())
        if host0:
            mark.unlink(missing_ok=True)
        if any(blind):
            hosts = [i for i, b in enumerate(blind) if b]
            raise ConfigError(f"--checkpoint_dir={self.config.checkpoint_dir}: hosts {hosts} "
                              "do not see what host 0 writes there; every host must reach the "
                              "same directory (a gs:// bucket or a shared file system)")  # fmt: skip

    # ---- state: fresh or resumed ---------------------------------------------------------------

    def _config_file(self) -> str:
        return os.path.join(self.root, "config.json")

    def start_or_resume(self, allow_config_change: bool) -> bool:
        """Loads the newest readable checkpoint (True) or starts fresh (False)."""
        c, h = self.config, config_hash(self.config)
        old = read_json(self._config_file()) if os.path.exists(self._config_file()) else {}
        restored = self.checkpoints.restore(self.trainer)
        saved_in = old.get("checkpoint_dir")
        if restored is None and saved_in and saved_in != c.checkpoint_dir:
            # Starting over would discard the run's metrics and phases: its checkpoints are
            # elsewhere (the default directory follows --run_dir_mirror).
            raise ConfigError(
                f"{self.root}: this run keeps its checkpoints in {saved_in}, but they now resolve "
                f"to {c.checkpoint_dir}, which holds none (--checkpoint_dir or --run_dir_mirror "
                f"changed); pass --checkpoint_dir={saved_in} to resume, or choose a new --run_dir"
            )
        if restored is None:
            if self.metrics.lines:
                self.say(f"no checkpoint: starting over ({self.metrics.lines} metric lines of an "
                         "unsaved start discarded)")  # fmt: skip
                self.metrics.truncate(0)
            self._discard_phases_after(0)
            self.state = LoopState(config_hash=h, seed=c.seed)
            self.state.harness = self._initial_harness()
            self.cursor = DataCursor(seed=c.seed)
            self._write_config(h)
            self.tb = TensorBoard(os.path.join(self.root, "tensorboard")) if c.tensorboard else None
            return False
        index, raw = restored
        state = LoopState.from_dict(raw)
        if state.config_hash != h:
            diff = config_diff(strip_operational(old.get("config", {})), hashed_view(c))
            if not allow_config_change:
                raise ConfigError(
                    f"{self.root}: this run was started with another configuration (checkpoint "
                    f"{index}); changed: {'; '.join(diff) or 'unknown'}. Rerun with the original "
                    "flags, choose a new --run_dir, or pass --allow_config_change to continue "
                    "with the new settings"
                )
            self.say(f"config changed on resume (allowed): {'; '.join(diff)}")
            state.config_hash = h
            self._write_config(h)
        elif saved_in != c.checkpoint_dir:  # resumed from checkpoints moved by --checkpoint_dir
            self._write_config(h)
        self.state = state
        self.cursor = (
            DataCursor.from_dict(state.cursor) if state.cursor else DataCursor(seed=c.seed)
        )
        dropped = self.metrics.truncate(state.metrics_lines)
        self._discard_phases_after(state.phases.count(sched.HARNESS)
                                   + (state.phase == sched.HARNESS))  # fmt: skip
        if self.trainer is not None:
            self.client.engine.set_params(self.trainer.model_state())
        self.tb = (TensorBoard(os.path.join(self.root, "tensorboard"), resumed_step=state.step)
                   if c.tensorboard else None)  # fmt: skip
        self.say(f"resumed from checkpoint {index}: step {state.step}, phases done "
                 f"{state.phases}, next {state.phase}; {dropped} metric lines after it dropped")  # fmt: skip
        return True

    def _write_config(self, config_hash_: str) -> None:
        write_json(self._config_file(), {"hash": config_hash_, "config": self.config.to_dict(),
                                         "checkpoint_dir": self.config.checkpoint_dir})  # fmt: skip

    def _initial_harness(self) -> dict[str, Any]:
        path = self.config.initial_harness
        if path:  # its existence was checked with the flags
            with open(path, encoding="utf-8") as f:
                source = f.read()
            name = os.path.splitext(os.path.basename(path))[0]
        else:
            source, name = self.data.domain.seed_harness(), "h0"
        rel = os.path.join("archive", "initial.py")
        write_atomic(os.path.join(self.root, rel), source)
        return {"id": name, "path": rel}

    def _discard_phases_after(self, keep: int) -> None:
        """Harness phases the checkpoint has not reached move to archive/.discarded/."""
        for phase in self.archive.phases():
            index = int(os.path.basename(phase.root).split("-")[1])
            if index > keep:
                dest = os.path.join(self.archive.root, ".discarded",
                                    f"{os.path.basename(phase.root)}-{int(time.time())}")  # fmt: skip
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.move(phase.root, dest)
                self.say(f"{phase.root}: after the checkpoint; moved to {dest}")

    def harness_source(self) -> str:
        with open(os.path.join(self.root, self.state.harness["path"]), encoding="utf-8") as f:
            return f.read()

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, *, best: bool = False, wait: bool = False) -> None:
        # The mirror first: a checkpoint exists only once the mirror holds what it refers to (a
        # push that fails raises before anything of this save happened).
        self.push_mirror()
        s = self.state
        s.checkpoint += 1
        if best:
            s.best_checkpoint = s.checkpoint
        s.cursor = self.cursor.to_dict()
        s.trainer_step = self.trainer.step if self.trainer is not None else 0
        s.wall_s += time.monotonic() - self._t_start
        self._t_start = time.monotonic()
        self.checkpoints.save(s.checkpoint, s.to_dict(), self.trainer, best=s.best_checkpoint)
        if wait:
            self.checkpoints.wait()
        self._last_save = time.monotonic()
        self._dirty = False

    def push_mirror(self, *, alone: bool = False) -> None:
        """Host 0 pushes; every host learns whether it failed (and then raises MirrorError), so
        none goes on into a save the others skip. ``alone``: host 0 while the others wait outside
        any collective (a harness phase); it raises its own error."""
        if self.mirror is None:
            return
        from whale_jax.loop.mirror import MirrorError

        error: MirrorError | None = None
        if jax.process_index() == 0:
            t0 = time.monotonic()
            try:
                n = self.mirror.push()
            except MirrorError as e:
                error = e
            else:
                if n["copied"] or n["deleted"]:
                    self.say(f"mirror: {n['copied']} files copied, {n['deleted']} deleted "
                             f"({time.monotonic() - t0:.1f}s)")  # fmt: skip
            self._push_s = time.monotonic() - t0
        if alone:
            if error is not None:
                raise error
            return
        if self._agreed(error is not None):
            raise error or MirrorError(f"--run_dir_mirror={self.config.mirror}: host 0's push "
                                       "failed (its log names why)")  # fmt: skip

    def maybe_save(self) -> None:
        ck = self.config.checkpoint
        by_steps = ck.every_steps and self.state.step % ck.every_steps == 0
        by_time = ck.every_minutes and time.monotonic() - self._last_save >= 60 * ck.every_minutes
        if self._agreed(self._dirty and bool(by_steps or by_time)):  # hosts' clocks differ
            self.save()

    def save_on_preemption(self) -> None:
        if not self._dirty:
            self.say("preempted: nothing new since the last checkpoint")
            return
        need = self.checkpoints.estimate_s(self.trainer) + self._push_s  # the mirror goes first
        left = self.config.checkpoint.preemption_grace_s - (time.monotonic() - self._term_at)
        if self._agreed(need > left):
            self.say(f"preempted: no time to save (a save takes ~{need:.0f}s, {left:.0f}s left "
                     "of the grace); the last complete checkpoint stands")  # fmt: skip
            return
        from whale_jax.loop.mirror import MirrorError

        try:
            self.save(wait=True)
        except MirrorError as e:  # the mirror comes first: no save was made
            self.say(f"preempted: not saved ({e}); the last complete checkpoint stands")
            return
        self.say(f"preempted: saved checkpoint {self.state.checkpoint}")

    # ---- evaluation ----------------------------------------------------------------------------

    def evaluate(self, reason: str, *, candidate: tuple[str, str] | None = None,
                 **fields: Any) -> dict[str, Any] | None:  # fmt: skip
        """mean@k on test and validation with the current weights and harness (once per pair).
        ``candidate`` (harness id, source): a harness inside a search instead (stagewise's
        evaluation along its search, on the host that searches, once per top): the
        best scores are tracked, no checkpoint is written (nothing it would hold has changed)
        and the pair is not marked evaluated, so the phase's end evaluates on every host alike."""
        s, c = self.state, self.config
        harness_id = candidate[0] if candidate else s.harness["id"]
        key = [s.step, harness_id]
        if (candidate is None and s.last_eval == key) or not (c.eval.test or c.eval.validation):
            return None
        t0 = time.monotonic()
        source, k = candidate[1] if candidate else self.harness_source(), c.eval.samples
        out: dict[str, Any] = {"reason": reason, **fields}
        for split in ("test", "validation"):
            if not getattr(c.eval, split):
                continue
            tasks = getattr(self.data, split)
            if not tasks:
                continue
            records = self.executor.run(source, self.data.domain, tasks, samples=k,
                                        run_id=f"eval-{split}", step=-1 - s.step)  # fmt: skip
            s.counters["eval_episodes"] += len(records)
            s.counters["eval_tokens"] += sum(r.prompt_tokens + r.completion_tokens for r in records)
            groups = self.data.test_groups() if split == "test" else {}
            if len(groups) > 1:  # e.g. searchqa's benchmarks: each, and their macro-average
                per = {g: mean_at_k(records, ts) for g, ts in groups.items()}
                out["test_by_source"] = per
                out["test"] = sum(per.values()) / len(per)
            else:
                out[split] = mean_at_k(records, tasks)
        s.counters["eval_s"] += time.monotonic() - t0
        if (
            candidate is None
        ):  # every host evaluates the pairs a phase ends with: never skipped here
            s.last_eval = key
        new_best_val = self._update_best(out, harness_id)
        line = self.emit("eval", **{k_: v for k_, v in out.items()}, samples=k,
                         **({"harness": harness_id} if candidate else {}))  # fmt: skip
        self.say(f"eval ({reason}, step {s.step}, harness {harness_id}): mean@{k} "
                 + ", ".join(f"{n} {out[n]:.3f}" for n in ("test", "validation") if n in out))  # fmt: skip
        if candidate is None and self._agreed(new_best_val):
            self.save(best=True)
        return line

    def _update_best(self, out: dict[str, Any], harness_id: str) -> bool:
        s, b = self.state, self.state.best
        where = {"step": s.step, "harness": harness_id}
        if "test" in out and out["test"] > b.get("test", -1.0):
            b["test"], b["test_at"] = out["test"], where
        if "validation" in out and out["validation"] > b.get("validation", -1.0):
            b["validation"], b["validation_at"] = out["validation"], where
            b["test_at_validation_best"] = out.get("test")
            return self.trainer is not None and s.step > 0
        return False

    # ---- phases --------------------------------------------------------------------------------

    def weight_phase(self) -> None:
        s, c, plan = self.state, self.config, self.plan
        start_step = s.step
        total = (min(plan.phase_steps, plan.total_steps - s.phase_start)
                 if plan.alternates and plan.schedule == "fixed"
                 else plan.total_steps - s.phase_start)  # fmt: skip
        bar = Progress(total, f"weight phase {s.phases.count(sched.WEIGHT) + 1}",
                       enabled=c.progress, unit="step")  # fmt: skip
        bar.update(s.step - s.phase_start)
        source = self.harness_source()
        try:
            while not sched.weight_phase_over(plan, step=s.step, phase_start=s.phase_start,
                                              rewards=s.phase_rewards):  # fmt: skip
                self._check_term()
                t0 = time.monotonic()  # weight_s: rollouts and updates, not evaluations or saves
                metrics, records = rsft_step(
                    s.step + 1, tasks=self.data.train, cursor=self.cursor, source=source,
                    domain=self.data.domain, executor=self.executor, trainer=self.trainer,
                    engine=self.client.engine, config=c.rsft,
                )  # fmt: skip
                s.step += 1
                s.phase_rewards.append(metrics["mean_reward"])
                s.counters["weight_episodes"] += metrics["episodes"]
                s.counters["weight_tokens"] += (
                    metrics["prompt_tokens"] + metrics["completion_tokens"]
                )
                s.counters["weight_s"] += time.monotonic() - t0
                metrics.pop("step", None)
                metrics.pop("epoch", None)
                self.emit("rsft", **metrics)
                bar.update(1, reward=f"{metrics['mean_reward']:.3f}", kept=metrics["kept"],
                           episodes=int(s.counters["weight_episodes"]))  # fmt: skip
                if plan.eval_every and s.step % plan.eval_every == 0:
                    self.evaluate("periodic")
                self._mappings.check()
                self.maybe_save()
        finally:
            bar.close()
        self.say(f"weight phase done: steps {start_step + 1}..{s.step}" if s.step > start_step
                 else "weight phase done")  # fmt: skip

    def _sync_harness(self) -> None:
        """Every host takes host 0's current harness (a resumed host's own disk may lack the
        accepted source a checkpoint refers to)."""
        from whale_jax.sharding import process_gather_json

        mine: dict[str, Any] = {}
        if jax.process_index() == 0:
            try:
                mine = {"source": self.harness_source(), "token": os.urandom(6).hex()}
            except OSError as e:  # every host stops, none waits alone in a later collective
                mine = {"error": f"{type(e).__name__}: {e}"}
        got = process_gather_json(mine)[0]
        if "error" in got:
            raise ConfigError(f"host 0 cannot read its harness {self.state.harness['path']} "
                              f"under its --run_dir: {got['error']}")  # fmt: skip
        self._board_token = got["token"]  # this job's keys apart from any earlier run's
        if jax.process_index() != 0:
            write_atomic(os.path.join(self.root, self.state.harness["path"]), got["source"])

    def _await_harness_phase(self, index: int) -> None:
        """A host other than 0: waits for host 0's phase and takes what it accepted."""
        from whale_jax.loop.hosts import PhaseBoard, PhaseFailed

        s = self.state
        board = PhaseBoard(self._board_client, self._board_token, index, jax.process_index())
        self.say(f"harness phase {index}: host 0 searches; waiting for its outcome")
        out = board.wait(lambda: self._term_at is not None, log=self.say)
        if out["status"] == "preempted":
            if self._term_at is None:  # another host was told first
                self._term_at = time.monotonic()
            raise Preempted()
        if out["status"] != "done":
            raise PhaseFailed(f"harness phase {index} failed on host 0: {out.get('error')} "
                              "(host 0's log has the rest)")  # fmt: skip
        write_atomic(os.path.join(self.root, out["harness"]["path"]), out["source"])
        s.harness = out["harness"]
        for name, delta in out["counters"].items():  # the phase's cost, as counted on host 0
            s.counters[name] = s.counters.get(name, 0) + delta
        self.emit("harness_phase", **out["line"])

    def harness_phase(self) -> None:
        s = self.state
        index = s.phases.count(sched.HARNESS) + 1
        if self._board_client is None:  # one host
            self._search(index, None)
            return
        if jax.process_index() != 0:
            self._await_harness_phase(index)
            return
        from whale_jax.loop.hosts import PhaseBoard

        board = PhaseBoard(self._board_client, self._board_token, index, 0)
        before = dict(s.counters)
        try:
            line = self._search(index, board)
            board.publish({
                "status": "done", "harness": s.harness, "source": self.harness_source(),
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
                    self.say(f"harness phase {index}: could not tell the other hosts: {e2}")
            raise

    def _search(self, index: int, board) -> dict[str, Any]:
        """The phase itself (host 0, or the only host); returns its metric line's fields."""
        s, c, plan = self.state, self.config, self.plan
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
            self.say(f"harness phase {index}: {line}")
            if line.startswith("iteration"):
                bar.update(1)
                # The archive is the phase's checkpoint: mirrored as each iteration starts (its
                # proposals written, the iteration before evaluated), a VM that loses its disk
                # redoes at most one iteration's evaluations, and no paid proposals. Across
                # hosts only host 0 is here: no agreement (the others wait on the board).
                self.push_mirror(alone=board is not None)

        evaluated: set[str] = set()

        def along(iteration: int, top) -> None:
            """Stagewise: the test score of the frontier's top after each iteration, so the
            best point (E*, I*) can be read off (evaluated again only when the top changes)."""
            name = os.path.basename(phase.phase.root)
            top_id = s.harness["id"] if top.name == "incoming" else f"{name}/{top.name}"
            if top_id not in evaluated:
                evaluated.add(top_id)
                self.evaluate("search", candidate=(top_id, top.source), iteration=iteration)

        phase = HarnessPhase(
            archive=self.archive, index=index, domain=self.data.domain, executor=self.executor,
            search_tasks=self.data.search, proposer=self.proposer,
            skill=skill_text(self.data.domain.name), config=search,
            weights={"step": s.step, "trainer_step": self.trainer.step if self.trainer else 0,
                     "weights_version": self.client.engine.weights_version,
                     "model": c.model.model},
            log=log,
            interrupt=lambda: self._term_at is not None or (board is not None
                                                          and board.stop_posted()),
            on_iteration=along if plan.method == "stagewise" else None,
        )  # fmt: skip
        t0 = time.monotonic()
        phase_source = self.harness_source()
        calls0, tokens0 = self.proposer.calls, self.proposer.tokens
        try:
            result = phase.run(phase_source)
        except PhaseInterrupted as e:
            told = "this host" if self._term_at is not None else "another host"
            self.say(f"harness phase {index}: {e} ({told} was told to stop)")
            if self._term_at is None:  # another host was told (its stop on the board)
                self._term_at = time.monotonic()
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
        s.counters["proposer_calls"] += self.proposer.calls - calls0
        s.counters["proposer_tokens"] += self.proposer.tokens - tokens0
        name = os.path.basename(phase.phase.root)
        if result.accepted.source != phase_source:  # the incoming harness keeps its id
            s.harness = {"id": f"{name}/{result.accepted.name}",
                         "path": os.path.join("archive", name, "accepted.py")}  # fmt: skip
        line = dict(phase=index, accepted=s.harness["id"],
                    success_rate=result.accepted.summary["success_rate"],
                    mean_turns=result.accepted.summary["mean_turns"], frontier=result.frontier,
                    candidates=len(cands), valid=sum(1 for x in cands if x.valid),
                    iterations=len(phase.phase.iterations()), episodes=episodes,
                    vs_incoming=result.detail.get("vs_incoming"))  # fmt: skip
        self.emit("harness_phase", **line)
        return line

    # ---- the run -------------------------------------------------------------------------------

    def run(self, *, allow_config_change: bool = False) -> dict[str, Any]:
        self.setup()
        old = signal.signal(signal.SIGTERM, self._on_term)
        try:
            resumed = self.start_or_resume(allow_config_change)
            if self._board_client is not None:
                self._sync_harness()
            s = self.state
            if s.done:
                self.say("this run is already finished")
                summary = self.finish(already=True)
                self.push_mirror()
                return summary
            if not resumed:
                self.emit("start", config_hash=s.config_hash, splits=self.data.sizes(),
                          total_steps=self.plan.total_steps, method=self.plan.method)  # fmt: skip
                s.phase = sched.next_phase(self.plan, s.phases, s.step)
                self.evaluate("start")
            while s.phase is not None:
                kind = s.phase
                if kind == sched.WEIGHT:
                    self.weight_phase()
                else:
                    self.harness_phase()
                s.phases.append(kind)
                s.phase = sched.next_phase(self.plan, s.phases, s.step)
                s.phase_start, s.phase_rewards = s.step, []
                self.emit("phase_end", phase_kind=kind, phase_index=len(s.phases), next=s.phase)
                self.evaluate(f"end of phase {len(s.phases)} ({kind})")
                self._mappings.check()
                if s.phase is not None:
                    self.say(f"next: {s.phase} phase")
                # A harness phase changes no weights and its archive is its own checkpoint.
                if self.trainer is None or kind == sched.WEIGHT:
                    self.save()
            s.done = True
            self.emit("end", best=s.best)
            self.save(wait=True)
            summary = self.finish()
            self.push_mirror()  # the summary and the report
            return summary
        except Preempted:
            self.save_on_preemption()
            raise
        finally:
            signal.signal(signal.SIGTERM, old)
            self.close()

    def finish(self, already: bool = False) -> dict[str, Any]:
        from whale_jax.loop.metrics import read_metrics

        lines = read_metrics(self.metrics.path)
        evals = [x for x in lines if x["kind"] == "eval"]
        summary = {
            "run_dir": os.path.abspath(self.root),
            "initial": evals[0] if evals else None,
            "final": evals[-1] if evals else None,
            "best": self.state.best,
            "steps": self.state.step,
            "phases": self.state.phases,
            "cost": self.state.counters,
            "harness": self.state.harness,
        }
        write_json(os.path.join(self.root, "summary.json"), summary)
        # Across hosts only host 0's archive holds the search's candidates: its report alone.
        if self.config.report and jax.process_index() == 0:
            from whale_jax.loop.report import write_report

            summary["report"] = write_report([self.root], os.path.join(self.root, "report"))
        return summary

    def close(self) -> None:
        for name in ("checkpoints", "executor", "client"):
            part = getattr(self, name, None)
            if part is not None:
                try:
                    part.close()
                except Exception as e:  # closing must not hide the run's own error
                    self._print(f"closing the {name}: {type(e).__name__}: {e}")
