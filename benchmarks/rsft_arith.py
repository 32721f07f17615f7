"""Does RSFT learn? SmolLM2-135M-Instruct (the bundled GGUF) on two-digit addition under the arith
h0 harness, our engine sampling and our trainer updating, with the setting of docs/architecture.md
section 3 (measured there with PyTorch: 1% -> 19% mean@8 in six steps):

    32 prompts x 8 samples per step, T = 1.0, top-k 20, keep reward > 0.5, one SFT pass in
    minibatches of 32 episodes, AdamW lr 1e-5; mean@8 on 48 held-out problems after every step.

Prints one line per step (mean@8, accept rate, loss, wall time split rollout / scoring / training /
weight sync / evaluation) and writes the curve to JSON.

    .venv/bin/python benchmarks/rsft_arith.py [--steps 6] [--out benchmarks/results/rsft_arith.json]
"""

from __future__ import annotations

import argparse
import time

from common import machine_info, save_results

from harness.api import SamplingSettings
from harness.domains.arith import ArithDomain, generate
from harness.executor import Executor, ExecutorConfig
from harness.records import mean_at_k as records_mean_at_k
from harness.splits import split_by_hash
from whale_jax.engine.client import EngineClient
from whale_jax.io.load import load_model
from whale_jax.train import (
    DataCursor,
    OptimConfig,
    RSFTConfig,
    TrainConfig,
    Trainer,
    rsft_step,
)


def mean_at_k(executor, source, domain, tasks, k, step) -> tuple[float, float]:
    t0 = time.perf_counter()
    records = executor.run(source, domain, tasks, samples=k, run_id=f"eval{step}", step=-1 - step)
    return records_mean_at_k(records, tasks), time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--minibatch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--test", type=int, default=48)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/rsft_arith.json")
    args = p.parse_args(argv)

    domain = ArithDomain()
    source = domain.seed_harness()
    pool = generate(1000, seed=args.seed)
    splits = split_by_hash(
        pool, lambda t: t.question, seed=args.seed, sizes={"test": args.test}, rest="train"
    )
    train, test = splits["train"], splits["test"]

    model, _, tokenizer = load_model("smollm2")
    client = EngineClient(model, tokenizer, slots=args.slots, max_len=256, seed=args.seed)
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=20, max_new_tokens=12)
    executor = Executor(
        client, ExecutorConfig(concurrency=args.slots * 2, default_settings=settings)
    )
    trainer = Trainer(
        model,
        TrainConfig(
            optim=OptimConfig(learning_rate=args.lr),
            seq_len=128,
            micro_tokens=4096,
            remat=False,
        ),
    )
    config = RSFTConfig(
        prompt_batch=args.prompts,
        samples=args.samples,
        minibatch_episodes=args.minibatch,
        seed=args.seed,
    )
    cursor = DataCursor(seed=args.seed)

    curve = []
    score, eval_s = mean_at_k(executor, source, domain, test, args.samples, 0)
    print(f"step 0: mean@{args.samples} {score:.3f}  (eval {eval_s:.1f}s)", flush=True)
    curve.append({"step": 0, "mean_at_k": score, "eval_s": eval_s})
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        metrics, _ = rsft_step(
            step,
            tasks=train,
            cursor=cursor,
            source=source,
            domain=domain,
            executor=executor,
            trainer=trainer,
            engine=client.engine,
            config=config,
        )
        step_s = time.perf_counter() - t0
        score, eval_s = mean_at_k(executor, source, domain, test, args.samples, step)
        metrics.update(mean_at_k=score, eval_s=eval_s, step_s=step_s)
        curve.append(metrics)
        loss = metrics["loss"]
        print(
            f"step {step}: mean@{args.samples} {score:.3f}  train reward "
            f"{metrics['mean_reward']:.3f}  kept {metrics['kept']}/{metrics['episodes']}  "
            f"loss {'-' if loss is None else f'{loss:.3f}'}  tokens {metrics['trained_tokens']}  "
            f"step {step_s:.1f}s = rollout {metrics['rollout_s']:.1f} (scoring "
            f"{metrics['scoring_s']:.2f}) + train {metrics['train_s']:.1f} + sync "
            f"{metrics['sync_s']:.2f}; eval {eval_s:.1f}s; weights v{metrics['weights_version']}",
            flush=True,
        )
    executor.close()
    client.close()
    out = {"machine": machine_info(), "args": vars(args), "curve": curve}
    save_results(out, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
