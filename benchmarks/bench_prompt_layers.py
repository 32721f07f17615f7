"""Prompt calls (prefill, resume) with the layers scanned over the stacked weights against
unrolled over per-group weights: compile time and run time per shape, on one CPU core.

The engine's decode loop unrolls its layers on the CPU (a decode step's few rows cannot pay for
the weight slice a scan step copies); this measures whether prefill and resume, whose P x T
tokens share that copy, should too. Each case runs the engine's own jitted prefill and resume
(engine/device.py) with the layer weights given either way, on the same weights and store: the first call (compile + one run) and the median of ``--repeats`` calls after it,
unrolled and scanned back to back per shape.

    .venv/bin/python benchmarks/bench_prompt_layers.py --model smollm2
    .venv/bin/python benchmarks/bench_prompt_layers.py --model qwen3_5_small
"""

from __future__ import annotations

import argparse
import ast
import os
import tempfile
import time
from pathlib import Path

from common import QWEN3_5_SMALL, RESULTS, build_pair, save_results

DEFAULT_SHAPES = "[(1,4,128),(16,4,128),(4,8,128),(2,24,192),(16,24,192),(8,48,256),(16,96,128)]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (bundled GGUF) or qwen3_5_small")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="(rows P, new tokens T, KV window)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU to pin the process to")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: results/)")
    args = ap.parse_args()
    os.sched_setaffinity(0, [args.cpu])  # before jax starts its threads

    import jax
    import numpy as np

    import whale_jax
    from whale_jax.engine import device as dv
    from whale_jax.engine.device import DeviceEngine

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "qwen3_5_small":
            build_pair(QWEN3_5_SMALL, 0, Path(tmp))
            model, _, _ = whale_jax.load_model(tmp)
        else:
            model, _, _ = whale_jax.load_model(args.model)
    eng = DeviceEngine(model, slots=64, max_len=512, cache_rows=64, unroll=True)
    groups = {"unrolled": eng.groups, "scanned": None}

    def timed(fn, *call_args):
        t = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        first = time.perf_counter() - t
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*call_args))
            runs.append(time.perf_counter() - t)
        return first, float(np.median(runs))

    rng = np.random.default_rng(0)
    cases = []
    print(f"{args.model}, CPU {args.cpu}, jax {jax.__version__}")
    print("| call | P x T (window) | unrolled: first s / run ms | scanned: first s / run ms |")
    print("|---|---|---|---|")
    for P, T, kv in ast.literal_eval(args.shapes):
        rows = np.arange(P, dtype=np.int32)
        start = np.full(P, kv - T - 8, np.int32)
        toks = rng.integers(0, 1000, (P, T)).astype(np.int32)
        n_new = np.full(P, T, np.int32)
        for call in ("resume", "prefill"):
            res = {}
            for name, g in groups.items():
                if call == "resume":
                    store = eng.store.cache
                    res[name] = timed(dv._resume, eng.graphdef, eng.kv, kv, eng.params, g, store,
                                      rows, start, toks, n_new)  # fmt: skip
                else:
                    res[name] = timed(dv._prefill, eng.graphdef, eng.params, g, toks, n_new)
            case = {"call": call, "P": P, "T": T, "window": kv if call == "resume" else None}
            for name, (first, run) in res.items():
                case[f"{name}_first_s"], case[f"{name}_run_s"] = first, run
            cases.append(case)
            u, s = res["unrolled"], res["scanned"]
            win = f" ({kv})" if call == "resume" else ""
            print(f"| {call} | {P} x {T}{win} | {u[0]:.2f} / {u[1] * 1e3:.1f} | "
                  f"{s[0]:.2f} / {s[1] * 1e3:.1f} |", flush=True)  # fmt: skip
    out = args.out or RESULTS / f"prompt_layers_{args.model}.json"
    save_results({"model": args.model, "cpu": args.cpu, "cases": cases}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
