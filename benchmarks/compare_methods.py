"""WHALE against its baselines on the offline demo, over several seeds: each (method, seed) is one
run of ``python -m whale_jax.main --flagfile=experiments/demo.flags --method=M --seed=S``, the
same splits (``--split_seed`` fixed) and weight budget (6 RSFT steps); harness-only spends no
weight episodes, weight-only no harness episodes. Prints and saves, per method, the final test
mean@8 (mean over seeds with a normal 95% interval of that mean), the initial one, the
validation-chosen pair's test score and the episodes spent, the RSFT rows by the origin of their
verdict (the answer's session, a verified extra session) and the sessions dropped, and writes one
report over all runs.

    .venv/bin/python benchmarks/compare_methods.py [--seeds 0 1 2] [--methods whale weight-only ...]
        [--extra=--search_cost=tokens --root runs/compare-tokens --out ...]

Runs that already finished are reused (their directories are under --root); delete --root to
measure again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from common import REPO, machine_info, save_results

from harness.search import frontier
from harness.search.archive import Archive
from whale_jax.loop.report import write_report
from whale_jax.train.rows import ROW_ORIGINS, SESSION_OUTCOMES

ROW_KEYS = ("kept", "rows", *ROW_ORIGINS, *SESSION_OUTCOMES)


def accepted_by_cost(run_dir: str) -> list[dict[str, dict]]:
    """Per harness phase of the run, the candidate each cost axis of the frontier accepts, from the
    archive's summaries (the proposals do not depend on the axis: the offline proposer builds on
    the best candidate by success, then turns)."""
    out = []
    for phase in Archive(os.path.join(run_dir, "archive")).phases():
        cands = phase.candidates()
        scored = [(c.name, c.summary) for c in cands if c.summary is not None]
        if scored:
            incoming = cands[0].name
            picks = {cost: frontier.accept(scored, incoming, cost=cost) for cost in frontier.COSTS}
            out.append({cost: {"accepted": name, "frontier": front}
                        for cost, (name, front, _) in picks.items()})  # fmt: skip
    return out


def rsft_totals(run_dir: str) -> dict[str, int]:
    """The RSFT steps' row and session counts, summed over the run's metric lines."""
    totals = dict.fromkeys(ROW_KEYS, 0)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "rsft":
                for k in ROW_KEYS:
                    totals[k] += int(record.get(k, 0))
    return totals


def interval(values: list[float]) -> tuple[float, float, float]:
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+",
                   default=["whale", "weight-only", "harness-only", "stagewise"])  # fmt: skip
    p.add_argument("--root", default="runs/compare")
    p.add_argument("--out", default="benchmarks/results/compare_methods.json")
    p.add_argument("--extra", action="append", default=[],
                   help="a flag passed to every run (repeatable), e.g. --extra=--search_cost=tokens")  # fmt: skip
    args = p.parse_args(argv)

    rows: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            run_dir = os.path.join(args.root, f"{method}-s{seed}")
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "whale_jax.main", "--flagfile=experiments/demo.flags",
                   f"--method={method}", f"--seed={seed}", f"--run_dir={run_dir}",
                   "--progress=false", "--report=false", *args.extra]  # fmt: skip
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-4000:])
                raise SystemExit(f"{method} seed {seed} failed ({done.returncode})")
            with open(os.path.join(REPO, run_dir, "summary.json")) as f:
                s = json.load(f)
            row = {
                "seed": seed,
                "initial_test": s["initial"]["test"],
                "final_test": s["final"]["test"],
                "best_test": s["best"].get("test"),
                "test_at_validation_best": s["best"].get("test_at_validation_best"),
                "weight_episodes": s["cost"]["weight_episodes"],
                "harness_episodes": s["cost"]["harness_episodes"],
                "wall_s": round(time.perf_counter() - t0, 1),
                "accepted_harness": s["harness"]["id"],
                **rsft_totals(os.path.join(REPO, run_dir)),
                "accepted_by_cost": accepted_by_cost(os.path.join(REPO, run_dir)),
            }
            rows[method].append(row)
            print(f"{method:13s} seed {seed}: initial {row['initial_test']:.3f} -> final "
                  f"{row['final_test']:.3f} (weight eps {row['weight_episodes']:.0f}, harness eps "
                  f"{row['harness_episodes']:.0f}, harness {row['accepted_harness']}, "
                  f"rows answer/verified {row['rows_answer']}/{row['rows_verified']}, dropped "
                  f"{row['dropped_rejected']}, {row['wall_s']:.0f}s)", flush=True)  # fmt: skip

    summary = {}
    print(
        "\nmethod         final test mean@8 (95% CI over seeds)   test at val-best   episodes (W+H)"
    )
    for method, rs in rows.items():
        final = interval([r["final_test"] for r in rs])
        chosen = interval([r["test_at_validation_best"] or 0.0 for r in rs])
        eps = statistics.fmean(r["weight_episodes"] + r["harness_episodes"] for r in rs)
        summary[method] = {"final_test": final, "test_at_validation_best": chosen,
                           "episodes": eps, "runs": rs}  # fmt: skip
        print(f"{method:13s}  {final[0]:.3f} [{final[1]:.3f}, {final[2]:.3f}]"
              f"                {chosen[0]:.3f}             {eps:.0f}")  # fmt: skip
    dirs = [os.path.join(REPO, args.root, f"{m}-s{s}") for s in args.seeds for m in args.methods]
    report = write_report(dirs, os.path.join(REPO, args.root, "report"))
    out = {"benchmark": "WHALE vs baselines on the demo", "machine": machine_info(),
           "command": "benchmarks/compare_methods.py " + " ".join(argv or sys.argv[1:]),
           "seeds": args.seeds, "extra": args.extra, "methods": summary, "report": os.path.relpath(report, REPO)}  # fmt: skip
    save_results(out, args.out)
    print(f"saved {args.out}; report {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
