"""What the benchmark programs share: the results file, the machine record, round-robin timing
under a watchdog, JAX's compile seconds, the small models built the same way on both sides, and
the matmul rate each run reports as context.

A program run as ``python benchmarks/<program>.py`` has ``benchmarks/`` first on ``sys.path``,
which is how it finds this module. Importing it puts the repository root before everything else,
so the program imports the working tree's ``whale_jax`` and ``harness`` however (or whether) the
package is installed. Nothing here imports JAX or torch at module level: programs that pin the
process to fewer CPUs (``use_cpus``) must do so before either starts.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"


def save_results(results: dict, out: Path | str) -> None:
    """Writes a benchmark's results as indented JSON (non-JSON values as strings)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")


# ------------------------------------------------------------------------------------------------
# machine


def git_state() -> dict:
    """The commit benchmarked, and which library files differ from it."""
    import subprocess

    def git(*a):
        return subprocess.run(
            ["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        return {
            "git_commit": git("rev-parse", "HEAD"),
            "git_modified": git("status", "--porcelain", "--", "whale_jax").splitlines(),
        }
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_modified": None}


def cpu_model() -> str:
    """The CPU's model name (speed ratios against a peer differ between CPU makes)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """Date, CPU, library versions, XLA host devices, commit and load average of a run."""
    import jax
    import torch
    import transformers

    try:
        import flax

        flax_version = flax.__version__
    except Exception:  # pragma: no cover
        flax_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "flax": flax_version,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "host_devices": jax.device_count(),
        **git_state(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }


def use_cpus(cpus: int, host_devices: int) -> None:
    """Pins the process to its first ``cpus`` usable CPUs (0: all), then exposes ``host_devices``
    XLA CPU devices (0: one per usable CPU). JAX and torch size their thread pools from the
    affinity mask when they start, so this must run before either is imported."""
    if cpus > 0:
        if "jax" in sys.modules or "torch" in sys.modules:
            raise SystemExit("--cpus must take effect before jax and torch are imported")
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cpus])
    import jax

    n = host_devices or len(os.sched_getaffinity(0))
    jax.config.update("jax_num_cpu_devices", n)  # before the backend starts


# ------------------------------------------------------------------------------------------------
# timing


class Watchdog:
    """Ends the run if one call hangs: prints every thread's stack, saves what was measured so
    far (with the hung call named under "error") and exits with status 3. A timed-out call cannot
    be interrupted from Python, so this is the only way out of a hang; block_until_ready releases
    the GIL, so the timer thread runs."""

    def __init__(self):
        self.limit_s = 0.0  # 0: off
        self.results: dict | None = None
        self.out: Path | None = None
        self.summary: Callable[[dict], None] | None = None  # prints the partial results
        self.verbose = False  # log every armed call to stderr
        self._timer = None

    def arm(self, label: str) -> None:
        self.disarm()
        if self.limit_s > 0:
            self._timer = threading.Timer(self.limit_s, self._fire, (label,))
            self._timer.daemon = True
            self._timer.start()
        if self.verbose:
            print(f"    [{time.strftime('%H:%M:%S')}] {label}", file=sys.stderr, flush=True)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self, label: str) -> None:
        msg = f"watchdog: {label} did not finish within {self.limit_s:g} s; giving up"
        print(f"\n{msg}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        if self.results is not None:
            self.results["error"] = msg
            if self.summary is not None:
                self.summary(self.results)
            if self.out is not None:
                save_results(self.results, self.out)
                print(f"partial results in {self.out}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)


WATCHDOG = Watchdog()


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _stats(times: list[float], cpu: list[float]) -> dict:
    return {
        "median_s": float(np.median(times)),
        "min_s": float(np.min(times)),
        "cpu_median_s": float(np.median(cpu)),
        "times_s": [round(t, 5) for t in times],
    }


def time_cases(cases: dict[str, Callable[[], object]], repeats: int, warm=None):
    """Warm up every case, then time them round-robin (order reversed every other repeat), so
    every case sees the same background load. Every call runs under ``WATCHDOG``.

    Each callable must finish its work before returning (block_until_ready for JAX). ``warm``
    maps a case to what to run instead of one call of the case itself as its warm-up (e.g. an
    ahead-of-time compile). Returns ({name: stats}, {name: last output}, {name: warm-up seconds},
    mean 1-minute load average while timing).
    """
    warm = warm or {}
    first, last = {}, {}
    for name, fn in cases.items():
        WATCHDOG.arm(f"warm {name}")
        t0 = time.perf_counter()
        out = warm.get(name, fn)()
        first[name] = time.perf_counter() - t0
        WATCHDOG.disarm()
        if name not in warm:
            last[name] = out
    times = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    loads = [_load()]
    names = list(cases)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            WATCHDOG.arm(f"run {name} #{r}")
            c0, t0 = time.process_time(), time.perf_counter()
            last[name] = cases[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            WATCHDOG.disarm()
        loads.append(_load())
    stats = {name: _stats(times[name], cpu[name]) for name in names}
    return stats, last, first, float(np.mean(loads))


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_COMPILE_S = {"total": 0.0, "listening": False}


def _count_compile(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _COMPILE_S["total"] += duration


def compile_timer():
    """A function returning the seconds JAX spent tracing, lowering and compiling since the
    previous call (JAX's own compile events)."""
    import jax

    if not _COMPILE_S["listening"]:  # once per process: listeners cannot be told apart
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _COMPILE_S["listening"] = True
    seen = [_COMPILE_S["total"]]

    def since() -> float:
        now = _COMPILE_S["total"]
        out, seen[0] = now - seen[0], now
        return out

    return since


def bench_matmul(n: int, repeats: int) -> dict:
    """XLA's and PyTorch's fp32 [n, n] x [n, n] matmul GFLOP/s: context for a run's other rates."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    mm = jax.jit(jnp.matmul)
    stats, _, _, load = time_cases(
        {"xla": lambda: mm(ja, jb).block_until_ready(), "torch": lambda: ta @ tb}, repeats
    )
    flops = 2.0 * n**3
    out = {"n": n, "load_1m": load}
    for name, s in stats.items():
        out[name] = {
            "gflops_median": flops / s["median_s"] / 1e9,
            "gflops_best": flops / s["min_s"] / 1e9,
            **s,
        }
    return out


# ------------------------------------------------------------------------------------------------
# models on both sides

# What every Qwen3.5 text model shares (the real GDN head dims, conv width, RoPE, norms, tying).
QWEN3_5_FAMILY = {
    "model_type": "qwen3_5_text",
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
    "attention_bias": False,
    "tie_word_embeddings": True,
}
# A small Qwen3.5 hybrid, sized so a whole comparison fits in minutes on two shared cores: the
# real 3:1 linear:full pattern, heads scaled with the width (2B: hidden 2048, 16 GDN heads of 128,
# 8 attention heads of 256 sharing 2 kv heads; here hidden 256, 2 GDN heads of 128 (the real head
# dims), 2 attention heads of 128 sharing one kv head).
QWEN3_5_SMALL = {
    **QWEN3_5_FAMILY,
    "vocab_size": 16384,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "max_position_embeddings": 4096,
}
TORCH_ATTN = "sdpa"


def build_pair(hf_config: dict, seed: int, tmp: Path):
    """(torch model, our jitted forward, info): same config dict, same weights."""
    import jax
    import torch
    import transformers
    from flax import nnx

    import whale_jax

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    config = transformers.CONFIG_MAPPING[model_type](**json.loads(json.dumps(cfg)))
    config._attn_implementation = TORCH_ATTN
    torch.manual_seed(seed)
    model_cls = {
        "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
    }[model_type]
    tmodel = model_cls(config).to(torch.float32).eval()
    # transformers' default init (std 0.02) leaves logits near zero; give every matrix a
    # 1/sqrt(fan_in) scale so the agreement check sees signals of order one.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tmodel.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    tmodel.save_pretrained(tmp, safe_serialization=True)
    loaded = whale_jax.load_model(tmp)
    graphdef, state = nnx.split(loaded.model)

    @jax.jit
    def forward(state, tokens_BT):
        return nnx.merge(graphdef, state)(tokens_BT)

    info = {
        "torch_attn_implementation": tmodel.config._attn_implementation,
        "num_params": int(sum(p.numel() for p in tmodel.parameters())),
    }
    return tmodel, (forward, state), info


def load_models(name: str, tmp: Path):
    """(our model, torch model, config) with the same fp32 weights: ``qwen3_5_small`` (built by
    ``build_pair``) or ``smollm2`` (the bundled GGUF, dequantised and saved as HF safetensors)."""
    import torch
    import transformers

    import whale_jax

    if name == "qwen3_5_small":
        tmodel, _, _ = build_pair(QWEN3_5_SMALL, 0, tmp)
        model, cfg, _ = whale_jax.load_model(tmp)
        return model, tmodel, cfg
    if name == "smollm2":
        from whale_jax.io.load import source_of
        from whale_jax.io.safetensors import save_hf

        model, cfg, _ = whale_jax.load_model("smollm2")
        save_hf(model, tmp, source_of(model).hf_config)  # the GGUF's weights, dequantised, as HF
        tmodel = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        tmodel.config._attn_implementation = "sdpa"
        return model, tmodel.eval(), cfg
    raise ValueError(name)


def flops_per_token(cfg, context: float) -> float:
    """Matmul FLOPs of one decode token at an average attended context."""
    from whale_jax.models.config import FULL

    params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    attn = sum(4 * context * cfg.num_heads * cfg.head_dim for k in cfg.layer_types if k == FULL)
    return 2.0 * params + attn
