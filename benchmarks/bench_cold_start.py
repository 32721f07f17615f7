"""Cold start: how long a fresh process takes to roll out a workload, by how its engine programs
get compiled (SmolLM2-135M on the CPU; on a GPU with JAX_PLATFORMS=cuda).

Each case runs in a process of its own (jax's in-memory caches start empty), on bench_rollout's
workloads (``h0``, ``vote``, ``session``) and engine settings:

- ``first``: a first run. The persistent compilation cache is on and empty; every shape is
  compiled when the workload meets it. The shapes it met are written as a record
  (whale_jax/engine/warmup.py). This is the peer: what every start cost before the warm-up.
- ``resume``: the same cache, no warm-up (a resumed run before ``--engine_warm_up``): each shape is
  read from the cache when first met.
- ``resume_warm``: the same cache, warmed from the record before the first request
  (``--engine_warm_up=recorded``, the default).
- ``moved_warm``: an empty cache, warmed from the record (a run that moved to a fresh VM: the
  record travels with the run directory's mirror, the cache does not).
- ``all``: an empty cache, every shape the flags allow but the resumes compiled first
  (``--engine_warm_up=all``); once, on the first workload (the set depends on the flags only).

Reported per case: the cold start (seconds from the warm-up's start, or the workload's where there
is none, to the workload's end; the warm-up runs in the background as in a run), the seconds of
JAX's compile events (tracing, lowering, compiling; summed over threads, so they may exceed the
wall), the warm-up's programs (compiled by it, or taken over by the engine that met them first),
and the distinct shapes the workload met (``compile_counts``).

    .venv/bin/python benchmarks/bench_cold_start.py [--workloads h0,vote,session] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import compile_timer, cpu_model, git_state, save_results

HERE = Path(__file__).resolve().parent
CASES = ("first", "resume", "resume_warm", "moved_warm")


def child(args) -> dict:
    """One case in this process: the cache, the warm-up, the workload."""
    import jax
    from bench_rollout import workloads

    from harness.executor import Executor, ExecutorConfig
    from whale_jax.engine import warmup
    from whale_jax.engine.client import EngineClient
    from whale_jax.io.load import load_model
    from whale_jax.main import enable_compilation_cache

    enable_compilation_cache(args.cache, "")
    model, _, tokenizer = load_model("smollm2")
    source, domain, make_tasks = workloads()[args.workload]
    tasks = make_tasks(args.session_tasks if args.workload == "session" else args.tasks, 0)
    client = EngineClient(model, tokenizer, slots=args.slots, max_len=args.max_len,
                          steps=args.steps, prefill_batch=args.prefill_batch,
                          cache_rows=args.cache_rows)  # fmt: skip
    compiling = compile_timer()
    out = {"case": args.child, "workload": args.workload, "warm_up": None}
    t0 = time.perf_counter()
    handle = None
    if args.child in ("resume_warm", "moved_warm", "all"):
        # As a run does it: in the background, while the executor starts and requests queue.
        record = warmup.read_record(args.record) if args.child != "all" else None
        handle = client.engine.warm_up(record, everything=args.child == "all",
                                       workers=args.workers or None, background=True)  # fmt: skip
    with Executor(client, ExecutorConfig(concurrency=args.concurrency)) as ex:
        records = ex.run(source, domain, tasks, samples=args.samples)
    out["cold_start_s"] = round(time.perf_counter() - t0, 2)
    if handle is not None:
        out["warm_up"] = handle.result()
    out["compile_s"] = round(compiling(), 2)
    out["shapes"] = client.engine.compile_counts
    out["calls"] = sum(len(r.calls) for r in records)
    out["jax_device"] = jax.devices()[0].device_kind
    if args.child == "first":
        warmup.write_record(args.record, client.engine.shape_record())
    client.close()
    return out


def run_case(case: str, workload: str, cache: str, record: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--child", case, "--workload", workload,
           "--cache", cache, "--record", record]  # fmt: skip
    for name in ("tasks", "session_tasks", "samples", "slots", "max_len", "steps",
                 "prefill_batch", "cache_rows", "concurrency", "workers"):  # fmt: skip
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        raise RuntimeError(f"{case} {workload} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    warm = result["warm_up"]
    print(f"{workload:8s} {case:12s} cold start {result['cold_start_s']:6.1f} s "
          f"({result['compile_s']:.1f} s of JAX compile events)"
          + (f", warm-up {warm['compiled']} programs in {warm['seconds']:.1f} s, "
             f"{warm['taken']} taken by the engine" if warm else "")
          + f"; shapes met {sum(result['shapes'].values())} {result['shapes']}",
          flush=True)  # fmt: skip
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="h0,vote,session")
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--session-tasks", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill-batch", type=int, default=16)
    ap.add_argument("--cache-rows", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--workers", type=int, default=0, help="warm-up threads (0: the default)")
    ap.add_argument("--cases", default=",".join(CASES), help="of " + ", ".join(CASES)
                    + " (first is always run: it writes the record and fills the cache)")  # fmt: skip
    ap.add_argument("--no-all", action="store_true", help="skip the 'all' case (minutes)")
    ap.add_argument("--quick", action="store_true", help="8 tasks, h0 only, no 'all'")
    ap.add_argument("--out", default="benchmarks/results/cold_start.json")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    ap.add_argument("--record", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if args.quick:
        args.tasks, args.workloads, args.no_all = 8, "h0", True
    results = {
        "benchmark": "cold start: compiled as met, read from the cache, or warmed ahead",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "platform": platform.platform(),
            **git_state(),
        },  # fmt: skip
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("out", "child", "workload", "cache", "record")
        },  # fmt: skip
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="whale-cold-") as tmp:
        for i, workload in enumerate(args.workloads.split(",")):
            cache = os.path.join(tmp, f"{workload}-cache")
            record = os.path.join(tmp, f"{workload}-shapes.json")
            chosen = set(args.cases.split(",")) | {"first"}
            unknown = chosen - set(CASES)
            if unknown:
                raise SystemExit(f"--cases: {', '.join(sorted(unknown))} not among "
                                 f"{', '.join(CASES)}")  # fmt: skip
            cases = [c for c in CASES if c in chosen]
            cases += ["all"] if i == 0 and not args.no_all else []
            for case in cases:
                # first fills the cache the resumes read; the others start from an empty one
                shared = case in ("first", "resume", "resume_warm")
                where = cache if shared else os.path.join(tmp, f"{workload}-{case}-cache")
                results["runs"].append(run_case(case, workload, where, record, args))
                save_results(results, args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
