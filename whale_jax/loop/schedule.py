"""When to switch phases: the methods' phase sequences and the fixed / adaptive rules.

Pure functions of the run's counters, so a resumed run decides exactly as an uninterrupted one and
the rules are tested on synthetic signals. Switching reads only training rewards and search-split
scores, never validation or test data.

Phase sequences (W: weight phase, H: harness phase):

    whale, fast-slow   W H W H ... W   (fixed: W is E epochs, H has I iterations; adaptive: both
                                        end by patience) - the run always ends with a weight phase
    weight-only        W               (the whole budget, harness frozen at the initial one)
    harness-only       H               (the reference: one Meta-Harness run on the initial
                                        weights; --harness_phases splits it into phases of I)
    stagewise          W H             (the whole budget, then one harness phase)

The single harness phase of harness-only and stagewise has ``--harness_budget`` iterations (the
reference: 40 for searchqa and chess, 60 for math); 0 gives every iteration WHALE's fixed
schedule would have spent (``phases x (I - 1) + 1``).
"""

from __future__ import annotations

import dataclasses
import math

from whale_jax.loop.config import RunConfig, steps_for

WEIGHT, HARNESS = "weight", "harness"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The schedule in RSFT steps, from the config and the weight-training split's size."""

    method: str
    schedule: str
    steps_per_epoch: float
    total_steps: int  # the weight-training budget
    phase_steps: int  # E in steps (fixed schedule)
    iterations: int  # I
    harness_phases: int  # harness-only: phases; others: what the fixed schedule would have
    single_phase_iterations: int  # harness-only in one phase, stagewise: the phase's iterations
    eval_every: int  # periodic evaluation in steps (0: phase boundaries only)
    window: int
    burn_in: int
    patience: int

    @property
    def alternates(self) -> bool:
        return self.method in ("whale", "fast-slow")


def make_plan(config: RunConfig, train_size: int) -> Plan:
    s, batch = config.schedule, config.rsft.prompt_batch
    total = steps_for(s.epochs, train_size, batch)
    phase = min(steps_for(s.weight_epochs, train_size, batch), total)
    fixed_phases = max(math.ceil(total / phase) - 1, 1)
    whale_iterations = fixed_phases * (s.harness_iterations - 1) + 1
    every = config.eval.every_epochs
    return Plan(
        method=s.method,
        schedule=s.schedule,
        steps_per_epoch=train_size / batch,
        total_steps=total,
        phase_steps=phase,
        iterations=s.harness_iterations,
        harness_phases=s.harness_phases or (1 if s.method == "harness-only" else fixed_phases),
        single_phase_iterations=s.harness_budget or whale_iterations,
        eval_every=steps_for(every, train_size, batch) if every > 0 else 0,
        window=steps_for(s.window_epochs, train_size, batch),
        burn_in=steps_for(s.burn_in_epochs, train_size, batch),
        patience=steps_for(s.patience_epochs, train_size, batch),
    )


def next_phase(plan: Plan, done: list[str], step: int) -> str | None:
    """The kind of the next phase after the phases ``done`` at RSFT step ``step``; None: the run
    is over."""
    budget_left = step < plan.total_steps
    if plan.method == "weight-only":
        return WEIGHT if not done else None
    if plan.method == "harness-only":
        return HARNESS if done.count(HARNESS) < plan.harness_phases else None
    if plan.method == "stagewise":
        return [WEIGHT, HARNESS][len(done)] if len(done) < 2 else None
    last = done[-1] if done else None
    if last in (None, HARNESS):
        return WEIGHT if budget_left else None
    return HARNESS if budget_left else None


def window_means(rewards: list[float], window: int) -> list[float]:
    return [
        sum(rewards[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window))
        for i in range(len(rewards))
    ]


def adaptive_weight_stop(rewards: list[float], *, window: int, burn_in: int, patience: int) -> bool:
    """The adaptive weight phase ends once it is past the burn-in and the sliding-window mean
    training reward has not set a phase-best for ``patience`` steps, counted from the best step
    (the reference: ``n > B and n - best >= P``; a best inside the burn-in counts, so a phase can
    end at the first step after it). ``rewards``: the mean training reward of each step of this
    phase so far."""
    n = len(rewards)
    if n <= burn_in:
        return False
    best, best_at = -math.inf, 0
    for i, m in enumerate(window_means(rewards, window), start=1):
        if m > best:
            best, best_at = m, i
    return n - best_at >= patience


def weight_phase_over(plan: Plan, *, step: int, phase_start: int, rewards: list[float]) -> bool:
    """Before another RSFT step: is this weight phase over? (``rewards``: this phase's steps)"""
    if step >= plan.total_steps:
        return True
    if not plan.alternates:
        return False
    if plan.schedule == "fixed":
        return step - phase_start >= plan.phase_steps
    return adaptive_weight_stop(
        rewards, window=plan.window, burn_in=plan.burn_in, patience=plan.patience
    )


def harness_iterations(plan: Plan) -> int:
    """Iterations of the next harness phase under the fixed schedule (adaptive phases end by
    patience within ``SearchConfig``'s bounds)."""
    single = plan.method == "stagewise" or (plan.method == "harness-only"
                                            and plan.harness_phases == 1)  # fmt: skip
    return plan.single_phase_iterations if single else plan.iterations


def phase_list(plan: Plan) -> list[tuple[str, int]] | None:
    """The phases the run will make, in order, each with its length (RSFT steps of a weight phase,
    iterations of a harness phase); None when the adaptive schedule decides lengths as it runs."""
    if plan.alternates and plan.schedule != "fixed":
        return None
    out: list[tuple[str, int]] = []
    done: list[str] = []
    step = 0
    while (kind := next_phase(plan, done, step)) is not None:
        if kind == WEIGHT:
            n = plan.total_steps - step
            if plan.alternates:
                n = min(plan.phase_steps, n)
            step += n
            out.append((kind, n))
        else:
            out.append((kind, harness_iterations(plan)))
        done.append(kind)
    return out
