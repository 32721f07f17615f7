"""mean@k on the test and validation splits with the current weights and harness, and the best
scores seen."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from harness.records import mean_at_k
from whale_jax.loop.hosts import agreed
from whale_jax.loop.saving import save
from whale_jax.loop.state import emit, harness_source

if TYPE_CHECKING:
    from whale_jax.loop.build import Run


def evaluate(run: Run, reason: str, *, candidate: tuple[str, str] | None = None,
             **fields: Any) -> dict[str, Any] | None:  # fmt: skip
    """mean@k on test and validation with the current weights and harness (once per pair).
    ``candidate`` (harness id, source): a harness inside a search instead (stagewise's
    evaluation along its search, on the host that searches, once per top): the
    best scores are tracked, no checkpoint is written (nothing it would hold has changed)
    and the pair is not marked evaluated, so the phase's end evaluates on every host alike."""
    s, c = run.state, run.config
    harness_id = candidate[0] if candidate else s.harness.id
    key = [s.step, harness_id]
    if (candidate is None and s.last_eval == key) or not (c.eval.test or c.eval.validation):
        return None
    t0 = time.monotonic()
    source, k = candidate[1] if candidate else harness_source(run), c.eval.samples
    out: dict[str, Any] = {"reason": reason, **fields}
    for split in ("test", "validation"):
        if not getattr(c.eval, split):
            continue
        tasks = getattr(run.data, split)
        if not tasks:
            continue
        records = run.executor.run(source, run.data.domain, tasks, samples=k,
                                    run_id=f"eval-{split}", step=-1 - s.step)  # fmt: skip
        s.counters["eval_episodes"] += len(records)
        s.counters["eval_tokens"] += sum(r.prompt_tokens + r.completion_tokens for r in records)
        groups = run.data.test_groups() if split == "test" else {}
        if len(groups) > 1:  # e.g. searchqa's benchmarks: each, and their macro-average
            per = {g: mean_at_k(records, ts) for g, ts in groups.items()}
            out["test_by_source"] = per
            out["test"] = sum(per.values()) / len(per)
        else:
            out[split] = mean_at_k(records, tasks)
    s.counters["eval_s"] += time.monotonic() - t0
    if candidate is None:  # every host evaluates the pairs a phase ends with: never skipped here
        s.last_eval = key
    new_best_val = update_best(run, out, harness_id)
    line = emit(run, "eval", **{k_: v for k_, v in out.items()}, samples=k,
                     **({"harness": harness_id} if candidate else {}))  # fmt: skip
    run.say(f"eval ({reason}, step {s.step}, harness {harness_id}): mean@{k} "
             + ", ".join(f"{n} {out[n]:.3f}" for n in ("test", "validation") if n in out))  # fmt: skip
    if candidate is None and agreed(new_best_val):
        save(run, best=True)
    return line


def update_best(run: Run, out: dict[str, Any], harness_id: str) -> bool:
    s, b = run.state, run.state.best
    where = {"step": s.step, "harness": harness_id}
    if "test" in out and out["test"] > b.get("test", -1.0):
        b["test"], b["test_at"] = out["test"], where
    if "validation" in out and out["validation"] > b.get("validation", -1.0):
        b["validation"], b["validation_at"] = out["validation"], where
        b["test_at_validation_best"] = out.get("test")
        return run.trainer is not None and s.step > 0
    return False
