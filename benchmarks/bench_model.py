"""Model benchmark: our JAX forward passes beside transformers' PyTorch ones, same run, same CPU.

Measures, in fp32 on the local CPU:

1. the chunked gated delta rule (Qwen3.5's Gated DeltaNet mixer) at Qwen3.5-0.8B/2B per-layer head
   shapes: ``whale_jax.models.gated_delta.chunked_gated_delta_rule`` under ``jax.jit`` against
   transformers' ``torch_chunk_gated_delta_rule`` on the same inputs (outputs and final states are
   compared) and, in the full run, the backward pass (gradients compared). With more than one XLA
   CPU device (``--host_devices``; by default one per usable CPU) a case ``ours_tpN`` runs the same
   library function on inputs whose heads are split over the devices, as the sharding table lays
   out a layer on a tp mesh;
2. full-model prefill (logits for every position) on a small Qwen3.5 hybrid and a small dense Llama,
   both built from one HF config dict with the same weights: transformers builds the torch model,
   ``save_pretrained`` writes it, ``whale_jax.load_model`` reads it back;
3. XLA's and PyTorch's fp32 matmul rate, as context for the rest.

Timing (``common.time_cases``): every case is warmed up (JAX: an ahead-of-time compile, reported
separately), then the cases of one comparison run round-robin, alternating order each repeat, so
ours and the peer see the same background load; we report the median (and the best) wall time,
the process CPU time and the 1-minute load average. The machine may be shared: read speedups from
the same run, not across runs. ``--cpus 1`` pins the process to one CPU before JAX and torch start,
so both run single-threaded; on a shared two-core machine that is the comparison least disturbed
by the neighbours.

Run:  .venv/bin/python benchmarks/bench_model.py            (full, about five minutes)
      .venv/bin/python benchmarks/bench_model.py --quick    (about a minute)
Writes benchmarks/results/model.json (``--out`` to change; ``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import (
    QWEN3_5_SMALL,
    RESULTS,
    WATCHDOG,
    bench_matmul,
    build_pair,
    machine_info,
    save_results,
    time_cases,
    use_cpus,
)

# Qwen3.5-0.8B's text config (and, as far as we could check, 2B's): 16 key heads, 16 value heads,
# key/value head dim 128 per Gated DeltaNet layer. The default Qwen3_5TextConfig (9B-sized) has
# 32 value heads sharing 16 key heads, benchmarked as the grouped case.
GDN_SHAPE = {"Hk": 16, "Hv": 16, "K": 128, "V": 128}
GDN_GROUPED = {"Hk": 16, "Hv": 32, "K": 128, "V": 128}
CHUNK = 64

# A small dense Llama beside common.QWEN3_5_SMALL, the same width and depth.
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


def bench_gdn(T, shape, repeats, B=1) -> dict:
    """Forward pass of ours and torch on the same inputs."""
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


def bench_gdn_backward(T, shape, repeats, B=1) -> dict:
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


def bench_prefill(name: str, hf_config: dict, shapes, repeats, seed=0) -> dict:
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
    p.add_argument("--out", type=Path, default=RESULTS / "model.json", help="JSON output path")
    p.add_argument("--no-save", action="store_true", help="print only, write no JSON")
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
    use_cpus(args.cpus, args.host_devices)
    if hasattr(faulthandler, "register"):
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: stacks
    WATCHDOG.limit_s, WATCHDOG.verbose = args.watchdog, args.verbose
    WATCHDOG.summary = print_summary
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
        plan = [(2048, GDN_SHAPE, reps)]
        if not quick:
            long_reps = max(3, reps - 4)
            plan += [
                (512, GDN_SHAPE, reps),
                (8192, GDN_SHAPE, long_reps),
                (2048, GDN_GROUPED, long_reps),
            ]
        for T, shape, n in plan:
            r = bench_gdn(T, shape, n)
            results["gdn"].append(r)
            print_gdn(r)
            checkpoint()

    if "model" in sections:
        shapes = [(1, 512), (1, 2048)] if quick else [(1, 512), (4, 512), (1, 2048), (4, 2048)]
        print("\nprefill (logits for all positions), fp32", flush=True)
        results["model"] = []
        for n, c in MODELS.items():
            results["model"].append(bench_prefill(n, c, shapes, model_reps))
            checkpoint()

    if "gdn" in sections and not quick:
        # Last: should the backward hang XLA's CPU runtime (jax.grad through a triangular solve
        # has deadlocked it), the watchdog still saves everything measured before it.
        r = bench_gdn_backward(2048, GDN_SHAPE, max(3, reps - 4))
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
