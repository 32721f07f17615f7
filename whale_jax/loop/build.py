"""Building a run: every part it holds, made once, in one place (``build``), and the one record of
a run (``Run``) that the loop's functions take: the parts, fixed for the run, and the state that
changes as it goes (``LoopState``, checkpointed; the data cursor; the clocks and flags of this
process)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from harness.endpoints import KEY_ENVS
from harness.executor import Executor, ExecutorConfig
from harness.sandbox.jail import Policy
from harness.search.archive import Archive
from harness.search.proposers.base import Proposer
from whale_jax.compiled import MappingGuard
from whale_jax.loop import schedule as sched
from whale_jax.loop.checkpoint import Checkpoints
from whale_jax.loop.config import ConfigError, RunConfig
from whale_jax.loop.data import DomainData
from whale_jax.loop.metrics import MetricsLog, TensorBoard
from whale_jax.loop.preflight import Checked, engine_devices
from whale_jax.loop.saving import save_shape_record
from whale_jax.loop.state import LoopState
from whale_jax.sharding import process_gather_json
from whale_jax.train.rsft import DataCursor


class CountingProposer:
    """Counts a proposer's calls; its tokens are what the proposer's ``usage`` says it spent
    (an LLM proposer's replies; the offline proposer spends none)."""

    def __init__(self, inner: Proposer):
        self.inner, self.name = inner, inner.name
        self.usage = inner.usage
        self.calls = 0

    @property
    def tokens(self) -> int:
        return self.inner.usage.tokens

    def propose(self, request):
        try:
            return self.inner.propose(request)
        finally:
            self.calls += 1


def build_proposer(config: RunConfig):
    p = config.proposer
    if p.kind == "offline":
        from harness.search.proposers.offline import OfflineProposer

        return OfflineProposer(seed=config.seed)
    if p.kind == "gemini":
        from harness.search.proposers.gemini_backend import GeminiProposer

        return GeminiProposer(model=p.model, api_key_env=p.api_key_env or KEY_ENVS["gemini"],
                              base_url=p.base_url or None, timeout_s=p.timeout_s,
                              seed=config.seed)  # fmt: skip
    if p.kind == "openai":
        from harness.search.proposers.openai_backend import OpenAIProposer

        return OpenAIProposer(model=p.model, base_url=p.base_url or None,
                              api_key_env=p.api_key_env or KEY_ENVS["openai"],
                              timeout_s=p.timeout_s, seed=config.seed)  # fmt: skip
    from harness.search.proposers.command import CommandProposer

    return CommandProposer(p.command, timeout_s=p.timeout_s)


@dataclasses.dataclass(eq=False, kw_only=True)
class Run:
    """One run: what ``build`` made, and the state the loop's functions change."""

    config: RunConfig
    root: str  # the run directory
    say: Callable[[str], None]  # one line to the console and run.log
    print_fn: Callable[[str], None]  # the console alone
    mirror: Any  # whale_jax.loop.mirror.Mirror, or None without --run_dir_mirror
    checked: Checked  # what the preflight found (the initial harness among it)
    data: DomainData
    plan: sched.Plan
    trainer: Any  # whale_jax.train.trainer.Trainer, or None when the method never trains
    client: Any  # whale_jax.engine.client.EngineClient
    executor: Executor
    board_client: Any  # a harness phase across hosts (whale_jax/loop/hosts.py), or None
    archive: Archive
    proposer: CountingProposer | None
    checkpoints: Checkpoints
    metrics: MetricsLog
    mappings: MappingGuard  # CPU runs compile engine programs per prompt length (compiled.py)
    warm: Any  # the engine's warm-up under way (whale_jax.engine.warmup.WarmUp), or None
    # What changes as the run goes; ``state``, ``cursor`` and ``tb`` come from start_or_resume.
    state: LoopState | None = None
    cursor: DataCursor | None = None
    tb: TensorBoard | None = None
    t_start: float  # when wall time was last added to state.wall_s
    last_save: float
    dirty: bool = False  # metric lines or state written since the last checkpoint
    term_at: float | None = None  # when SIGTERM arrived here (or another host stopped)
    push_s: float = 0.0  # the last mirror push's duration (a preemption save pushes first)
    board_token: str = ""  # this job's prefix of the board's keys (host 0's, at start)
    domain_costs: dict[str, int] = dataclasses.field(default_factory=dict)  # as last added


def logger(root: str, print_fn: Callable[[str], None]) -> Callable[[str], None]:
    def say(msg: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print_fn(f"[{stamp}] {msg}")
        with open(os.path.join(root, "run.log"), "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}\n")

    return say


def build(config: RunConfig, checked: Checked, *, log: Callable[[str], None] | None = None) -> Run:
    """The run directory (restored from its mirror first), then, with the data and plan the
    preflight (``checked``) found, the model with its trainer, engine and executor, the archive,
    the proposer, checkpoints and the metrics file."""
    t_start = time.monotonic()
    c, root = config, config.run_dir
    print_fn = log or (lambda s: print(s, flush=True))
    say = logger(root, print_fn)
    os.makedirs(root, exist_ok=True)
    mirror = None
    if c.mirror:
        from whale_jax.loop.mirror import Mirror

        # Before anything is written here: a fresh VM's empty run directory is filled from
        # the mirror, so the resume finds the config, metrics and archive it needs.
        mirror = Mirror(root, c.mirror, log=say)
        mirror.restore()
    say(f"run directory {os.path.abspath(root)}"
        + (f", mirrored to {c.mirror}" if c.mirror else ""))  # fmt: skip
    for line in checked.lines:
        say(line)
    data, plan = checked.data, checked.plan

    import jax.numpy as jnp

    from whale_jax.engine.client import EngineClient
    from whale_jax.engine.device import auto_cache_rows, free_device_bytes
    from whale_jax.io.load import load_model
    from whale_jax.io.safetensors import CheckpointError

    t0 = time.monotonic()
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[c.model.dtype]
    try:
        model, _, tokenizer = load_model(c.model.model, dtype=dtype)
    except (CheckpointError, OSError) as e:  # the preflight saw the files; they changed since
        raise ConfigError(f"--model={c.model.model}: {e}") from None
    if tokenizer is None:
        raise ConfigError(f"--model={c.model.model}: the checkpoint ships no tokenizer")
    m = c.model
    trainer = None
    if c.trains:  # before the engine, whose cache is sized by the memory left after it
        from whale_jax.train.trainer import Trainer

        trainer = Trainer(model, c.train)
    concurrency = m.concurrency or 2 * m.engine_slots
    devices = engine_devices(c)
    n = len(devices)  # one engine per device, each with its share (checked in the preflight)
    cache_rows = m.engine_cache_rows or n * auto_cache_rows(
        model.cfg, m.max_len, slots=m.engine_slots // n, episodes=-(-concurrency // n),
        free_bytes=free_device_bytes(devices[0]), dtype=model.dtype,
    )  # fmt: skip
    client = EngineClient(model, tokenizer, slots=m.engine_slots, max_len=m.max_len,
                          seed=c.seed, cache_rows=cache_rows, devices=devices,
                          **m.engine_options())  # fmt: skip
    exec_config = ExecutorConfig(
        concurrency=concurrency, default_settings=m.sampling(),
        run_seed=c.seed, **({"sandbox": Policy(mode=m.sandbox)} if m.sandbox else {}),
    )  # fmt: skip
    executor = Executor(client, exec_config)
    mem, ec = client.engine.memory, client.engine.config
    say(f"model {c.model.model} loaded in {time.monotonic() - t0:.1f}s "
        f"({model.cfg.num_params() / 1e6:.1f}M parameters); engine: {m.engine_slots} "
        f"slots, {mem['cache_rows']} cache rows of {mem['slot_bytes'] / 2**20:.1f} MiB, "
        f"{ec.steps} steps a call, prompt calls of at most {ec.prefill_batch} rows and "
        f"{ec.prompt_bytes / 2**20:.0f} MiB"
        + (f", over {n} devices" if n > 1 else ""))  # fmt: skip
    board = None
    if c.searches and jax.process_count() > 1:
        from whale_jax.loop.hosts import board_client

        # Host 0 searches alone and the others wait on the coordination service's store
        # (whale_jax/loop/hosts.py): a proposer per host would accept different harnesses.
        board = board_client()
        if board is None:
            raise ConfigError(f"--method={c.schedule.method}: a harness phase across hosts "
                              "needs jax.distributed's key-value store: pass --distributed "
                              "(a TPU slice, SLURM, Open MPI) or --coordinator_address "
                              f"(jax {jax.__version__}); or --method=weight-only")  # fmt: skip
    archive = Archive(os.path.join(root, "archive"))
    # Built on every host, so a missing key stops them all alike; only host 0's proposes.
    proposer = CountingProposer(build_proposer(c)) if c.searches else None
    checkpoints = Checkpoints(c.checkpoint_dir, keep=c.checkpoint.keep, log=say)
    if jax.process_count() > 1:
        check_shared_checkpoints(c.checkpoint_dir)
    # Last, so that nothing here can fail with compiles queued: the engine's programs compile on
    # background threads from now on, beside the rest of the start (the checkpoint's restore,
    # the executor's workers, the first requests); closing the run drops what has not started.
    warm = warm_up(client.engine, root, m.engine_warm_up, m.compile_workers, say)
    return Run(
        config=c, root=root, say=say, print_fn=print_fn, mirror=mirror, checked=checked,
        data=data, plan=plan,
        trainer=trainer, client=client, executor=executor, board_client=board, archive=archive,
        proposer=proposer, checkpoints=checkpoints,
        metrics=MetricsLog(os.path.join(root, "metrics.jsonl")),
        mappings=MappingGuard(log=say), warm=warm, t_start=t_start, last_save=t_start,
    )  # fmt: skip


def warm_up(engine, root: str, mode: str, workers: int, say: Callable[[str], None]):
    """Starts compiling the engine's programs before the first rollout (--engine_warm_up): the
    shapes this run met before it stopped (its record in the run directory), and with "all"
    every shape the flags allow but the resumes. The compiles run in the background while the
    run starts (warmup.WarmUp); the line saying they are done comes when they are. A record
    that cannot be read is reported and left for the run to overwrite. Returns the WarmUp, or
    None when there is nothing to warm."""
    if mode == "auto":  # on 2 CPU cores it measured no gain (docs/benchmarks.md, "Cold start")
        mode = "off" if jax.default_backend() == "cpu" else "recorded"
    if mode == "off":
        return None
    from whale_jax.engine import warmup

    path = os.path.join(root, warmup.RECORD_FILE)
    try:
        record = warmup.read_record(path)
    except warmup.RecordError as e:
        say(f"engine warm-up: {e}; warming without it (the run writes a new one)")
        record = None
    if not record and mode != "all":  # none yet (a first start), or one with no shapes
        return None
    what = [f"the {sum(map(len, record.values()))} shapes this run met before"] if record else []
    if mode == "all":
        what.append("every shape the flags allow but the resumes")
    threads = workers or warmup.default_workers()
    say(f"engine warm-up: compiling {' and '.join(what)}, on {threads} threads beside the run")

    def done(n: dict) -> None:
        say(f"engine warm-up: {n['compiled']} programs ready in {n['seconds']:.1f}s"
            + (f", {n['taken']} compiled as the run met them first" if n["taken"] else "")
            + (f"; {n['failed']} failed (compiled when met)" if n["failed"] else "")
            + (f"; {n['unfit']} recorded shapes do not fit these flags (skipped)"
               if n["unfit"] else ""))  # fmt: skip

    return engine.warm_up(record, everything=mode == "all", workers=threads, background=True,
                          on_done=done)  # fmt: skip


def check_shared_checkpoints(checkpoint_dir: str) -> None:
    """Orbax writes each host's shards of a checkpoint into one directory: a directory local
    to each host would scatter them (and a resume would find none whole). Host 0 writes a
    file there; every host must see it."""
    from etils import epath

    root = epath.Path(checkpoint_dir)
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
        raise ConfigError(f"--checkpoint_dir={checkpoint_dir}: hosts {hosts} "
                          "do not see what host 0 writes there; every host must reach the "
                          "same directory (a gs:// bucket or a shared file system)")  # fmt: skip


def close(run: Run) -> None:
    try:
        save_shape_record(run)
    except Exception as e:  # as below: closing must not hide the run's own error
        run.print_fn(f"saving the engine's shapes: {type(e).__name__}: {e}")
    for name in ("checkpoints", "executor", "client"):
        part = getattr(run, name)
        try:
            part.close()
        except Exception as e:  # closing must not hide the run's own error
            run.print_fn(f"closing the {name}: {type(e).__name__}: {e}")
