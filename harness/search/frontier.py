"""Acceptance: the Pareto frontier over (success rate up, cost down), the accepted harness at its
top (highest success, ties to lower cost, then to the earlier candidate), and a paired interval for
the gain over the incoming harness on the same search tasks.

The cost axis (``COSTS``) is mean turns by default, as the paper. A 5-way vote is one turn at five
times the tokens, so ``tokens`` (prompt + completion tokens per episode) or ``calls`` (model calls
per episode) let the search see compute."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

COSTS = ("turns", "tokens", "calls")


def cost_of(summary: dict[str, Any], cost: str = "turns") -> float:
    """A candidate's cost per episode on the ``cost`` axis, from its evaluation summary."""
    if cost == "turns":
        return float(summary["mean_turns"])
    if cost == "tokens":
        return (summary["prompt_tokens"] + summary["completion_tokens"]) / max(summary["n"], 1)
    if cost == "calls":
        return float(summary["mean_calls"])
    raise ValueError(f"cost {cost!r}: expected one of {', '.join(COSTS)}")


def dominates(a: dict[str, Any], b: dict[str, Any], cost: str = "turns") -> bool:
    """a is at least as good on both axes and strictly better on one."""
    ca, cb = cost_of(a, cost), cost_of(b, cost)
    ge = a["success_rate"] >= b["success_rate"] and ca <= cb
    gt = a["success_rate"] > b["success_rate"] or ca < cb
    return ge and gt


def pareto(scored: Sequence[tuple[str, dict[str, Any]]], cost: str = "turns") -> list[str]:
    """Names on the frontier, best success first (ties: lower cost, then order given)."""
    front = [(n, s) for n, s in scored if not any(dominates(t, s, cost) for _, t in scored)]
    order = {n: i for i, (n, _) in enumerate(scored)}
    front.sort(key=lambda x: (-x[1]["success_rate"], cost_of(x[1], cost), order[x[0]]))
    return [n for n, _ in front]


def paired_interval(
    new: Sequence[float], old: Sequence[float], *, level: float = 0.95, resamples: int = 4000,
    seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Mean per-task difference (new - old) on the same tasks, with a paired bootstrap interval
    and the normal-approximation interval; ``significant`` when the bootstrap interval excludes 0."""
    if len(new) != len(old) or not new:
        raise ValueError("paired_interval needs two equally long, non-empty reward lists")
    diffs = [a - b for a, b in zip(new, old, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = 1.959963984540054 * math.sqrt(var / n)
    rng = random.Random(seed)
    boots = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    lo = boots[int((1 - level) / 2 * resamples)]
    hi = boots[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return {"gain": mean, "low": lo, "high": hi, "normal_low": mean - half,
            "normal_high": mean + half, "n": n, "significant": float(lo > 0 or hi < 0)}  # fmt: skip


def accept(
    scored: Sequence[tuple[str, dict[str, Any]]],
    incoming: str,
    *,
    require_significant: bool = False,
    cost: str = "turns",
) -> tuple[str, list[str], dict[str, Any]]:
    """(accepted name, frontier, detail). With ``require_significant`` a challenger replaces the
    incoming harness only when its paired gain's interval excludes zero."""
    front = pareto(scored, cost)
    by_name = dict(scored)
    best = front[0]
    detail: dict[str, Any] = {"top_of_frontier": best, "cost": cost}
    if best != incoming and "rewards" in by_name[best] and "rewards" in by_name[incoming]:
        iv = paired_interval(by_name[best]["rewards"], by_name[incoming]["rewards"])
        detail["vs_incoming"] = iv
        if require_significant and not iv["significant"]:
            detail["kept_incoming"] = "gain within sampling noise"
            return incoming, front, detail
    return best, front, detail
