"""Packed vs bucketed microbatches for RSFT rows: pad fraction, compiles and step time.

RSFT rows are uneven: a one-turn answer next to a multi-turn session. This program draws row
lengths from a WHALE-shaped mix (most rows one or two turns, some long sessions), makes the same
rows both ways (``TrainConfig(pack=True)`` and ``pack=False``) and times whole optimizer steps of
our trainer on the small Qwen3.5 config (random weights, fp32, CPU). There is no peer here: the
comparison is between our two layouts, on the same rows, in the same run.

    .venv/bin/python benchmarks/bench_packing.py [--rows 64] [--steps 3] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import QWEN3_5_SMALL, machine_info, save_results

import whale_jax
from whale_jax.train.packing import pad_fraction
from whale_jax.train.rows import Row
from whale_jax.train.trainer import TrainConfig, Trainer


def draw_rows(n: int, vocab: int, seed: int) -> list[Row]:
    """70 % one-turn rows (60-200 tokens), 25 % two to four turns (200-700), 5 % long sessions
    (700-2000); the completion is the last third of each row."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        u = rng.random()
        lo, hi = (60, 200) if u < 0.7 else (200, 700) if u < 0.95 else (700, 2000)
        length = int(rng.integers(lo, hi))
        ids = tuple(int(x) for x in rng.integers(0, vocab, length))
        mask = tuple(j >= 2 * length // 3 for j in range(length))
        rows.append(Row(ids=ids, mask=mask, episode=i, task_id=str(i), session_id=str(i)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/packing.json")
    args = p.parse_args(argv)

    cfg = whale_jax.ModelConfig.from_hf(QWEN3_5_SMALL)
    model = whale_jax.random_model(cfg, seed=0)
    results = {}
    for name, pack in (("packed", True), ("bucketed", False)):
        trainer = Trainer(
            model, TrainConfig(seq_len=args.seq_len, micro_tokens=args.micro_tokens, pack=pack)
        )
        times = []
        for step in range(args.steps + 1):
            rows = draw_rows(args.rows, cfg.vocab_size, args.seed + step)
            t0 = time.perf_counter()
            m = trainer.update(rows)
            times.append(time.perf_counter() - t0)
        batches = trainer.microbatches(rows)
        real = sum(b.real_tokens for b in batches)
        results[name] = {
            "first_step_s": times[0],
            "median_step_s": statistics.median(times[1:]),
            "real_tokens": real,
            "positions": sum(b.positions for b in batches),
            "pad_fraction": pad_fraction(batches),
            "microbatches": len(batches),
            "shapes": sorted({b.tokens.shape for b in batches}),
            "compile_counts": trainer.compile_counts,
            "real_tokens_per_s": real / statistics.median(times[1:]),
            "loss": m.loss,
        }
        r = results[name]
        print(
            f"{name:9s} pad {r['pad_fraction']:.1%}  microbatches {r['microbatches']}  shapes "
            f"{r['shapes']}  compiles {r['compile_counts']}  first step {r['first_step_s']:.1f}s  "
            f"median step {r['median_step_s']:.2f}s  {r['real_tokens_per_s']:.0f} real tok/s",
            flush=True,
        )
    out = {"machine": machine_info(), "args": vars(args), "config": "qwen3_5_small", **results}
    save_results(out, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
