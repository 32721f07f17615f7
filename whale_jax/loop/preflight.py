"""Everything a run needs, tried before the model loads: ``preflight(config)``. ``--dry_run`` stops
after it and prints what it found and the plan.

Each failure is a ``ConfigError`` (exit 2) that names the flag and says how to mend it:

- the directories the run writes (``--run_dir``, ``--checkpoint_dir``, ``--run_dir_mirror``,
  local or gs://): a write probe in the directory, or in its nearest existing parent when it is
  still to be made;
- the data (the domain folder's ``load``: files, schema, sizes) and what the domain needs at run
  time besides (a retrieval server's answer to a test query);
- the model files (``whale_jax.io.load.check_model``: no weight is read);
- the API keys of the proposer and the judge (``harness.endpoints``), and a command proposer's
  program;
- the initial harness: the static check, then a load in the sandbox under the run's sandbox mode,
  which also shows that this machine's kernel grants that mode.

Nothing is left behind: no directory is made, and each probe file is deleted once written.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import tempfile
import time

from harness.data import DataError
from harness.endpoints import (
    BASE_URLS,
    KEY_ENVS,
    LOOPBACK_KEY,
    MissingAPIKeyError,
    api_key_from_env,
)
from harness.executor import ExecutorConfig, load_check
from harness.sandbox.jail import Policy
from harness.sandbox.static_check import StaticCheckError
from harness.sandbox.supervisor import LoadError, SandboxUnavailable
from whale_jax.loop import schedule as sched
from whale_jax.loop.config import ConfigError, RunConfig
from whale_jax.loop.data import GCSFS_HINT, DomainData, gcsfs_missing, load_domain_data


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the preflight found: the run's data and plan (the run goes on with them), the initial
    harness, and one line per check passed."""

    data: DomainData
    plan: sched.Plan
    harness_name: str
    harness_source: str
    lines: tuple[str, ...]


def preflight(config: RunConfig) -> Checked:
    c = config
    lines = [check_directory(c.run_dir, "run_dir")]
    if c.mirror:
        lines.append(check_directory(c.mirror, "run_dir_mirror"))
    if c.checkpoint.directory:
        lines.append(check_directory(c.checkpoint_dir, "checkpoint_dir"))
    else:  # the default, beside the mirror or in the run directory
        lines.append(check_directory(c.checkpoint_dir, "checkpoint_dir", default=True))
    data = check_data(c)
    sizes = data.sizes()
    lines.append(f"data: {c.data.domain}, {data.source}; splits {sizes}"
                 + (f"; {data.bad_rows} bad rows skipped" if data.bad_rows else ""))  # fmt: skip
    try:
        lines += data.domain.check()
    except DataError as e:
        raise ConfigError(str(e)) from None
    plan = sched.make_plan(c, sizes["train"])
    lines.append(describe_plan(c, plan, sizes["train"]))
    found, model_cfg = check_model(c.model.model)
    lines += ["model: " + found, check_engine_devices(c), memory_plan(c, model_cfg)]
    lines += check_proposer(c)
    name, source = initial_harness(c, data)
    lines.append(check_harness(c, data, name, source))
    return Checked(data=data, plan=plan, harness_name=name, harness_source=source,
                   lines=tuple(lines))  # fmt: skip


def describe_plan(c: RunConfig, plan: sched.Plan, train_tasks: int) -> str:
    fixed = c.schedule.schedule == "fixed"
    return (f"plan: {plan.total_steps} RSFT steps ({c.schedule.epochs} epochs of {train_tasks} "
            f"tasks at batch {c.rsft.prompt_batch}), method {c.schedule.method}, "
            f"{c.schedule.schedule} schedule"
            + (f" (E = {plan.phase_steps} steps, I = {plan.iterations})" if fixed else ""))  # fmt: skip


def check_directory(path: str, flag: str, *, default: bool = False) -> str:
    """A directory the run writes: a probe file written and deleted there, or in the nearest
    existing parent when the directory is still to be made (the run makes it). ``default``: the
    flag was not given and ``path`` is its default."""
    name = f"--{flag} (default {path})" if default else f"--{flag}={path}"
    if "://" in path:
        return _check_url(path, flag, name)
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"{name}: a file, not a directory; name a directory")
    at = target
    while not os.path.exists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        raise ConfigError(f"{name}: {at} is a file, so the directory cannot be made")
    try:
        fd, probe = tempfile.mkstemp(prefix=".whale-probe-", dir=at)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{name}: cannot write in {at} ({e.strerror or e}); "
                          "name a directory this user can write") from None  # fmt: skip
    made = "" if at == target else f", to be made under {at}"
    return f"--{flag}: {target} writable{made}"


def _check_url(url: str, flag: str, name: str) -> str:
    if gcsfs_missing(url):
        raise ConfigError(f"{name}: {GCSFS_HINT}")
    from etils import epath

    probe = epath.Path(url) / f".whale-probe-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        probe.write_text("whale_jax preflight probe; deleted at once\n")
        probe.unlink()
    except Exception as e:  # gcsfs and google-auth raise their own types, not OSError
        raise ConfigError(f"{name}: cannot write there ({type(e).__name__}: {e}); check "
                          "the bucket's name and this machine's credentials") from None  # fmt: skip
    return f"--{flag}: {url} writable"


def check_data(c: RunConfig) -> DomainData:
    """The domain's tasks, as the run will load them; bad files name the fix."""
    d = c.data
    verify = (f"; check the files with: python -m whale_jax.fetch_data --domain={d.domain} "
              f"--data_dir={d.data_dir} --verify" if d.data_dir else "")  # fmt: skip
    try:
        return load_domain_data(d)
    except ConfigError as e:
        raise ConfigError(f"{e}{verify if 'fetch_data' not in str(e) else ''}") from None
    except MissingAPIKeyError as e:  # the judge's key, read when the domain is built
        raise ConfigError(f"--judge_api_key_env: {e}") from None
    except OSError as e:
        raise ConfigError(f"--data_dir={d.data_dir}: {e}{verify}") from None


def check_model(spec: str):
    """(what was found, the model's config) for ``--model``, no weight read."""
    from whale_jax.io.load import check_model as check
    from whale_jax.io.safetensors import CheckpointError

    try:
        return check(spec)
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"--model={spec}: {e}") from None


def engine_devices(c: RunConfig) -> list:
    """The local devices the rollouts run on (--engine_devices: 0 every one, N the first N)."""
    import jax

    local = jax.local_devices()
    if c.model.engine_devices > len(local):
        raise ConfigError(f"--engine_devices={c.model.engine_devices}: this host has "
                          f"{len(local)} devices")  # fmt: skip
    return local[: c.model.engine_devices or len(local)]


def check_engine_devices(c: RunConfig) -> str:
    """The slots and cache rows split evenly over the engine's devices (one engine each)."""
    m, devices = c.model, engine_devices(c)
    n = len(devices)
    for flag, value in (
        ("engine_slots", m.engine_slots),
        ("engine_cache_rows", m.engine_cache_rows),
    ):
        if value % n:
            raise ConfigError(f"--{flag}={value}: the engine runs on {n} devices (--engine_devices"
                              f"={m.engine_devices}) and needs a multiple of {n}")  # fmt: skip
    return f"engine: {n} device{'s' if n > 1 else ''} ({devices[0].platform}), " \
        f"{m.engine_slots // n} slots each"  # fmt: skip


def memory_plan(c: RunConfig, model_cfg) -> str:
    """The device memory the run's flags ask for, from the model's config: on each engine device
    a copy of the weights and its share of the slots and prefix-cache rows, and the trainer's
    fp32 masters and AdamW moments, which the mesh splits over every device (activations come
    on top: docs/training.md)."""
    import jax.numpy as jnp

    from whale_jax.engine.device import cache_bytes_per_slot

    m, gib = c.model, 2**30
    n = len(engine_devices(c))
    dtype = jnp.bfloat16 if m.dtype == "bfloat16" else jnp.float32
    params = model_cfg.num_params()
    weights = params * jnp.dtype(dtype).itemsize
    slot = cache_bytes_per_slot(model_cfg, m.max_len, dtype)
    slots, rows = m.engine_slots // n, m.engine_cache_rows // n
    cache = (f"{rows} cache rows {rows * slot / gib:.1f} GiB" if rows else
             f"at least {slots} cache rows {slots * slot / gib:.1f} GiB "
             "(--engine_cache_rows=0: more where memory allows)")  # fmt: skip
    where = f"on each of {n} engine devices" if n > 1 else "on the engine's device"
    line = (f"memory {where}: {weights / gib:.1f} GiB of {m.dtype} weights + {slots} slots x "
            f"{slot / 2**20:.0f} MiB = {slots * slot / gib:.1f} GiB + {cache}")  # fmt: skip
    if c.trains:
        line += (f"; trainer {params * 12 / gib:.1f} GiB of fp32 masters and AdamW moments "
                 "over the mesh")  # fmt: skip
    return line


def check_proposer(c: RunConfig) -> list[str]:
    """The proposer's API key in its variable, or a command proposer's program on PATH."""
    p = c.proposer
    if not c.searches:
        return []
    if p.kind in KEY_ENVS:
        var = p.api_key_env or KEY_ENVS[p.kind]
        try:
            key = api_key_from_env(var, p.base_url or BASE_URLS[p.kind], f"--proposer={p.kind}")
        except MissingAPIKeyError as e:
            raise ConfigError(f"--proposer_api_key_env: {e}; export it before the run "
                              "(tpu_setup/tpu.py: --pass_env)") from None  # fmt: skip
        where = "a loopback endpoint, no key" if key == LOOPBACK_KEY else f"key in ${var}"
        return [f"proposer: {p.kind} {p.model}, {where}"]
    if p.kind == "command":
        try:
            program = shlex.split(p.command)[0]
        except (ValueError, IndexError):
            raise ConfigError(f"--proposer_command={p.command!r}: not a command line") from None
        if shutil.which(program) is None:
            raise ConfigError(f"--proposer_command: {program!r} is not an executable "
                              "on PATH")  # fmt: skip
        return [f"proposer: command {program}"]
    return [f"proposer: {p.kind}"]


def initial_harness(c: RunConfig, data: DomainData) -> tuple[str, str]:
    """(name, source) of the harness the run starts from: --initial_harness or the domain's h0."""
    if not c.initial_harness:
        return "h0", data.domain.seed_harness()
    try:
        with open(c.initial_harness, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--initial_harness={c.initial_harness}: {e}") from None
    return os.path.splitext(os.path.basename(c.initial_harness))[0], source


def check_harness(c: RunConfig, data: DomainData, name: str, source: str) -> str:
    """The static check, then a load in the sandbox under the run's mode (no episode runs)."""
    flag = f"--initial_harness={c.initial_harness}" if c.initial_harness else f"{name} (the " \
        f"{c.data.domain} domain's seed harness)"  # fmt: skip
    policy = Policy(mode=c.model.sandbox) if c.model.sandbox else Policy()
    t0 = time.monotonic()
    try:
        protections = load_check(source, data.domain, ExecutorConfig(sandbox=policy))
    except StaticCheckError as e:
        first = e.violations[0]
        more = f" (and {len(e.violations) - 1} more)" if len(e.violations) > 1 else ""
        raise ConfigError(f"{flag}: fails the static check at {first}{more}; every episode "
                          "would score 0 (docs/harness.md, the contract)") from None  # fmt: skip
    except SandboxUnavailable as e:
        raise ConfigError(f"--sandbox={policy.mode} (or $WHALE_SANDBOX): this machine refuses "
                          f"it: {e}") from None  # fmt: skip
    except LoadError as e:
        raise ConfigError(f"{flag}: does not load in the sandbox: "
                          f"{e.error.strip().splitlines()[-1] if e.error.strip() else e}") from None  # fmt: skip
    except TimeoutError as e:
        raise ConfigError(f"{flag}: the sandbox did not load it ({e})") from None
    return (
        f"harness {name}: passes the static check and loads in the sandbox "
        f"(mode {policy.mode}, {len(protections)} layers, {time.monotonic() - t0:.1f}s)"
    )
