"""One RSFT step: the weight phase of WHALE (docs/architecture.md 1 and 2.2).

    tasks   = the next ``prompt_batch`` tasks of the weight-training split (``DataCursor``)
    records = n = ``samples`` episodes per task, the current harness driving the engine
    kept    = episodes with a session whose verdict > ``reward_threshold`` (``harness.verdicts``)
    rows    = ``rows_from_records(kept)``                (the trained tokens, decided once:
                                                           only sessions the verifier passed)
    for each minibatch of ``minibatch_episodes`` kept episodes: one optimizer update
    engine.set_params(trainer weights)                  (a barrier; the weights version goes up)

Nothing kept: no update, and the step says so. Records are the only thing that crosses from the
rollouts to the trainer, and the step returns them (the loop logs them; the proposer reads them).

Multi-host: every host computes the same task batch and takes every P-th task (rollouts are
host-local, on its own engine); kept episodes feed the global update as process-local rows, with
as many minibatches on every host (``Trainer.update`` pads the rest with empty microbatches).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import jax

from harness.domains.base import Domain, Task
from harness.executor import Executor
from harness.records import EpisodeRecord
from harness.splits import key_rank
from whale_jax.sharding import process_gather_json, process_max
from whale_jax.train.rows import (
    ROW_ORIGINS,
    SESSION_OUTCOMES,
    kept_episodes,
    rows_from_records,
    session_outcomes,
)
from whale_jax.train.trainer import Trainer


@dataclasses.dataclass(frozen=True, kw_only=True)
class RSFTConfig:
    """The paper's settings by default (prompt batch 256, n = 8, keep reward > 0.5, minibatches of
    64 episodes). Sampling settings (T = 1.0, top-p 1.0, top-k 20) belong to the executor's
    ``default_settings``, the one place they are decided."""

    prompt_batch: int = 256
    samples: int = 8
    reward_threshold: float = 0.5
    minibatch_episodes: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_batch", "samples", "minibatch_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"RSFTConfig.{name} must be at least 1")


@dataclasses.dataclass
class DataCursor:
    """Where the weight-training split is read: the epoch and the position in that epoch's order.
    Each epoch's order is a permutation fixed by (seed, epoch) through a keyed hash of the task
    ids, so a resumed run reads exactly what an uninterrupted one would. Checkpointed as a dict."""

    seed: int
    epoch: int = 0
    position: int = 0

    def order(self, tasks: Sequence[Task], epoch: int) -> list[Task]:
        return sorted(tasks, key=lambda t: (key_rank(f"{epoch}\x00{t.id}", self.seed), t.id))

    def take(self, tasks: Sequence[Task], n: int) -> list[Task]:
        """The next ``n`` tasks, crossing into the next epoch (a new order) when one runs out."""
        if not tasks:
            raise ValueError("the weight-training split is empty")
        out: list[Task] = []
        while len(out) < n:
            order = self.order(tasks, self.epoch)
            take = order[self.position : self.position + n - len(out)]
            out += take
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def epochs_done(self, size: int) -> float:
        return self.epoch + self.position / max(size, 1)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataCursor:
        return cls(seed=int(d["seed"]), epoch=int(d["epoch"]), position=int(d["position"]))


def minibatches_of(episodes: list[EpisodeRecord], size: int, seed: int, step: int):
    """The kept episodes in a seeded order, cut into minibatches of ``size``."""
    order = list(episodes)
    random.Random(f"{seed}/{step}").shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


ROW_COUNTS = ("rows", *ROW_ORIGINS, "unpassed_rows", "new_rows", "cut_rows", "cut_tokens", "empty_calls",
              "untrained_rows")  # fmt: skip


def rsft_step(
    step: int,
    *,
    tasks: Sequence[Task],
    cursor: DataCursor,
    source: str,
    domain: Domain,
    executor: Executor,
    trainer: Trainer,
    engine,
    config: RSFTConfig = RSFTConfig(),
) -> tuple[dict[str, Any], list[EpisodeRecord]]:
    """Runs one step; returns its metrics and this host's episode records. ``engine`` is the
    rollout engine the executor's backend samples with (its weights are replaced at the end)."""
    t0 = time.perf_counter()
    batch = cursor.take(tasks, config.prompt_batch)
    mine = batch[jax.process_index() :: jax.process_count()]
    records = executor.run(
        source, domain, mine, samples=config.samples, run_id=f"rsft{step}", step=step
    )
    t1 = time.perf_counter()
    kept = kept_episodes(records, config.reward_threshold)
    outcomes = session_outcomes(records, config.reward_threshold)
    local_size = math.ceil(config.minibatch_episodes / jax.process_count())
    groups = minibatches_of(kept, local_size, config.seed, step)
    n_groups = process_max(len(groups))
    groups += [[] for _ in range(n_groups - len(groups))]
    updates, counts_total = [], {}
    for group in groups:
        rows, counts = rows_from_records(
            group, max_len=trainer.config.seq_len, threshold=config.reward_threshold
        )
        for k, v in counts.items():
            counts_total[k] = counts_total.get(k, 0) + v
        updates.append(trainer.update(rows))
    t2 = time.perf_counter()
    version = engine.weights_version
    if any(u.applied for u in updates):
        version = engine.set_params(trainer.model_state())
    t3 = time.perf_counter()

    # Counts over every host's share of the batch, so every host logs the same line and the
    # adaptive schedule (which reads the mean reward) decides alike everywhere.
    local = {
        "tasks": len(mine), "episodes": len(records), "kept": len(kept),
        "reward": sum(r.reward for r in records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "scoring_s": sum(r.score_s for r in records),
        "stop_reasons": dict(collections.Counter(r.stop_reason for r in records)),
        # Every host's microbatches have the same shape: the mean over hosts is the global one.
        "padded": sum(u.pad_fraction * u.microbatches for u in updates),
        "microbatches": sum(u.microbatches for u in updates),
        **{k: counts_total.get(k, 0) for k in ROW_COUNTS},
        **{k: outcomes.get(k, 0) for k in SESSION_OUTCOMES},
    }  # fmt: skip
    hosts = process_gather_json(local)
    total = {k: sum(h[k] for h in hosts) for k in local if k != "stop_reasons"}
    stops: collections.Counter = collections.Counter()
    for h in hosts:
        stops.update(h["stop_reasons"])
    n = total["episodes"]
    applied = [u for u in updates if u.applied]
    tokens = sum(u.trained_tokens for u in applied)
    metrics: dict[str, Any] = {
        "step": step,
        "epoch": cursor.epochs_done(len(tasks)),
        "tasks": total["tasks"],
        "episodes": n,
        "kept": total["kept"],
        "accept_rate": total["kept"] / max(n, 1),
        "mean_reward": total["reward"] / max(n, 1),
        "updates": len(applied),
        "skipped_updates": sum(1 for u in updates if not u.applied and u.trained_tokens > 0),
        "loss": sum(u.loss * u.trained_tokens for u in applied) / tokens if tokens else None,
        "grad_norm": max((u.grad_norm for u in applied), default=None),
        "learning_rate": updates[-1].learning_rate if updates else None,
        "trained_tokens": tokens,
        "pad_fraction": total["padded"] / max(total["microbatches"], 1),
        **{k: total[k] for k in ROW_COUNTS},
        **{k: total[k] for k in SESSION_OUTCOMES},
        "prompt_tokens": total["prompt_tokens"],
        "completion_tokens": total["completion_tokens"],
        "stop_reasons": dict(stops),
        "weights_version": version,
        "rollout_s": t1 - t0,
        "scoring_s": total["scoring_s"],
        "train_s": t2 - t1,
        "sync_s": t3 - t2,
        "compile_counts": trainer.compile_counts,
    }
    if not total["kept"]:
        metrics["note"] = "no session verified above the reward threshold: no update"
    return metrics, records
