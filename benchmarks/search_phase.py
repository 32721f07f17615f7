"""Evidence for Meta-Harness search: one harness phase with the offline proposer behind the real
engine (SmolLM2-135M-Instruct, offline), on any domain's offline data, and each candidate's search-split
score with its paired interval against the incoming harness (h0), so a reader sees whether the
search beats h0 by more than sampling noise.

    .venv/bin/python benchmarks/search_phase.py --domain arith [--tasks 256] [--iterations 6]

An interrupted run resumes from its archive when started again (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time

from common import save_results

from harness.api import SamplingSettings
from harness.domains import skill_text
from harness.executor import Executor, ExecutorConfig
from harness.search import frontier
from harness.search.archive import Archive
from harness.search.phase import HarnessPhase, SearchConfig
from harness.search.proposers.offline import OfflineProposer
from whale_jax.engine.client import EngineClient
from whale_jax.io.load import load_model
from whale_jax.loop.config import DataConfig
from whale_jax.loop.data import load_domain_data


def domain_and_tasks(name: str, n: int, seed: int):
    """The domain's offline data (its folder's ``load``): its search split of ``n`` tasks."""
    spec = DataConfig(domain=name, split_seed=seed, search_size=n, validation_size=8, test_size=8)
    data = load_domain_data(spec)
    return data.domain, data.search


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domain", default="arith")
    p.add_argument("--tasks", type=int, default=256)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--engine-slots", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--archive", default="/tmp/whale-search-evidence")
    p.add_argument("--fresh", action="store_true", help="delete the archive first (else resume)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = args.out or f"benchmarks/results/search_phase_{args.domain}.json"

    domain, tasks = domain_and_tasks(args.domain, args.tasks, args.seed)
    model, _, tokenizer = load_model("smollm2")
    client = EngineClient(model, tokenizer, slots=args.engine_slots, max_len=args.max_len,
                          seed=args.seed)  # fmt: skip
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=20, max_new_tokens=256)
    executor = Executor(client, ExecutorConfig(concurrency=args.engine_slots * 2,
                                               default_settings=settings))  # fmt: skip
    if args.fresh:
        shutil.rmtree(args.archive, ignore_errors=True)
    archive = Archive(args.archive)
    phase = HarnessPhase(
        archive=archive, index=1, domain=domain, executor=executor, search_tasks=tasks,
        proposer=OfflineProposer(seed=args.seed), skill=skill_text(domain.name),
        config=SearchConfig(iterations=args.iterations, slots=args.slots),
        weights={"step": 0, "model": "SmolLM2-135M-Instruct"},
        log=lambda s: print(s, flush=True),
    )  # fmt: skip
    t0 = time.perf_counter()
    result = phase.run(domain.seed_harness())
    wall = time.perf_counter() - t0
    incoming = next(c for c in result.candidates if c.name.endswith("incoming"))
    rows = []
    for c in result.candidates:
        row = {"name": c.name, "iteration": c.iteration, "changes": c.proposal.get("changes", "")}
        if c.summary is None:
            row["invalid"] = c.invalid
        else:
            row.update(success_rate=round(c.summary["success_rate"], 4),
                       mean_turns=round(c.summary["mean_turns"], 3),
                       errors=c.summary["errors"])  # fmt: skip
            if c is not incoming:
                iv = frontier.paired_interval(c.summary["rewards"], incoming.summary["rewards"])
                row["vs_h0"] = {k: round(v, 4) for k, v in iv.items()}
        rows.append(row)
        print(row, flush=True)
    result_json = {
        "benchmark": f"Meta-Harness phase, offline proposer, {args.domain}",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "command": "benchmarks/search_phase.py " + " ".join(argv or sys.argv[1:]),
        "tasks": len(tasks),
        "iterations": args.iterations,
        "slots": args.slots,
        "wall_s": round(wall, 1),
        "accepted": result.accepted.name,
        "frontier": result.frontier,
        "detail": result.detail,
        "candidates": rows,
    }
    save_results(result_json, out)
    executor.close()
    client.close()
    print(f"saved {out}; archive at {args.archive}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
