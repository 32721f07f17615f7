"""Foundation benchmark: our JAX forward passes beside transformers' PyTorch ones, same run, same CPU.

Measures, in fp32 on the local CPU:

1. the chunked gated delta rule (Qwen3.5's Gated DeltaNet mixer) at Qwen3.5-0.8B/2B per-layer head
   shapes: ``whale_jax.models.gated_delta.chunked_gated_delta_rule`` under ``jax.jit`` against
   transformers' ``torch_chunk_gated_delta_rule`` on the same inputs (outputs and final states are
   compared), plus prototype variants of our kernel (defined below, checked against the reference)
   and, in the full run, the backward pass. With more than one XLA CPU device (``--host_devices``;
   by default one per usable CPU) a case ``ours_tpN`` runs the same library function on inputs whose
   heads are split over the devices, as the sharding table lays out a layer on a tp mesh;
2. full-model prefill (logits for every position) on a small Qwen3.5 hybrid and a small dense Llama,
   both built from one HF config dict with the same weights: transformers builds the torch model,
   ``save_pretrained`` writes it, ``whale_jax.load_model`` reads it back;
3. XLA's and PyTorch's fp32 matmul rate, as context for the rest.

Timing: every case is warmed up (JAX: an ahead-of-time compile, reported separately), then the cases
of one comparison run round-robin, alternating order each repeat, so ours and the peer see the same
background load; we report the median (and the best) wall time, the process CPU time and the
1-minute load average. The machine may be shared: read speedups from the same run, not across runs.
``--cpus 1`` pins the process to one CPU before JAX and torch start, so both run single-threaded;
on a shared two-core machine that is the comparison least disturbed by the neighbours.

Run:  .venv/bin/python benchmarks/bench_model.py            (full, about five minutes)
      .venv/bin/python benchmarks/bench_model.py --quick    (about a minute)
Writes benchmarks/results/model.json (``--out`` to change; ``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import gc
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Import the working tree's whale_jax, however (or whether) the package is installed.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results" / "model.json"

# Qwen3.5-0.8B's text config (and, as far as we could check, 2B's): 16 key heads, 16 value heads,
# key/value head dim 128 per Gated DeltaNet layer. The default Qwen3_5TextConfig (9B-sized) has
# 32 value heads sharing 16 key heads, benchmarked as the grouped case.
GDN_SHAPE = {"Hk": 16, "Hv": 16, "K": 128, "V": 128}
GDN_GROUPED = {"Hk": 16, "Hv": 32, "K": 128, "V": 128}
CHUNK = 64

# Small models for the prefill comparison, sized so the whole program fits in minutes on two
# shared cores. Qwen3.5: the real 3:1 linear:full pattern, heads scaled with the width (2B: hidden
# 2048, 16 GDN heads of 128, 8 attention heads of 256 sharing 2 kv heads; here hidden 256, 2 GDN
# heads of 128 (the real head dims), 2 attention heads of 128 sharing one kv head).
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
LLAMA_SMALL = {
    "model_type": "llama",
    "vocab_size": 16384,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
MODELS = {"qwen3_5_small": QWEN3_5_SMALL, "llama_small": LLAMA_SMALL}
TORCH_ATTN = "sdpa"


# ------------------------------------------------------------------------------------------------
# timing


VERBOSE = False


class Watchdog:
    """Ends the run if one call hangs: prints every thread's stack, saves what was measured so
    far (with the hung call named under "error") and exits with status 3. A timed-out call cannot
    be interrupted from Python, so this is the only way out of a hang; block_until_ready releases
    the GIL, so the timer thread runs."""

    def __init__(self):
        self.limit_s = 0.0  # 0: off
        self.results: dict | None = None
        self.out: Path | None = None
        self._timer = None

    def arm(self, label: str) -> None:
        import threading

        self.disarm()
        if self.limit_s > 0:
            self._timer = threading.Timer(self.limit_s, self._fire, (label,))
            self._timer.daemon = True
            self._timer.start()

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
            print_summary(self.results)
            if self.out is not None:
                save_results(self.results, self.out)
                print(f"partial results in {self.out}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)


WATCHDOG = Watchdog()


def _progress(msg: str) -> None:
    WATCHDOG.arm(msg)
    if VERBOSE:
        print(f"    [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def save_results(results: dict, out: Path | str) -> None:
    """Writes a benchmark's results as indented JSON (non-JSON values as strings)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")


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
    """Warm up every case, then time them round-robin (order reversed every other repeat).

    Each callable must finish its work before returning (block_until_ready for JAX). ``warm``
    maps a case to what to run instead of one call of the case itself as its warm-up (e.g. an
    ahead-of-time compile). Returns ({name: stats}, {name: last output}, {name: warm-up seconds},
    mean 1-minute load average while timing).
    """
    warm = warm or {}
    first, last = {}, {}
    for name, fn in cases.items():
        _progress(f"warm {name}")
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
            _progress(f"run {name} #{r}")
            c0, t0 = time.process_time(), time.perf_counter()
            last[name] = cases[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            WATCHDOG.disarm()
        loads.append(_load())
    stats = {name: _stats(times[name], cpu[name]) for name in names}
    return stats, last, first, float(np.mean(loads))


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


# ------------------------------------------------------------------------------------------------
# 3. matmul context


def bench_matmul(n: int, repeats: int) -> dict:
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
# 1. gated delta rule: prototype variants of our kernel
#
# Same math as whale_jax.models.gated_delta.chunked_gated_delta_rule (see its docstring), arranged
# differently, each checked against transformers in the same run:
# - gdn_inscan: the library's structure (everything inside a rematerialised scan body) with a
#   choice of solver for the (I + A) system: "trsm" = jax.scipy.linalg.solve_triangular (what the
#   library did before it switched to matmuls), "block" = the library's solve_unit_lower (block
#   forward substitution, b x b diagonal blocks inverted by repeated squaring) at another block;
# - gdn_hoisted: all chunk-local work (decays, the solve, Q K^T) batched over every chunk *before*
#   the scan, as transformers does; the scan then only carries the state through four matmuls;
# - gdn_split_heads: independent scans over disjoint head groups, for two cores to share.


def _solve(A, rhs, solver, block):
    """(I + A) X = rhs for strictly lower A [..., C, C]."""
    import jax

    from whale_jax.models.gated_delta import solve_unit_lower

    if solver == "trsm":
        return jax.scipy.linalg.solve_triangular(A, rhs, lower=True, unit_diagonal=True)
    if solver == "block":
        return solve_unit_lower(A, rhs, block=block)
    raise ValueError(solver)


def gdn_hoisted(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    g_BTH,
    beta_BTH,
    state_BHKV=None,
    *,
    chunk_size=64,
    solver="trsm",
    block=32,
    fuse_reads=False,
):
    """Prototype: chunked gated delta rule with the chunk-local work hoisted out of the scan.
    ``fuse_reads``: read the state for W and decayed Q with one [2C, K] @ [K, V] matmul."""
    import jax
    import jax.numpy as jnp

    from whale_jax.models.gated_delta import from_chunks, to_chunks

    (q, k, v, g, beta), S, layout = to_chunks(
        q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, chunk_size
    )
    C, V = layout.C, layout.V
    lower_incl = jnp.tril(jnp.ones((C, C), bool))
    lower_strict = jnp.tril(jnp.ones((C, C), bool), -1)

    G = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    decay = jnp.exp(jnp.where(lower_incl, G[..., :, None] - G[..., None, :], -jnp.inf))
    kk = jnp.einsum("nbhik,nbhjk->nbhij", k, k)
    A = jnp.where(lower_strict, beta[..., :, None] * kk * decay, 0.0)
    eG = jnp.exp(G)
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * eG)[..., None]], -1)
    solved = _solve(A, rhs, solver, block)
    U, W = solved[..., :V], solved[..., V:]
    attn = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * decay
    q_dec = q * eG[..., None]
    G_last = G[..., -1]
    k_to_end = k * jnp.exp(G_last[..., None] - G)[..., None]
    chunk_decay = jnp.exp(G_last)[..., None, None]

    def step(S_BHKV, xs):
        U_BHCV, W_BHCK, q_BHCK, attn_BHCC, k_BHCK, dec_BH11 = xs
        if fuse_reads:
            WQ_BH2CK = jnp.concatenate([W_BHCK, q_BHCK], axis=-2)
            read_BH2CV = jnp.einsum("bhck,bhkv->bhcv", WQ_BH2CK, S_BHKV)
            v_new = U_BHCV - read_BH2CV[..., :C, :]
            out = read_BH2CV[..., C:, :]
        else:
            v_new = U_BHCV - jnp.einsum("bhck,bhkv->bhcv", W_BHCK, S_BHKV)
            out = jnp.einsum("bhck,bhkv->bhcv", q_BHCK, S_BHKV)
        out = out + jnp.einsum("bhij,bhjv->bhiv", attn_BHCC, v_new)
        S_BHKV = dec_BH11 * S_BHKV + jnp.einsum("bhck,bhcv->bhkv", k_BHCK, v_new)
        return S_BHKV, out

    S, out_NBHCV = jax.lax.scan(step, S, (U, W, q_dec, attn, k_to_end, chunk_decay))
    return from_chunks(out_NBHCV, layout), S


def gdn_inscan(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    g_BTH,
    beta_BTH,
    state_BHKV=None,
    *,
    chunk_size=64,
    solver="block",
    block=16,
):
    """Prototype: the library's structure (all work inside a rematerialised scan body) with a
    choice of solver; ``solver="trsm"`` is the library before it switched to matmuls."""
    import jax
    import jax.numpy as jnp

    from whale_jax.models.gated_delta import from_chunks, to_chunks

    (q, k, v, g, beta), S, layout = to_chunks(
        q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, chunk_size
    )
    C, V = layout.C, layout.V
    lower_incl = jnp.tril(jnp.ones((C, C), bool))
    lower_strict = jnp.tril(jnp.ones((C, C), bool), -1)

    @jax.checkpoint
    def chunk(S, xs):
        q, k, v, g, beta = xs
        G = jnp.cumsum(g, axis=-1)
        decay = jnp.exp(jnp.where(lower_incl, G[..., :, None] - G[..., None, :], -jnp.inf))
        kk = jnp.einsum("bhik,bhjk->bhij", k, k)
        A = jnp.where(lower_strict, beta[..., :, None] * kk * decay, 0.0)
        rhs = jnp.concatenate([v * beta[..., None], k * (beta * jnp.exp(G))[..., None]], -1)
        solved = _solve(A, rhs, solver, block)
        U, W = solved[..., :V], solved[..., V:]
        v_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S)
        attn = jnp.einsum("bhik,bhjk->bhij", q, k) * decay
        out = jnp.exp(G)[..., None] * jnp.einsum("bhck,bhkv->bhcv", q, S)
        out = out + jnp.einsum("bhij,bhjv->bhiv", attn, v_new)
        G_last = G[..., -1]
        k_to_end = k * jnp.exp(G_last[..., None] - G)[..., None]
        S = jnp.exp(G_last)[..., None, None] * S + jnp.einsum("bhck,bhcv->bhkv", k_to_end, v_new)
        return S, out

    S, out_NBHCV = jax.lax.scan(chunk, S, (q, k, v, g, beta))
    return from_chunks(out_NBHCV, layout), S


def gdn_split_heads(
    q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV=None, *, parts=2, inner=None, **kwargs
):
    """Prototype: ``parts`` independent scans over disjoint groups of heads in one program, so
    XLA's runtime can run them on different cores at once (one scan's small ops cannot use
    more than one core well)."""
    import jax.numpy as jnp

    if inner in (None, "lib"):
        from whale_jax.models.gated_delta import chunked_gated_delta_rule as inner
    Hk, Hv = k_BTHK.shape[2], v_BTHV.shape[2]
    parts = max(1, min(parts, Hk))
    assert Hk % parts == 0, (Hk, parts)
    hk, hv = Hk // parts, Hv // parts
    outs, states = [], []
    for i in range(parts):
        ks, vs = slice(i * hk, (i + 1) * hk), slice(i * hv, (i + 1) * hv)
        s0 = None if state_BHKV is None else state_BHKV[:, vs]
        o, st = inner(
            q_BTHK[:, :, ks],
            k_BTHK[:, :, ks],
            v_BTHV[:, :, vs],
            g_BTH[:, :, vs],
            beta_BTH[:, :, vs],
            s0,
            **kwargs,
        )
        outs.append(o)
        states.append(st)
    return jnp.concatenate(outs, axis=2), jnp.concatenate(states, axis=1)


# name -> (function, keyword arguments)
VARIANTS = {
    "old_trsm": (gdn_inscan, dict(solver="trsm")),
    "inscan_block32": (gdn_inscan, dict(solver="block", block=32)),
    "hoisted_block16": (gdn_hoisted, dict(solver="block", block=16)),
    "hoisted_block16_fused": (gdn_hoisted, dict(solver="block", block=16, fuse_reads=True)),
    "hoisted_trsm": (gdn_hoisted, dict(solver="trsm")),
    "split2": (gdn_split_heads, dict(parts=2, inner="lib")),
}
# At T=2048 by default: the library before its solver change, and the transformers-like layout.
DEFAULT_VARIANTS = ("old_trsm", "hoisted_block16")


def _variant(name):
    fn, kwargs = VARIANTS[name]
    return functools.partial(fn, chunk_size=CHUNK, **kwargs)


# ------------------------------------------------------------------------------------------------
# 1. gated delta rule: ours vs transformers


def gdn_inputs(B, T, Hk, Hv, K, V, seed=0):
    """Realistic inputs: l2-normalised q, k; g from Qwen3.5's -exp(A_log) * softplus(a + dt)."""
    rng = np.random.default_rng(seed)

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = l2(rng.standard_normal((B, T, Hk, K))).astype(np.float32)
    k = l2(rng.standard_normal((B, T, Hk, K))).astype(np.float32)
    v = rng.standard_normal((B, T, Hv, V)).astype(np.float32)
    A = np.exp(rng.uniform(np.log(0.05), np.log(16.0), Hv))  # slow and fast heads
    a = rng.standard_normal((B, T, Hv)) - 2.0
    g = (-A * np.log1p(np.exp(a))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, Hv))))).astype(np.float32)
    return q, k, v, g, beta


def _torch_gdn():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.torch_chunk_gated_delta_rule


def _head_sharded(arrays):
    """(case name, the GDN inputs with their heads split over every host device) — the layout the
    sharding table gives a Gated DeltaNet layer on a tp mesh — or None on one device. Each device
    then runs the whole chunk scan for its heads, so the cores work without per-op hand-offs."""
    import jax
    from jax.sharding import NamedSharding

    from whale_jax.sharding import logical_spec, make_mesh

    n = jax.device_count()
    if n < 2:
        return None
    mesh = make_mesh(data=1, fsdp=1, tp=n)
    axes = [("batch", None, "heads", None)] * 3 + [("batch", None, "heads")] * 2
    placed = [
        jax.device_put(x, NamedSharding(mesh, logical_spec(x.shape, a, mesh)))
        for x, a in zip(arrays, axes, strict=True)
    ]
    return f"ours_tp{n}", placed


def _compiled_case(fn, args):
    """(case, warm-up) for a jitted JAX function: the warm-up compiles ahead of time."""
    import jax

    jitted = jax.jit(fn)
    holder = {}

    def warm():
        holder["f"] = jitted.lower(*args).compile()

    def case():
        return jax.block_until_ready(holder["f"](*args))

    return case, warm


def bench_gdn(T, shape, repeats, variants, B=1) -> dict:
    """Forward pass of ours, torch and the prototype ``variants`` on the same inputs."""
    import jax.numpy as jnp
    import torch

    from whale_jax.models.gated_delta import chunked_gated_delta_rule

    torch_fn = _torch_gdn()
    arrays = gdn_inputs(B, T, shape["Hk"], shape["Hv"], shape["K"], shape["V"])
    jargs = [jnp.asarray(x) for x in arrays]
    targs = [torch.from_numpy(x) for x in arrays]

    def run_torch(xs=targs):
        with torch.no_grad():
            return torch_fn(
                *xs, chunk_size=CHUNK, output_final_state=True, use_qk_l2norm_in_kernel=False
            )

    cases, warm = {}, {}
    ours = functools.partial(chunked_gated_delta_rule, chunk_size=CHUNK)
    cases["ours"], warm["ours"] = _compiled_case(ours, jargs)
    if (split := _head_sharded(arrays)) is not None:
        cases[split[0]], warm[split[0]] = _compiled_case(ours, split[1])
    cases["torch"] = run_torch
    warm["torch"] = lambda: run_torch([t[:, : 4 * CHUNK] for t in targs])
    for name in variants:
        cases[name], warm[name] = _compiled_case(_variant(name), jargs)
    stats, last, first, load = time_cases(cases, repeats, warm)

    ref_out, ref_state = (t.numpy() for t in last["torch"])
    scale = float(np.abs(ref_out).max())
    result = {"B": B, "T": T, **shape, "chunk_size": CHUNK, "load_1m": load, "cases": {}}
    for name, s in stats.items():
        entry = {**s, "tokens_per_s": B * T / s["median_s"]}
        if name != "torch":
            out, state = (np.asarray(x) for x in last[name])
            entry["compile_s"] = first[name]
            entry["max_abs_diff_out"] = float(np.abs(out - ref_out).max())
            entry["max_abs_diff_state"] = float(np.abs(state - ref_state).max())
            entry["rel_diff_out"] = entry["max_abs_diff_out"] / scale
            entry["speedup_vs_torch"] = stats["torch"]["median_s"] / s["median_s"]
        result["cases"][name] = entry
    del last
    return result


def bench_gdn_backward(T, shape, repeats, variants, B=1) -> dict:
    """Forward + backward of sum(out): jax.grad w.r.t. all five inputs vs torch autograd."""
    import jax
    import jax.numpy as jnp
    import torch

    from whale_jax.models.gated_delta import chunked_gated_delta_rule

    torch_fn = _torch_gdn()
    arrays = gdn_inputs(B, T, shape["Hk"], shape["Hv"], shape["K"], shape["V"])
    jargs = [jnp.asarray(x) for x in arrays]
    targs = [torch.from_numpy(x) for x in arrays]

    def grad_of(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a)[0]), argnums=(0, 1, 2, 3, 4))

    def torch_case(xs=targs):
        xs = [t.clone().requires_grad_(True) for t in xs]
        out, _ = torch_fn(
            *xs, chunk_size=CHUNK, output_final_state=True, use_qk_l2norm_in_kernel=False
        )
        out.sum().backward()
        return [x.grad for x in xs]

    cases, warm = {}, {}
    ours = functools.partial(chunked_gated_delta_rule, chunk_size=CHUNK)
    cases["ours"], warm["ours"] = _compiled_case(grad_of(ours), jargs)
    if (split := _head_sharded(arrays)) is not None:
        cases[split[0]], warm[split[0]] = _compiled_case(grad_of(ours), split[1])
    cases["torch"] = torch_case
    warm["torch"] = lambda: torch_case([t[:, : 4 * CHUNK] for t in targs])
    for name in variants:
        cases[name], warm[name] = _compiled_case(grad_of(_variant(name)), jargs)
    stats, last, first, load = time_cases(cases, repeats, warm)
    ref = [t.numpy() for t in last["torch"]]
    out = {"B": B, "T": T, **shape, "chunk_size": CHUNK, "load_1m": load, "cases": {}}
    for name, s in stats.items():
        entry = dict(s)
        if name != "torch":
            grads = [np.asarray(x) for x in last[name]]
            entry["compile_s"] = first[name]
            entry["max_rel_diff_grads"] = max(
                float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                for a, b in zip(grads, ref, strict=True)
            )
            entry["speedup_vs_torch"] = stats["torch"]["median_s"] / s["median_s"]
        out["cases"][name] = entry
    return out


# ------------------------------------------------------------------------------------------------
# 2. full-model prefill


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


def bench_model(name: str, hf_config: dict, shapes, repeats, seed=0) -> dict:
    import jax.numpy as jnp
    import torch

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmodel, (forward, state), info = build_pair(hf_config, seed, Path(tmp))
    result = {
        "name": name,
        "config": hf_config,
        **info,
        "build_s": time.perf_counter() - t0,
        "runs": [],
    }
    rng = np.random.default_rng(seed + 1)
    warmed = []

    def warm_torch():  # once per model, on a short input: torch has nothing to compile
        if not warmed:
            with torch.no_grad():
                tmodel(input_ids=torch.zeros((1, 64), dtype=torch.int64), use_cache=False)
            warmed.append(True)

    for B, T in shapes:
        tokens = rng.integers(0, hf_config["vocab_size"], (B, T), dtype=np.int32)
        jt, tt = jnp.asarray(tokens), torch.from_numpy(tokens.astype(np.int64))

        compiled = {}

        def compile_ours(jt=jt, compiled=compiled):
            compiled["f"] = forward.lower(state, jt).compile()

        def ours(jt=jt, compiled=compiled):
            return compiled["f"](state, jt).block_until_ready()

        def peer(tt=tt):
            with torch.no_grad():
                return tmodel(input_ids=tt, use_cache=False).logits

        stats, last, first, load = time_cases(
            {"ours": ours, "torch": peer}, repeats, {"ours": compile_ours, "torch": warm_torch}
        )
        ref = last["torch"].numpy()
        diff = float(np.abs(np.asarray(last["ours"]) - ref).max())
        scale = float(np.abs(ref).max())
        del last
        gc.collect()
        run = {
            "B": B,
            "T": T,
            "load_1m": load,
            "max_abs_diff_logits": diff,
            "max_abs_logit": scale,
            "rel_diff_logits": diff / scale,
        }
        for case, s in stats.items():
            run[case] = {**s, "tokens_per_s": B * T / s["median_s"]}
        run["ours"]["compile_s"] = first["ours"]
        run["speedup_vs_torch"] = stats["torch"]["median_s"] / stats["ours"]["median_s"]
        result["runs"].append(run)
        print(
            f"  {name:14s} B={B} T={T:5d}  ours {run['ours']['tokens_per_s']:8.0f} tok/s  "
            f"torch {run['torch']['tokens_per_s']:8.0f} tok/s  x{run['speedup_vs_torch']:.2f}  "
            f"rel diff {run['rel_diff_logits']:.1e}  load {load:.1f}",
            flush=True,
        )
    return result


# ------------------------------------------------------------------------------------------------
# report


def _ms(s):
    return f"{s * 1e3:9.1f}"


def _row(name, c, diff_key):
    sp = f"{c['speedup_vs_torch']:8.2f}" if "speedup_vs_torch" in c else f"{'1.00':>8s}"
    d = f"{c[diff_key]:9.1e}" if diff_key in c else f"{'ref':>9s}"
    return f"  {name:18s} {_ms(c['median_s'])} {_ms(c['min_s'])} {sp} {d}"


def print_gdn(r: dict) -> None:
    shape = f"B={r['B']} T={r['T']} Hk={r['Hk']} Hv={r['Hv']} K={r['K']} V={r['V']}"
    print(f"\ngated delta rule forward  {shape}  (load {r['load_1m']:.1f})")
    print(f"  {'case':18s} {'median ms':>9s} {'best ms':>9s} {'x torch':>8s} {'max|diff|':>9s}")
    for name, c in r["cases"].items():
        print(_row(name, c, "max_abs_diff_out"))
    sys.stdout.flush()


def print_gdn_backward(r: dict) -> None:
    shape = f"B={r['B']} T={r['T']} Hk={r['Hk']} Hv={r['Hv']} K={r['K']} V={r['V']}"
    print(f"\ngated delta rule forward+backward  {shape}  (load {r['load_1m']:.1f})")
    print(f"  {'case':18s} {'median ms':>9s} {'best ms':>9s} {'x torch':>8s} {'rel diff':>9s}")
    for name, c in r["cases"].items():
        print(_row(name, c, "max_rel_diff_grads"))
    sys.stdout.flush()


def print_summary(results: dict) -> None:
    """One markdown table of the headline numbers (what docs/benchmarks.md shows)."""
    print("\n| what | shape | ours | torch | ours / torch | max abs diff | load |")
    print("|---|---|---|---|---|---|---|")
    if "matmul" in results:
        mm = results["matmul"]
        print(
            f"| matmul GFLOP/s | {mm['n']}^3 | {mm['xla']['gflops_median']:.1f} | "
            f"{mm['torch']['gflops_median']:.1f} | "
            f"{mm['xla']['gflops_median'] / mm['torch']['gflops_median']:.2f} | | "
            f"{mm['load_1m']:.1f} |"
        )
    for r in results.get("gdn", []):
        shape = f"T={r['T']} Hk={r['Hk']} Hv={r['Hv']}"
        t = r["cases"]["torch"]["median_s"] * 1e3
        for name, c in r["cases"].items():
            if name == "torch":
                continue
            print(
                f"| GDN fwd ms ({name}) | {shape} | {c['median_s'] * 1e3:.0f} | {t:.0f} | "
                f"{c['speedup_vs_torch']:.2f}x | {c['max_abs_diff_out']:.1e} | "
                f"{r['load_1m']:.1f} |"
            )
    if "gdn_backward" in results:
        r = results["gdn_backward"]
        t = r["cases"]["torch"]["median_s"] * 1e3
        for name, c in r["cases"].items():
            if name != "torch":
                print(
                    f"| GDN fwd+bwd ms ({name}) | T={r['T']} Hk={r['Hk']} Hv={r['Hv']} | "
                    f"{c['median_s'] * 1e3:.0f} | {t:.0f} | {c['speedup_vs_torch']:.2f}x | "
                    f"{c['max_rel_diff_grads']:.1e} (rel) | {r['load_1m']:.1f} |"
                )
    for m in results.get("model", []):
        for run in m["runs"]:
            print(
                f"| {m['name']} prefill tok/s | B={run['B']} T={run['T']} | "
                f"{run['ours']['tokens_per_s']:.0f} | {run['torch']['tokens_per_s']:.0f} | "
                f"{run['speedup_vs_torch']:.2f}x | {run['max_abs_diff_logits']:.1e} "
                f"(rel {run['rel_diff_logits']:.0e}) | {run['load_1m']:.1f} |"
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (about a minute)")
    p.add_argument(
        "--only",
        choices=["matmul", "gdn", "model"],
        action="append",
        help="run only these sections (repeatable)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per case")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    p.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    p.add_argument(
        "--variants",
        choices=["default", "all"],
        default="default",
        help="GDN prototypes at T=2048: the default few, or all of VARIANTS",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=0,
        help="pin the process to this many CPUs before JAX and torch start (0: all); with 1,"
        " both run single-threaded and timings stop depending on the neighbours' load",
    )
    p.add_argument(
        "--host_devices",
        type=int,
        default=0,
        help="expose this many XLA CPU devices (0: one per CPU the process may use); with more"
        " than one, the GDN sections add a case with the heads split over them (ours_tpN)",
    )
    p.add_argument("--verbose", action="store_true", help="log every warm-up and timed call")
    p.add_argument(
        "--watchdog",
        type=float,
        default=600.0,
        help="if one call takes longer (seconds; 0: never), dump all stacks, save and exit",
    )
    args = p.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    if args.cpus > 0:
        # Before jax/torch are imported: both size their thread pools from the affinity mask.
        if "jax" in sys.modules or "torch" in sys.modules:
            raise SystemExit("--cpus must take effect before jax and torch are imported")
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    import jax  # after the pinning: its CPU thread pool is sized from the affinity mask

    host_devices = args.host_devices or len(os.sched_getaffinity(0))
    jax.config.update("jax_num_cpu_devices", host_devices)  # before the backend starts
    if hasattr(faulthandler, "register"):
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: stacks
    WATCHDOG.limit_s = args.watchdog
    sections = set(args.only or ["matmul", "gdn", "model"])
    quick = args.quick
    reps = args.repeats or (3 if quick else 7)
    model_reps = args.repeats or (2 if quick else 3)

    t_start = time.perf_counter()
    machine = machine_info()
    print(
        f"{machine['cpu_model']}  {machine['cpu_count']} cores  jax {machine['jax']}  "
        f"torch {machine['torch']} ({machine['torch_threads']} threads)  "
        f"transformers {machine['transformers']}  load {machine['load_avg_start']}",
        flush=True,
    )
    results = {
        "machine": machine,
        "cpus_pinned": args.cpus,
        "quick": quick,
        "repeats": reps,
        "model_repeats": model_reps,
        "timing": "median wall time over round-robin repeats after one warm-up call",
    }
    WATCHDOG.results, WATCHDOG.out = results, (None if args.no_save else args.out)

    def checkpoint():
        if not args.no_save:
            save_results(results, args.out)

    if "matmul" in sections:
        mm = bench_matmul(2048, reps)
        results["matmul"] = mm
        print(
            f"\nfp32 matmul 2048^3: XLA {mm['xla']['gflops_median']:.1f} GFLOP/s "
            f"(best {mm['xla']['gflops_best']:.1f}), torch {mm['torch']['gflops_median']:.1f} "
            f"(best {mm['torch']['gflops_best']:.1f})  load {mm['load_1m']:.1f}",
            flush=True,
        )
        checkpoint()

    if "gdn" in sections:
        results["gdn"] = []
        explore = list(VARIANTS) if args.variants == "all" else list(DEFAULT_VARIANTS)
        plan = [(2048, GDN_SHAPE, [] if quick else explore, reps)]
        if not quick:
            long_reps = max(3, reps - 4)
            plan += [
                (512, GDN_SHAPE, [], reps),
                (8192, GDN_SHAPE, [], long_reps),
                (2048, GDN_GROUPED, [], long_reps),
            ]
        for T, shape, variants, n in plan:
            r = bench_gdn(T, shape, n, variants)
            results["gdn"].append(r)
            print_gdn(r)
            checkpoint()

    if "model" in sections:
        shapes = [(1, 512), (1, 2048)] if quick else [(1, 512), (4, 512), (1, 2048), (4, 2048)]
        print("\nprefill (logits for all positions), fp32", flush=True)
        results["model"] = []
        for n, c in MODELS.items():
            results["model"].append(bench_model(n, c, shapes, model_reps))
            checkpoint()

    if "gdn" in sections and not quick:
        # Last: jax.grad through solve_triangular (the library's solver until 2026-12-02)
        # deadlocked XLA's multi-threaded CPU runtime here; should a backward hang again, the
        # watchdog keeps everything measured before it.
        r = bench_gdn_backward(2048, GDN_SHAPE, max(3, reps - 4), [])
        results["gdn_backward"] = r
        print_gdn_backward(r)
        checkpoint()

    results["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["total_s"] = time.perf_counter() - t_start
    print_summary(results)
    print(f"\ntotal {results['total_s']:.0f} s, load at end {results['machine']['load_avg_end']}")
    if not args.no_save:
        save_results(results, args.out)
        print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
