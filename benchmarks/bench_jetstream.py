"""JetStream's orchestrator beside our engine, the same model and device functions under both: the
CPU proxy (the random tiny SmolLM2-shaped model at 64 slots, where a decode step costs little and
the host's scheduling shows) or SmolLM2-135M.

Both serve the same token-level requests, greedy, no stop id (so every request runs to
``--new`` tokens):
- ``ours``: ``Engine.generate`` (continuous batching, batched admission, pipelined reads, prefix
  cache; ``steps`` tokens per call);
- ``jetstream``: JetStream 0.2.2's Driver (prefill, transfer, generate and detokenize threads, one
  prompt per prefill, one insert per request) over ``JetStreamEngine``, requests sent to its
  ``Orchestrator`` service in this process (no gRPC), at 1 and at ``steps`` tokens per call.
Workloads: ``distinct`` (every prompt different) and ``shared`` (each prompt sampled ``--n`` times,
as WHALE samples a task: our prefix cache prefills it once; JetStream prefills every request).
Every run draws new prompts (none is in our prefix cache from an earlier run). Each case runs once
to compile, then ``--repeats`` times back to back, not round-robin as ``common.time_cases`` runs
cases: JetStream's generate thread runs up to 8 calls ahead of the tokens it has returned, so its
device work outlives the request that made it and lands on whatever runs next (tried: our
shared-prompt case took 2.0-2.1 s after JetStream's 8-step case and 1.4 s after its 1-step one).
Reported: requests/s and new tokens/s (median), process CPU seconds per request, beside the bare
decode rate (every slot decoding, no admission) of the same model and slot count.

    .venv/bin/python benchmarks/bench_jetstream.py [--model tiny|smollm2] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from common import RESULTS, git_state, machine_info, save_results

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
ARGS.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
ARGS.add_argument("--slots", type=int, default=64)
ARGS.add_argument("--requests", type=int, default=256)
ARGS.add_argument("--prompt", type=int, default=60, help="mean prompt tokens (uniform +-50 %%)")
ARGS.add_argument("--new", type=int, default=32, help="new tokens per request")
ARGS.add_argument("--n", type=int, default=8, help="requests per prompt in the shared workload")
ARGS.add_argument("--steps", type=int, default=8, help="decode steps per call (ours; jetstream's "
                  "second setting)")  # fmt: skip
ARGS.add_argument("--repeats", type=int, default=3)
ARGS.add_argument("--quick", action="store_true", help="64 requests, 1 repeat")
ARGS.add_argument("--out", default=None)


def workload(kind: str, args, vocab: int, rng) -> list[tuple[int, ...]]:
    lo, hi = max(1, args.prompt // 2), args.prompt * 3 // 2
    unique = args.requests if kind == "distinct" else max(1, args.requests // args.n)
    prompts = [tuple(map(int, rng.integers(3, vocab, rng.integers(lo, hi + 1))))
               for _ in range(unique)]  # fmt: skip
    return [prompts[i % unique] for i in range(args.requests)]


def timed(serve, draw, repeats: int) -> dict:
    """``serve(prompts)`` (returns the new tokens it produced) on ``draw()`` 's prompts: once to
    compile, then ``repeats`` times, each on new prompts."""
    import resource

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t = time.perf_counter()
    serve(draw())  # compiles
    cold = time.perf_counter() - t
    walls, cpus, tokens = [], [], 0
    for _ in range(repeats):
        prompts = draw()
        t, c = time.perf_counter(), cpu()
        tokens = serve(prompts)
        walls.append(time.perf_counter() - t)
        cpus.append(cpu() - c)
    return {"cold_s": cold, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "tokens": tokens}  # fmt: skip


def main() -> None:
    args = ARGS.parse_args()
    if args.quick:
        args.requests, args.repeats = 64, 1
    import jax
    import numpy as np

    from whale_jax.engine import Engine, EngineConfig, Request, Sampling
    from whale_jax.engine.jetstream_engine import JetStreamEngine, LocalServer, token_request
    from whale_jax.io.gguf import find_smollm2_gguf
    from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf
    from whale_jax.io.load import load_model, random_model
    from whale_jax.models.config import TINY_SMOLLM2_HF, ModelConfig

    if args.model == "tiny":
        model = random_model(ModelConfig.from_hf(TINY_SMOLLM2_HF), seed=0)
        tokenizer = tokenizer_from_gguf(find_smollm2_gguf())
    else:
        model, _, tokenizer = load_model("smollm2")
    vocab = model.cfg.vocab_size
    # JetStream pads prompts to powers of two from 16, below max_len: room for the longest prompt
    # and its new tokens.
    max_prefill = max(16, 1 << (args.prompt * 3 // 2 - 1).bit_length())
    max_len = 2 * max(max_prefill, 1 << (args.new - 1).bit_length())
    rng = np.random.default_rng(0)
    kinds = ("distinct", "shared")
    greedy = Sampling(temperature=0.0, max_new_tokens=args.new)
    results = {
        "benchmark": "JetStream 0.2.2's orchestrator vs our engine, same device functions",
        "model": args.model, "slots": args.slots, "requests": args.requests,
        "prompt_tokens_mean": args.prompt, "new_tokens": args.new, "steps": args.steps,
        "shared_n": args.n, "backend": jax.default_backend(), "machine": machine_info(),
        "git": git_state(), "cases": {},
    }  # fmt: skip

    def report(name: str, kind: str, row: dict) -> None:
        row.update(requests_per_s=args.requests / row["wall_s"],
                   new_tokens_per_s=row["tokens"] / row["wall_s"],
                   cpu_ms_per_request=1e3 * row["cpu_s"] / args.requests)  # fmt: skip
        results["cases"][f"{name}/{kind}"] = row
        print(f"{name:>14} {kind:>8}: {row['requests_per_s']:7.1f} req/s "
              f"{row['new_tokens_per_s']:8.0f} tok/s  cpu {row['cpu_ms_per_request']:6.2f} ms/req  "
              f"(wall {row['wall_s']:.2f} s, cold {row['cold_s']:.1f} s)", flush=True)  # fmt: skip
        save_results(results, args.out or RESULTS / f"jetstream_{args.model}.json")

    # The bare decode rate: every slot decoding one long request, nothing admitted mid-run.
    config = EngineConfig(slots=args.slots, max_len=max_len, steps=args.steps,
                          cache_rows=2 * args.slots)  # fmt: skip
    with Engine(model, config) as engine:
        long = Sampling(temperature=0.0, max_new_tokens=4 * args.new)
        bare = [Request(prompt_ids=p, sampling=long, cache=False)
                for p in workload("distinct", args, vocab, rng)[: args.slots]]  # fmt: skip
        row = timed(lambda _: engine.generate(bare), lambda: None, args.repeats)
        rate = args.slots * 4 * args.new / row["wall_s"]
        results["bare_decode_tokens_per_s"] = rate
        print(f"bare decode: {rate:.0f} tok/s at {args.slots} slots", flush=True)

        def ours(prompts):
            done = engine.generate([Request(prompt_ids=p, sampling=greedy) for p in prompts])
            return sum(len(c.token_ids) for c in done)

        for kind in kinds:  # new prompts every run: none is in the prefix cache from an earlier one
            draw = functools.partial(workload, kind, args, vocab, rng)
            report("ours", kind, timed(ours, draw, args.repeats))

    for steps in sorted({1, args.steps}):
        engine = JetStreamEngine(model, tokenizer, slots=args.slots, max_len=max_len, steps=steps,
                                 max_prefill_length=max_prefill, stop_ids=())  # fmt: skip
        with LocalServer([engine]) as server:

            def theirs(prompts):
                return sum(map(len, server.decode([token_request(p, args.new) for p in prompts])))

            for kind in kinds:
                draw = functools.partial(workload, kind, args, vocab, rng)
                row = timed(theirs, draw, args.repeats)
                row["compile_counts"] = dict(engine.compile_counts)
                report(f"jetstream s={steps}", kind, row)


if __name__ == "__main__":
    main()
