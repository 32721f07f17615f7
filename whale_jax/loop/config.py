"""The WHALE run's configuration: one frozen tree of dataclasses, built by ``whale_jax.main`` from
absl flags (the only place flags exist) and by tests directly.

The tree reuses the parts' own configs (``RSFTConfig``, ``TrainConfig``/``OptimConfig``,
``SearchConfig``/``ValidationConfig``) and adds what only the loop needs: data, model and engine,
schedule, evaluation, checkpoints, the proposer and reporting. ``validate`` checks the whole tree
for contradictions before any work starts and names the flag at fault; ``config_hash`` is what a
resumed run must match (operational fields such as paths, checkpoint frequency and progress bars
may change between restarts and are left out).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

from harness import domains
from harness.api import SamplingSettings
from harness.judge import JUDGES
from harness.search.phase import SearchConfig
from whale_jax.train.rsft import RSFTConfig
from whale_jax.train.trainer import TrainConfig

# DataConfig fields only some domains read (each folder's ``OPTIONS`` names its own).
DOMAIN_OPTIONS = frozenset({"arith_difficulty", "arith_pool", "retriever_url", "math_verify",
                            "test_per_source", "judge", "judge_model", "judge_base_url",
                            "judge_api_key_env"})  # fmt: skip
METHODS = ("whale", "weight-only", "harness-only", "fast-slow", "stagewise")
SCHEDULES = ("fixed", "adaptive")
PROPOSERS = ("offline", "gemini", "openai", "command")


WARM_UPS = ("auto", "recorded", "all", "off")  # --engine_warm_up (whale_jax/engine/warmup.py)


class ConfigError(ValueError):
    """A flag (named in the message) is missing, malformed or contradicts another."""


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric flag's allowed values: finite, within [low, high], an end excluded when open."""

    path: str  # the RunConfig field the flag sets, dotted
    low: float = -math.inf
    high: float = math.inf
    open_low: bool = False
    open_high: bool = False

    def ok(self, value: float) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def describe(self) -> str:
        if self.high == math.inf:
            return f"must be a finite number {'>' if self.open_low else '>='} {self.low:g}"
        if self.low == -math.inf:
            return f"must be a finite number {'<' if self.open_high else '<='} {self.high:g}"
        lo, hi = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"must be in {lo}{self.low:g}, {self.high:g}{hi}"


POSITIVE = dict(low=0.0, open_low=True)
# Every numeric flag but the sampling ones (``SamplingSettings.errors`` owns those): the flag, the
# config field it sets and its range. absl checks them as the flags are parsed (whale_jax.main),
# and ``validate`` checks a config built in code against the same table.
RANGES: dict[str, Range] = {
    "seed": Range("seed", 0),
    "split_seed": Range("data.split_seed", 0),
    "train_size": Range("data.train_size", 0),
    "search_size": Range("data.search_size", 1),
    "validation_size": Range("data.validation_size", 0),
    "test_size": Range("data.test_size", 0),
    "test_per_source": Range("data.test_per_source", 0),
    "arith_difficulty": Range("data.arith_difficulty", 1),
    "arith_pool": Range("data.arith_pool", 1),
    "engine_slots": Range("model.engine_slots", 1),
    "engine_devices": Range("model.engine_devices", 0),
    "max_len": Range("model.max_len", 2),
    "concurrency": Range("model.concurrency", 0),
    "engine_cache_rows": Range("model.engine_cache_rows", 0),
    "compile_workers": Range("model.compile_workers", 0),
    "engine_steps": Range("model.engine_steps", 0),
    "engine_prefill_batch": Range("model.engine_prefill_batch", 0),
    "engine_prompt_mib": Range("model.engine_prompt_mib", 0),
    "prompt_batch": Range("rsft.prompt_batch", 1),
    "samples": Range("rsft.samples", 1),
    # Rewards lie in [0, 1] and an episode is kept above the threshold: at 1 nothing ever is; below
    # 0 every episode is (training on every sample, verified or not: an ablation).
    "reward_threshold": Range("rsft.reward_threshold", high=1.0, open_high=True),
    "minibatch_episodes": Range("rsft.minibatch_episodes", 1),
    "lr": Range("train.optim.learning_rate", **POSITIVE),
    "warmup_steps": Range("train.optim.warmup_steps", 0),
    "decay_steps": Range("train.optim.decay_steps", 0),
    "weight_decay": Range("train.optim.weight_decay", 0.0),
    "max_grad_norm": Range("train.optim.max_grad_norm", 0.0),
    "seq_len": Range("train.seq_len", 2),
    "micro_tokens": Range("train.micro_tokens", 1),
    "epochs": Range("schedule.epochs", **POSITIVE),
    "weight_epochs": Range("schedule.weight_epochs", **POSITIVE),
    "harness_iterations": Range("schedule.harness_iterations", 1),
    "adaptive_window": Range("schedule.window_epochs", **POSITIVE),
    "adaptive_burn_in": Range("schedule.burn_in_epochs", **POSITIVE),
    "adaptive_patience": Range("schedule.patience_epochs", **POSITIVE),
    "search_min_proposals": Range("search.min_proposals", 1),
    "search_patience": Range("search.patience", 1),
    "search_max_proposals": Range("search.max_proposals", 1),
    "harness_phases": Range("schedule.harness_phases", 0),
    "harness_budget": Range("schedule.harness_budget", 0),
    "slots": Range("search.slots", 1),
    "search_samples": Range("search.samples", 1),
    "audit_tasks": Range("search.validation.audit_tasks", 1),
    "proposer_timeout_s": Range("proposer.timeout_s", **POSITIVE),
    "eval_samples": Range("eval.samples", 1),
    "eval_every_epochs": Range("eval.every_epochs", 0.0),
    "checkpoint_keep": Range("checkpoint.keep", 1),
    "checkpoint_every_steps": Range("checkpoint.every_steps", 0),
    "checkpoint_every_minutes": Range("checkpoint.every_minutes", 0.0),
    "preemption_grace_s": Range("checkpoint.preemption_grace_s", 0.0),
}


def range_error(flag: str, value: Any) -> str | None:
    """``--flag=value: must be ...`` when ``value`` is outside the flag's range, else None."""
    r = RANGES[flag]
    return None if r.ok(value) else f"--{flag}={value}: {r.describe()}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    domain: str = "arith"
    # Where ``python -m whale_jax.fetch_data`` put the real data ("": the domain's offline tasks).
    data_dir: str = ""
    split_seed: int = 0  # fixes every split (a keyed hash of each task's identity)
    train_size: int = 0  # weight-training tasks (0: all that remain after the other splits)
    search_size: int = 256  # harness-search split (the paper: 256)
    validation_size: int = 256  # chooses the weights/harness pair; never read by switching
    test_size: int = 256  # generated/offline domains and chess (math: AIME; searchqa: 7 sets)
    test_per_source: int = 100  # searchqa: periodic test tasks per benchmark (0: all)
    arith_difficulty: int = 1
    arith_pool: int = 2000  # generated arith problems before splitting
    retriever_url: str = ""  # searchqa: a Search-R1 retrieval server ("": BM25 in process)
    math_verify: bool = False  # math: fall back to math-verify when the boxed string differs
    # searchqa: an LLM judge when exact match fails ("": none; openai | gemini), at temperature 0
    judge: str = ""
    judge_model: str = ""
    judge_base_url: str = ""  # "": the provider's endpoint
    judge_api_key_env: str = ""  # "": OPENAI_API_KEY / GEMINI_API_KEY
    domain_dir: str = ""  # a directory of the user's own domain folders (harness.domains)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSettings:
    model: str = "smollm2"  # a directory, .gguf, hub id or "smollm2" (see whale_jax.io.load)
    dtype: str = "float32"  # engine weights and activations
    engine_slots: int = 64  # over all the engine's devices
    engine_devices: int = 0  # this host's devices the rollouts use (0: every local device)
    max_len: int = 2048  # tokens per engine slot (prompt + completion of one call)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 20
    max_new_tokens: int = 1024
    concurrency: int = 0  # episodes in flight (0: twice the engine slots)
    engine_cache_rows: int = 0  # prefix-cache rows (0: two per episode in flight, memory allowing)
    sandbox: str = ""  # strict | shared_uid | landlock ("": $WHALE_SANDBOX or strict)
    # Engine programs compiled before the first rollout (whale_jax/engine/warmup.py): "recorded"
    # (the shapes this run met before it stopped), "all" (and every shape the flags allow but
    # the resumes), "off"; "auto": recorded on accelerators, off on the CPU (where it measured
    # no gain: docs/benchmarks.md, "Cold start").
    engine_warm_up: str = "auto"
    compile_workers: int = 0  # threads of that warm-up (0: half the host's cores, at most 8)
    # The engine's call sizes (0: by backend or memory: whale_jax/engine/engine.py, ``resolve``).
    engine_steps: int = 0  # decode steps per generate call
    engine_prefill_batch: int = 0  # most prompts per prefill or resume call
    engine_prompt_mib: int = 0  # device memory one prefill or resume call may take

    def engine_options(self) -> dict[str, int]:
        """The ``EngineConfig`` fields these settings give; the rest are left to the engine."""
        given = {"steps": self.engine_steps, "prefill_batch": self.engine_prefill_batch,
                 "prompt_bytes": self.engine_prompt_mib * 2**20}  # fmt: skip
        return {k: v for k, v in given.items() if v}

    def sampling(self) -> SamplingSettings:
        """A model call's default settings: these flags, nothing else."""
        return SamplingSettings(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                max_new_tokens=self.max_new_tokens)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    method: str = "whale"
    schedule: str = "fixed"
    epochs: float = 6.0  # weight-training budget in epochs of the weight-training split
    weight_epochs: float = 0.6  # E: one weight phase (fixed schedule)
    harness_iterations: int = 6  # I: iterations per harness phase, the incoming one counted
    # Adaptive weight phase, in epochs (converted to steps, at least 1): the sliding-window mean
    # training reward (window W) must set a phase-best within P steps once B steps are done.
    window_epochs: float = 0.2
    burn_in_epochs: float = 0.2
    patience_epochs: float = 0.2
    harness_phases: int = 0  # harness-only: phases (0: one, of ``harness_budget`` iterations)
    # harness-only (one phase) and stagewise: the harness phase's iterations, the incoming
    # harness's evaluation counted (0: every iteration WHALE's fixed schedule would make).
    harness_budget: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    samples: int = 8  # mean@k (8: the paper's mean@8)
    every_epochs: float = 0.1  # periodic evaluation in weight phases (0: boundaries only)
    test: bool = True
    validation: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    directory: str = ""  # "": <run_dir>/checkpoints; gs://bucket/path works (see docs)
    keep: int = 2  # the last N, plus the validation-best
    every_steps: int = 0  # also save every N RSFT steps (0: only phase ends and time)
    every_minutes: float = 30.0  # also save when this long has passed since the last save
    preemption_grace_s: float = 25.0  # SIGTERM: save only if a save fits in what is left of it


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProposerConfig:
    kind: str = "offline"
    model: str = ""  # gemini / openai model name
    base_url: str = ""  # openai-compatible endpoint ("": the provider's)
    api_key_env: str = ""  # the variable holding the key ("": GEMINI_API_KEY / OPENAI_API_KEY)
    command: str = ""  # command proposer template with {prompt} or {prompt_file}
    timeout_s: float = 1800.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    run_dir: str = "runs/run"
    mirror: str = ""  # the run directory mirrored here (gs://... for preemptible VMs; mirror.py)
    seed: int = 0
    initial_harness: str = ""  # a harness file to start from ("": the domain's seed h0)
    data: DataConfig = DataConfig()
    model: ModelSettings = ModelSettings()
    rsft: RSFTConfig = RSFTConfig()
    train: TrainConfig = TrainConfig()
    search: SearchConfig = SearchConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    proposer: ProposerConfig = ProposerConfig()
    report: bool = True  # Markdown + PNG report at the end
    tensorboard: bool = True
    progress: bool = True  # progress bars on stderr

    @property
    def trains(self) -> bool:
        return self.schedule.method != "harness-only"

    @property
    def searches(self) -> bool:
        return self.schedule.method != "weight-only"

    @property
    def checkpoint_dir(self) -> str:
        base = self.mirror or self.run_dir  # with a mirror, the checkpoints live beside it
        return self.checkpoint.directory or f"{base.rstrip('/')}/checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Fields that may differ on resume: where things live and how often/loudly the run reports.
OPERATIONAL = (
    "run_dir",
    "mirror",
    "checkpoint.directory",
    "checkpoint.keep",
    "checkpoint.every_steps",
    "checkpoint.every_minutes",
    "checkpoint.preemption_grace_s",
    "report",
    "tensorboard",
    "progress",
    "proposer.timeout_s",
    "proposer.api_key_env",
    "model.concurrency",
    "model.engine_cache_rows",
    "model.engine_devices",
    "model.sandbox",
    "model.engine_warm_up",
    "model.compile_workers",
    "model.engine_steps",
    "model.engine_prefill_batch",
    "model.engine_prompt_mib",
)


def strip_operational(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict without the fields that may change on resume (a copy)."""
    d = json.loads(json.dumps(d))
    for dotted in OPERATIONAL:
        *parents, leaf = dotted.split(".")
        node = d
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return d


def hashed_view(config: RunConfig) -> dict[str, Any]:
    return strip_operational(config.to_dict())


def config_hash(config: RunConfig) -> str:
    text = json.dumps(hashed_view(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every differing leaf (for the refusal message on resume)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def steps_for(epochs: float, split_size: int, prompt_batch: int) -> int:
    """Epochs of the weight-training split as RSFT steps (prompt batches), at least 1."""
    return max(1, math.ceil(epochs * split_size / prompt_batch - 1e-9))


def validate(config: RunConfig) -> None:
    """Contradictions and impossible values, each naming its flag (``--name``)."""
    d, s, m, e, p = config.data, config.schedule, config.model, config.eval, config.proposer

    def need(ok: bool, flag: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"--{flag}: {why}")

    for flag, r in RANGES.items():
        value = config
        for part in r.path.split("."):
            value = getattr(value, part)
        problem = range_error(flag, value)
        if problem:
            raise ConfigError(problem)

    if d.domain_dir:
        try:
            domains.add_domain_dir(d.domain_dir)
        except ValueError as e:
            raise ConfigError(f"--domain_dir: {e}") from None
    need(d.domain in domains.names(), "domain",
         f"{d.domain!r} is not one of {', '.join(domains.names())}")  # fmt: skip
    try:
        reads = set(getattr(domains.plugin(d.domain), "OPTIONS", ()))
    except ValueError as e:
        raise ConfigError(f"--domain: {e}") from None
    defaults = DataConfig()
    # A domain's own setting given to a domain that does not read it is a mistake, not a no-op.
    for name in sorted(DOMAIN_OPTIONS - reads):
        if getattr(d, name) != getattr(defaults, name):
            raise ConfigError(f"--{name}: the {d.domain} domain does not read it")
    need(d.judge in ("", *JUDGES), "judge", f"{d.judge!r}: expected openai or gemini")
    need(not d.judge or bool(d.judge_model), "judge_model", f"--judge={d.judge} needs a model")
    need(s.method in METHODS, "method", f"{s.method!r} is not one of {', '.join(METHODS)}")
    need(s.schedule in SCHEDULES, "schedule", f"{s.schedule!r}: expected fixed or adaptive")
    need(p.kind in PROPOSERS, "proposer", f"{p.kind!r} is not one of {', '.join(PROPOSERS)}")
    if s.schedule == "adaptive":
        need(s.method in ("whale", "fast-slow"), "schedule",
             f"adaptive switching needs alternation; --method={s.method} does not alternate")  # fmt: skip
    if s.method in ("whale", "fast-slow") and s.schedule == "fixed":
        need(s.weight_epochs <= s.epochs, "weight_epochs",
             f"E = {s.weight_epochs} is longer than the whole budget --epochs={s.epochs}")  # fmt: skip
    if s.harness_budget and s.method not in ("harness-only", "stagewise"):
        raise ConfigError("--harness_budget: only for --method=harness-only or stagewise (the "
                          "others run phases of --harness_iterations)")  # fmt: skip
    if s.harness_phases and s.method != "harness-only":
        raise ConfigError("--harness_phases: only for --method=harness-only (the others derive "
                          "their harness phases from the schedule)")  # fmt: skip
    for key, problem in m.sampling().errors():
        need(False, key, problem)
    need(m.max_new_tokens < m.max_len, "max_new_tokens",
         f"{m.max_new_tokens} leaves no room for a prompt in --max_len={m.max_len}")  # fmt: skip
    need(m.dtype in ("float32", "bfloat16"), "dtype", "float32 or bfloat16")
    need(m.sandbox in ("", "strict", "shared_uid", "landlock"), "sandbox",
         f"{m.sandbox!r}: strict, shared_uid or landlock")  # fmt: skip
    need(m.engine_warm_up in WARM_UPS, "engine_warm_up",
         f"{m.engine_warm_up!r}: {', '.join(WARM_UPS)}")  # fmt: skip
    if e.validation:
        need(d.validation_size >= 1, "validation_size",
             "validation evaluation is on (--eval_validation) but the split is empty")  # fmt: skip
    if config.searches and p.kind in ("gemini", "openai"):
        need(bool(p.model), "proposer_model", f"--proposer={p.kind} needs a model name")
    if config.searches and p.kind == "command":
        need("{prompt}" in p.command or "{prompt_file}" in p.command, "proposer_command",
             "the template needs {prompt} or {prompt_file} where the task goes")  # fmt: skip
    need(not config.initial_harness or os.path.isfile(config.initial_harness),
         "initial_harness", f"{config.initial_harness}: no such file")  # fmt: skip
    if config.mirror and "://" not in config.mirror:  # a local path: not inside the run dir
        mirror, run = os.path.abspath(config.mirror), os.path.abspath(config.run_dir)
        need(os.path.commonpath([mirror, run]) not in (mirror, run), "run_dir_mirror",
             f"{config.mirror} and --run_dir={config.run_dir} contain one another")  # fmt: skip
