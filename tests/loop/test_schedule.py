"""Phase switching on synthetic signals: plans, phase sequences per method, the fixed and the
adaptive weight-phase rules (the adaptive harness-phase rule: tests/harness/search/test_phase.py)."""

from __future__ import annotations

import dataclasses

import pytest

from whale_jax.loop import schedule as sched
from whale_jax.loop.config import RunConfig, ScheduleConfig, steps_for
from whale_jax.train.rsft import RSFTConfig


def plan(method="whale", schedule="fixed", train=1000, batch=100, **kw) -> sched.Plan:
    s = ScheduleConfig(method=method, schedule=schedule, **kw)
    return sched.make_plan(RunConfig(schedule=s, rsft=RSFTConfig(prompt_batch=batch)), train)


def sequence(p: sched.Plan, phase_lengths=None) -> list[tuple[str, int]]:
    """Drives next_phase/weight_phase_over like the loop does; rewards all equal (adaptive)."""
    done, step, out = [], 0, []
    while (kind := sched.next_phase(p, done, step)) is not None:
        start = step
        if kind == sched.WEIGHT:
            rewards: list[float] = []
            while not sched.weight_phase_over(p, step=step, phase_start=start, rewards=rewards):
                step += 1
                rewards.append((phase_lengths or {}).get(step, 0.0))
        done.append(kind)
        out.append((kind, step - start))
        assert len(out) < 100
    return out


def test_steps_for_epochs():
    assert steps_for(6, 17917, 256) == 420  # math: 6 epochs of DAPO at batch 256
    assert steps_for(0.6, 17917, 256) == 42
    assert steps_for(0.2, 100, 256) == 1  # at least one step
    assert steps_for(1, 96, 32) == 3  # exact multiples do not round up


def test_whale_fixed_alternates_and_ends_with_a_weight_phase():
    p = plan(epochs=2.5, weight_epochs=0.6)  # 25 steps, E = 6
    assert (p.total_steps, p.phase_steps, p.harness_phases) == (25, 6, 4)
    seq = sequence(p)
    assert [k for k, _ in seq] == ["weight", "harness"] * 4 + ["weight"]
    assert [n for k, n in seq if k == "weight"] == [6, 6, 6, 6, 1]


def test_baseline_sequences():
    assert sequence(plan("weight-only", epochs=2)) == [("weight", 20)]
    # The reference's harness-only: one Meta-Harness run, by default as long as every proposal
    # iteration WHALE's fixed schedule makes (3 phases x 5 + the incoming's evaluation) ...
    alone = plan("harness-only", epochs=2, weight_epochs=0.5, harness_iterations=6)
    assert sequence(alone) == [("harness", 0)]
    assert sched.harness_iterations(alone) == 3 * 5 + 1
    # ... or the paper's budget (60 for math); --harness_phases splits it into phases of I.
    assert sched.harness_iterations(plan("harness-only", harness_budget=60)) == 60
    split = plan("harness-only", harness_phases=2, harness_iterations=4)
    assert sequence(split) == [("harness", 0)] * 2 and sched.harness_iterations(split) == 4
    stage = plan("stagewise", epochs=2, weight_epochs=0.5, harness_iterations=6)
    assert sequence(stage) == [("weight", 20), ("harness", 0)]
    assert sched.harness_iterations(stage) == 3 * 5 + 1  # every proposal iteration WHALE makes
    assert sched.harness_iterations(plan("stagewise", harness_budget=33)) == 33
    assert sched.harness_iterations(plan(harness_iterations=4)) == 4
    fast = plan("fast-slow", epochs=1, weight_epochs=0.5)
    assert [k for k, _ in sequence(fast)] == ["weight", "harness", "weight"]


@pytest.mark.parametrize(
    ("rewards", "stop_at"),
    [
        ([0.1] * 12, 3),  # flat: best at step 1; past burn-in 2 and 2 steps after the best
        ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], None),  # always improving: never stops
        ([0.1, 0.5, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2], 5),  # window mean peaks at step 3
        ([0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0], 5),  # a spike at step 3 resets the clock
    ],
)
def test_adaptive_weight_rule(rewards, stop_at):
    """window 2, burn-in 2, patience 2 (steps): the first prefix at which the phase ends. The
    reference's rule: n > burn-in and n - best step >= patience."""
    ends = [n for n in range(1, len(rewards) + 1)
            if sched.adaptive_weight_stop(rewards[:n], window=2, burn_in=2, patience=2)]  # fmt: skip
    assert (ends[0] if ends else None) == stop_at


def test_window_means():
    assert sched.window_means([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_adaptive_phases_follow_rewards_and_the_budget():
    p = plan(schedule="adaptive", epochs=3, window_epochs=0.2, burn_in_epochs=0.2,
             patience_epochs=0.2)  # fmt: skip
    assert (p.window, p.burn_in, p.patience, p.total_steps) == (2, 2, 2, 30)
    seq = sequence(p)  # flat rewards: every phase stops at the first step past the burn-in
    assert seq[0] == ("weight", 3)
    assert seq[-1][0] == "weight" and sum(n for k, n in seq if k == "weight") == 30
    rising = {s: s / 100 for s in range(1, 31)}  # rising reward: one phase takes the budget
    assert sequence(p, rising) == [("weight", 30)]


def test_eval_every_converts_epochs():
    c = RunConfig(rsft=RSFTConfig(prompt_batch=100))
    assert sched.make_plan(c, 1000).eval_every == 1  # 0.1 epoch of 10 steps
    c0 = dataclasses.replace(c, eval=dataclasses.replace(c.eval, every_epochs=0))
    assert sched.make_plan(c0, 1000).eval_every == 0
