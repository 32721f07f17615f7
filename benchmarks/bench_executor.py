"""Executor overhead with an instant model: model calls/s and per-call latency seen by harness code
at 1, 64 and 256 concurrent episodes. Everything measured is executor cost: IPC to and from the
sandboxed episode processes, budget checks, records, thread hand-offs (the model answers in
microseconds). Also: episode start (a jailed process forked from the zygote, until the harness's
first request reaches the executor), episodes per second for an empty harness, and the memory of
idle episode processes (each blocked in a model call; private pages: copy-on-write from the
zygote).

    .venv/bin/python benchmarks/bench_executor.py [--calls 50] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from common import save_results

from harness.api import Budgets
from harness.backends import ScriptedBackend
from harness.domains.arith import ArithDomain, generate
from harness.executor import Executor, ExecutorConfig

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


START = """
import time


def run(task, model, tools):
    model.chat([{"role": "user", "content": "t=" + repr(time.time())}], max_new_tokens=1)
    return None
"""


def episode_start(episodes: int) -> dict[str, float]:
    """Whole empty episodes, one at a time: from the executor's start request to the zygote,
    through fork, jail, module load, one model round trip (instant model) and the final report,
    to the record being scored. An upper bound on the episode start."""
    tasks = generate(episodes, seed=1)
    with Executor(ScriptedBackend(lambda request: "0"), ExecutorConfig(concurrency=1)) as ex:
        ex.run(START, ArithDomain(), tasks[:2])  # warm
        t0 = time.perf_counter()
        records = ex.run(START, ArithDomain(), tasks)
        wall = time.perf_counter() - t0
    bad = [r.stop_reason for r in records if r.stop_reason != "no_answer"]
    if bad:
        raise RuntimeError(f"benchmark episodes failed: {bad[:3]}")
    cycle = [(r.wall_s - r.calls[0].latency_s) * 1e3 for r in records]
    return {
        "episodes": episodes,
        "episode_cycle_p50_ms": round(statistics.median(cycle), 3),
        "episode_cycle_p90_ms": round(statistics.quantiles(cycle, n=10)[8], 3),
        "sequential_episodes_per_s": round(episodes / wall, 1),
    }


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _memory_kib(pid: int) -> tuple[int, int, int]:
    """(private, proportional, resident) KiB of one process."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                fields[parts[0][:-1]] = int(parts[1])
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return private, fields.get("Pss", 0), fields.get("Rss", 0)


def idle_memory(episodes: int) -> dict[str, float]:
    """Episodes blocked in a slow model call: measure their processes while they wait."""
    import threading

    seen: dict[str, float] = {}

    def respond(request):
        if not seen:
            seen["t"] = time.time()
        time.sleep(4.0)
        return "0"

    tasks = generate(episodes, seed=2)
    config = ExecutorConfig(concurrency=episodes, backend_threads=episodes + 8)
    with Executor(ScriptedBackend(respond), config) as ex:
        result: list = []
        t = threading.Thread(target=lambda: result.append(ex.run(START, ArithDomain(), tasks)))
        t.start()
        time.sleep(2.5)
        launchers = [p for p in _children(os.getpid())]
        episodes_pids = [e for z in launchers for zy in _children(z) for e in _children(zy)]
        zygotes = [zy for z in launchers for zy in _children(z)]
        mem = [_memory_kib(p) for p in episodes_pids]
        zmem = [_memory_kib(p) for p in zygotes]
        t.join()
    return {
        "episode_processes": len(mem),
        "private_kib_per_episode": round(statistics.mean(m[0] for m in mem), 1),
        "pss_kib_per_episode": round(statistics.mean(m[1] for m in mem), 1),
        "rss_kib_per_episode": round(statistics.mean(m[2] for m in mem), 1),
        "zygote_rss_kib": zmem[0][2] if zmem else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="model calls per episode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--start-episodes", type=int, default=200)
    parser.add_argument("--idle-episodes", type=int, default=256)
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
    start = episode_start(args.start_episodes)
    print(
        f"episode cycle (start to end, model time excluded): p50 {start['episode_cycle_p50_ms']}"
        f" ms, p90 {start['episode_cycle_p90_ms']} ms; {start['sequential_episodes_per_s']}"
        " episodes/s one at a time"
    )
    memory = idle_memory(args.idle_episodes)
    print(
        f"{memory['episode_processes']} idle episode processes: private "
        f"{memory['private_kib_per_episode']} KiB, PSS {memory['pss_kib_per_episode']} KiB, "
        f"RSS {memory['rss_kib_per_episode']} KiB each; zygote RSS {memory['zygote_rss_kib']} KiB"
    )
    result = {
        "benchmark": "executor overhead, instant model (ScriptedBackend)",
        "episode_start": start,
        "idle_memory": memory,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },  # fmt: skip
        "calls_per_episode": args.calls,
        "rows": rows,
    }
    save_results(result, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
