"""Executor overhead with an instant model: model calls/s and per-call latency seen by harness code
at 1, 64 and 256 concurrent episodes. Everything measured is executor cost: IPC to and from the
sandboxed worker, budget checks, records, thread hand-offs (the model answers in microseconds).

    .venv/bin/python benchmarks/bench_executor.py [--calls 50] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.backends import ScriptedBackend  # noqa: E402
from harness.budgets import Budgets  # noqa: E402
from harness.domains.arith import ArithDomain, generate  # noqa: E402
from harness.executor import Executor, ExecutorConfig  # noqa: E402

HARNESS = """
import time

CALLS = {calls}


def run(task, model, tools):
    waits = []
    reply = ""
    for i in range(CALLS):
        t0 = time.perf_counter()
        reply = model.chat([{{"role": "user", "content": task.question}}], max_new_tokens=8)
        waits.append(time.perf_counter() - t0)
    print(" ".join(str(round(w * 1e6)) for w in waits))
    return reply
"""


def measure(episodes: int, calls: int) -> dict[str, float]:
    backend = ScriptedBackend(lambda request: "42")
    budgets = Budgets(model_calls=calls + 1, turns=calls + 1, assistant_tokens=10 * calls + 10)
    config = ExecutorConfig(concurrency=episodes, budgets=budgets)
    tasks = generate(episodes, seed=0)
    with Executor(backend, config) as ex:
        ex.run(HARNESS.format(calls=1), ArithDomain(), tasks[:1])  # warm imports, page cache
        t0 = time.perf_counter()
        records = ex.run(HARNESS.format(calls=calls), ArithDomain(), tasks)
        wall = time.perf_counter() - t0
    bad = [r.stop_reason for r in records if r.stop_reason != "answered"]
    if bad:
        raise RuntimeError(f"benchmark episodes failed: {bad[:3]}")
    waits_us = [int(x) for r in records for x in r.output.split()]
    backend_us = [c.latency_s * 1e6 for r in records for c in r.calls]
    n = len(waits_us)
    q = statistics.quantiles(waits_us, n=100)
    return {
        "episodes": episodes,
        "calls": n,
        "wall_s": round(wall, 3),
        "calls_per_s": round(n / wall, 1),
        "amortized_overhead_ms": round(1e3 * wall / n, 4),
        "latency_p50_ms": round(q[49] / 1e3, 3),
        "latency_p90_ms": round(q[89] / 1e3, 3),
        "latency_p99_ms": round(q[98] / 1e3, 3),
        "backend_p50_ms": round(statistics.median(backend_us) / 1e3, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="model calls per episode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--out", default="benchmarks/results/executor.json")
    args = parser.parse_args()
    rows = []
    for episodes in args.concurrency:
        row = measure(episodes, args.calls)
        rows.append(row)
        print(
            f"{episodes:4d} episodes  {row['calls_per_s']:9.1f} calls/s  "
            f"amortized {row['amortized_overhead_ms']:.3f} ms/call  "
            f"latency p50 {row['latency_p50_ms']:.3f} ms  p90 {row['latency_p90_ms']:.3f} ms  "
            f"p99 {row['latency_p99_ms']:.3f} ms"
        )
    result = {
        "benchmark": "executor overhead, instant model (ScriptedBackend)",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },  # fmt: skip
        "calls_per_episode": args.calls,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
