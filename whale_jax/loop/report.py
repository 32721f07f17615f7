"""The run report: Markdown + PNG plots from one or more run directories.

    python -m whale_jax.loop.report RUN_DIR [RUN_DIR ...] [--out DIR]

- a table per run: method, schedule, steps, mean@k of the initial pair, the final pair, the best,
  the test score of the pair chosen on validation, and the cost counters;
- ``mean_at_k.png``: test mean@k against the episodes spent learning (weight-phase rollouts plus
  harness-search evaluations), every run given side by side;
- ``timeline.png``: each run's phases against wall time;
- the harness lineage: each harness phase's accepted harness, its search-split score, and the
  diff against the harness it replaced.

Reads only ``metrics.jsonl``, ``config.json`` and ``archive/`` (docs/loop.md has the layout).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Any

from whale_jax.loop.metrics import read_metrics


def _load(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a whale_jax run directory?)")
    config = {}
    if os.path.exists(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f).get("config", {})
    return {"dir": run_dir, "lines": read_metrics(path), "config": config}


def _label(run: dict[str, Any]) -> str:
    c = run["config"]
    s = c.get("schedule", {})
    return f"{s.get('method', '?')}/{s.get('schedule', '?')} seed {c.get('seed', '?')} ({os.path.basename(os.path.normpath(run['dir']))})"


def _learning_episodes(line: dict[str, Any]) -> float:
    cost = line.get("cost", {})
    return cost.get("weight_episodes", 0) + cost.get("harness_episodes", 0)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _plots(runs: list[dict[str, Any]], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    # One colour per method, one line style per seed: many runs stay readable side by side.
    methods = sorted({r["config"].get("schedule", {}).get("method", "?") for r in runs})
    seeds = sorted({str(r["config"].get("seed", "?")) for r in runs})
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        evals = [x for x in run["lines"] if x["kind"] == "eval" and "test" in x]
        method = run["config"].get("schedule", {}).get("method", "?")
        seed = str(run["config"].get("seed", "?"))
        if evals:
            ax.plot([_learning_episodes(x) for x in evals], [x["test"] for x in evals],
                    marker="o", label=_label(run), color=f"C{methods.index(method) % 10}",
                    linestyle=styles[seeds.index(seed) % len(styles)])  # fmt: skip
    ax.set_xlabel("episodes spent learning (weight phases + harness evaluation)")
    ax.set_ylabel("test mean@k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mean_at_k.png"), dpi=120)
    plt.close(fig)
    made.append("mean_at_k.png")

    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(runs)))
    colors = {"weight": "tab:blue", "harness": "tab:orange"}
    for i, run in enumerate(runs):
        start = next((x["wall_s"] for x in run["lines"] if x["kind"] == "start"), 0.0)
        for x in run["lines"]:
            if x["kind"] == "phase_end":
                ax.barh(i, x["wall_s"] - start, left=start, color=colors[x["phase_kind"]],
                        edgecolor="white")  # fmt: skip
                start = x["wall_s"]
    ax.set_yticks(range(len(runs)), [_label(r) for r in runs], fontsize=7)
    ax.set_xlabel("wall time (s); blue: weight phase, orange: harness phase")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "timeline.png"), dpi=120)
    plt.close(fig)
    made.append("timeline.png")
    return made


def _lineage(run: dict[str, Any]) -> list[str]:
    root = os.path.join(run["dir"], "archive")
    out: list[str] = []
    prev_path = os.path.join(root, "initial.py")
    if not os.path.isdir(root):
        return out
    for name in sorted(n for n in os.listdir(root) if n.startswith("phase-")):
        acc = os.path.join(root, name, "accepted.json")
        if not os.path.exists(acc):
            out.append(f"- {name}: not finished")
            continue
        with open(acc, encoding="utf-8") as f:
            info = json.load(f)
        summary = info.get("summary", {})
        out.append(f"- **{name}**: accepted `{info['name']}` (search success "
                   f"{_fmt(summary.get('success_rate'))}, mean turns "
                   f"{_fmt(summary.get('mean_turns'))})")  # fmt: skip
        new_path = os.path.join(root, name, "accepted.py")
        old = (
            open(prev_path, encoding="utf-8").read().splitlines()
            if os.path.exists(prev_path)
            else []
        )
        new = open(new_path, encoding="utf-8").read().splitlines()
        diff = list(difflib.unified_diff(old, new, os.path.relpath(prev_path, run["dir"]),
                                         os.path.relpath(new_path, run["dir"]), lineterm=""))  # fmt: skip
        if diff:
            out += ["", "```diff", *diff, "```", ""]
        else:
            out.append("  (unchanged: the incoming harness stayed)")
        prev_path = new_path
    return out


def write_report(run_dirs: list[str], out: str) -> str:
    """Writes ``out``/report.md and the plots; returns the Markdown file's path."""
    runs = [_load(d) for d in run_dirs]
    os.makedirs(out, exist_ok=True)
    plots = _plots(runs, out)
    md = ["# WHALE run report", ""]
    md += ["| run | steps | phases | initial test | final test | best test | test at validation-best | episodes learning | eval episodes |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        evals = [x for x in run["lines"] if x["kind"] == "eval"]
        last = run["lines"][-1] if run["lines"] else {}
        end = next((x for x in reversed(run["lines"]) if x["kind"] == "end"), None)
        best = (end or {}).get("best", {})
        phases = [x["phase_kind"][0].upper() for x in run["lines"] if x["kind"] == "phase_end"]
        md.append(
            f"| {_label(run)} | {last.get('step', 0)} | {''.join(phases) or '-'} | "
            f"{_fmt(evals[0].get('test') if evals else None)} | "
            f"{_fmt(evals[-1].get('test') if evals else None)} | {_fmt(best.get('test'))} | "
            f"{_fmt(best.get('test_at_validation_best'))} | {int(_learning_episodes(last))} | "
            f"{int(last.get('cost', {}).get('eval_episodes', 0))} |"
        )
        if end is None:
            md.append(f"|  ↳ {run['dir']} has not finished |  |  |  |  |  |  |  |  |")
    md += ["", "W = weight phase, H = harness phase. mean@k: per test task the mean reward over k "
           "episodes, averaged over tasks (searchqa: the macro-average of its benchmarks).", ""]  # fmt: skip
    md += [f"![{p}]({p})" for p in plots]
    for run in runs:
        md += ["", f"## {_label(run)}", "", f"Run directory: `{run['dir']}`", ""]
        evals = [x for x in run["lines"] if x["kind"] == "eval"]
        if evals:
            md += ["| step | harness | reason | test | validation |", "|---|---|---|---|---|"]
            md += [f"| {x['step']} | `{x['harness']}` | {x['reason']} | {_fmt(x.get('test'))} | "
                   f"{_fmt(x.get('validation'))} |" for x in evals]  # fmt: skip
        last = run["lines"][-1] if run["lines"] else {}
        if last.get("cost"):
            md += ["", "Cost: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in last["cost"].items())]  # fmt: skip
        lineage = _lineage(run)
        if lineage:
            md += ["", "### Harness lineage", "", *lineage]
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Report (Markdown + PNG) for WHALE run directories.")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", default=None, help="default: <first run>/report (one run) or ./report")
    args = p.parse_args(argv)
    out = args.out or (
        os.path.join(args.run_dirs[0], "report") if len(args.run_dirs) == 1 else "report"
    )
    print(write_report(args.run_dirs, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
