"""Rollout engine benchmark: our engine beside transformers ``generate`` (PyTorch), same CPU.

For each model (``common.load_models``: a small Qwen3.5 hybrid, and SmolLM2-135M-Instruct from
the bundled GGUF), fp32, same weights, same random prompts (``--prompt-len`` tokens), the same
number of greedy new tokens (``--new-tokens``, EOS ignored), at each batch size:

- transformers: ``model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)``;
- ours: ``Engine.generate`` of ``batch`` requests through ``batch`` slots (compile excluded:
  the first run warms up and is reported as ``warmup_s``).

Also: greedy agreement of the two at batch 1 (first-token and whole-sequence), XLA's and PyTorch's
fp32 matmul rates and our achieved FLOP rate at the largest batch, engine throughput as slots grow,
the time per decode step split into the jitted call (model + sampling), the model alone (a
bare jitted loop of ``extend`` steps) and host work, and the engine's compile counts.

Run:  .venv/bin/python benchmarks/bench_engine.py                 (full; tens of minutes)
      .venv/bin/python benchmarks/bench_engine.py --quick         (a few minutes)
Writes benchmarks/results/engine.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import RESULTS, bench_matmul, flops_per_token, load_models, machine_info, save_results


def request_flops(cfg, prompt_len: int, new_tokens: int) -> float:
    """Matmul FLOPs of one request: its prompt (no LM head except at the last prompt token, as
    both sides compute it) and its sampled tokens, each at the context it attends to."""
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    prompt = prompt_len * (flops_per_token(cfg, prompt_len / 2) - head) + head
    return prompt + new_tokens * flops_per_token(cfg, prompt_len + new_tokens / 2)


def torch_generate(tmodel, prompts: np.ndarray, n_new: int):
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    with torch.inference_mode():
        out = tmodel.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, prompts.shape[1] :].numpy()


def make_engine(model, slots: int, max_len: int, steps: int, sync: bool = False):
    from whale_jax.engine import Engine, EngineConfig

    return Engine(
        model,
        EngineConfig(
            slots=slots,
            max_len=max_len,
            steps=steps,
            prefill_batch=min(slots, 16),
            sync_timings=sync,
        ),
        eos_ids=(),
    )


def engine_generate(engine, prompts: np.ndarray, n_new: int):
    from whale_jax.engine import Request, Sampling

    sampling = Sampling(temperature=0.0, max_new_tokens=n_new)
    # cache=False: repeats of the same prompts are prefilled every time, as the peer's are.
    outs = engine.generate(
        [Request(prompt_ids=tuple(p), sampling=sampling, cache=False) for p in prompts]
    )
    return np.array([o.token_ids for o in outs])


def timed(fn, repeats: int):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def model_only_step(engine, batch: int, kv_len: int, steps: int) -> float:
    """Seconds per decode step of the bare model (a jitted loop of one-token ``extend`` calls over
    a KV window of ``kv_len``, no sampling, no host work) at ``batch`` rows."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, groups = engine.device.graphdef, engine.device.params, engine.device.groups
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(batch, kv_len)
    cache = cache.replace(lengths=jnp.full((batch,), kv_len // 2, jnp.int32))

    @jax.jit
    def run(params, groups, cache):
        m = nnx.merge(graphdef, params)

        def body(i, carry):
            cache, tok = carry
            ones = jnp.ones((batch,), jnp.int32)
            logits, cache = m.extend(cache, tok[:, None], ones, last_only=True, groups=groups)
            return cache, jnp.argmax(logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch,), jnp.int32)))

    jax.block_until_ready(run(params, groups, cache))
    t, _ = timed(lambda: jax.block_until_ready(run(params, groups, cache)), 3)
    return t / steps


def bench_sessions(model, cfg, args) -> dict:
    """Multi-turn sessions (a first prompt, then each turn appends the reply and a tool result of
    ``--session-delta`` tokens): the admission time of the later turns when the engine resumes
    the parked decode state vs when it prefills the whole conversation again. Greedy, so both
    ways must produce the same tokens."""
    from whale_jax.engine import Request, Sampling

    rows, first, delta, new, turns = (args.session_rows, args.session_prompt, args.session_delta,
                                      16, args.session_turns)  # fmt: skip
    max_len = 1 << (first + turns * (delta + new)).bit_length()
    rng = np.random.default_rng(1)
    starts = [tuple(rng.integers(0, cfg.vocab_size, first).tolist()) for _ in range(rows)]
    deltas = rng.integers(0, cfg.vocab_size, (turns, rows, delta)).tolist()
    sampling = Sampling(temperature=0.0, max_new_tokens=new)
    result, outputs = {"rows": rows, "first_prompt": first, "delta": delta, "turns": turns}, {}
    for mode in ("resume", "reprefill"):
        for warm in (True, False):  # the first pass compiles every shape, the second is timed
            # A new engine (compilations are shared) so the timed pass finds no kept state.
            engine = make_engine(model, rows, max_len, args.steps, sync=True)
            prompts, admit, tokens = list(starts), [], []
            for turn in range(turns):
                engine.timings.clear()
                reqs = [Request(prompt_ids=p, sampling=sampling, identity=(i, turn),
                                park=f"s{i}" if mode == "resume" else None,
                                cache=mode == "resume")
                        for i, p in enumerate(prompts)]  # fmt: skip
                outs = engine.generate(reqs)
                admit.append(engine.timings["admit_s"])
                tokens.append([o.token_ids for o in outs])
                prompts = [p + o.token_ids + tuple(d)
                           for p, o, d in zip(prompts, outs, deltas[turn], strict=True)]  # fmt: skip
            if mode == "resume" and not warm:
                result["reused_tokens_last_turn"] = outs[0].reused_tokens
            if warm:
                engine.close()
        outputs[mode] = tokens
        result[mode] = {"admit_s_per_turn": admit, "compile_counts": engine.compile_counts}
        engine.close()
    later = slice(1, None)
    resume_s = sum(result["resume"]["admit_s_per_turn"][later])
    reprefill_s = sum(result["reprefill"]["admit_s_per_turn"][later])
    result["later_turns_admit_speedup"] = reprefill_s / max(resume_s, 1e-9)
    result["same_tokens"] = outputs["resume"] == outputs["reprefill"]
    print(f"sessions: admission of turns 2..{turns}: resume {resume_s:.2f} s, re-prefill "
          f"{reprefill_s:.2f} s ({result['later_turns_admit_speedup']:.1f}x), same tokens "
          f"{result['same_tokens']}", flush=True)  # fmt: skip
    return result


def bench_model_engine(name, args, tmp: Path, matmul: dict) -> dict:
    model, tmodel, cfg = load_models(name, tmp)
    P, N = args.prompt_len, args.new_tokens
    max_len = 1 << (P + N - 1).bit_length()
    rng = np.random.default_rng(0)
    result = {"model": name, "num_params": cfg.num_params(), "prompt_len": P, "new_tokens": N,
              "max_len": max_len, "steps_per_call": args.steps, "batches": {}}  # fmt: skip
    for batch in args.batches:
        prompts = rng.integers(0, cfg.vocab_size, (batch, P)).astype(np.int32)
        engine = make_engine(model, batch, max_len, args.steps)
        t0 = time.perf_counter()
        engine_generate(engine, prompts, N)
        warm = time.perf_counter() - t0
        engine.stats.clear()
        engine.timings.clear()
        ours_s, ours = timed(lambda e=engine, p=prompts: engine_generate(e, p, N), args.repeats)
        torch_generate(tmodel, prompts[:, :8], 2)  # warm
        torch_s, theirs = timed(lambda p=prompts: torch_generate(tmodel, p, N), args.repeats)
        tokens = batch * N
        row = {
            "ours_tok_s": tokens / ours_s,
            "torch_tok_s": tokens / torch_s,
            "speedup": torch_s / ours_s,
            "ours_s": ours_s,
            "torch_s": torch_s,
            "warmup_s": warm,
            "greedy_first_token_agree": float(np.mean(ours[:, 0] == theirs[:, 0])),
            "greedy_all_agree": float(np.mean(np.all(ours == theirs, axis=1))),
            "compile_counts": engine.compile_counts,
        }
        # Where the time goes: one more run on an engine that waits for each admission's device
        # work, so prefill (+ insert) and decode calls are timed apart.
        split = make_engine(model, batch, max_len, args.steps, sync=True)
        engine_generate(split, prompts, N)
        split.stats.clear()
        split.timings.clear()
        split_s, _ = timed(lambda e=split, p=prompts: engine_generate(e, p, N), 1)
        steps = split.stats["generate_calls"] * args.steps
        row["split"] = {
            "total_s": split_s,
            "admit_s": split.timings["admit_s"],
            "generate_s": split.timings["generate_s"],
            "host_s": split.timings["host_s"],
            "prefill_tokens": split.stats["prefill_tokens"],
        }
        row["per_step_ms"] = {
            "generate_call": 1e3 * split.timings["generate_s"] / max(steps, 1),
            "host": 1e3 * split.timings["host_s"] / max(steps, 1),
        }
        split.close()
        if batch == max(args.batches) or args.split_all:
            kv = min(max_len, max(64, 1 << (P + N).bit_length()))
            row["per_step_ms"]["model_only"] = 1e3 * model_only_step(engine, batch, kv, args.steps)
        # Achieved FLOP rate: all the model's matmul work (prompts and sampled tokens) per second.
        work = batch * request_flops(cfg, P, N)
        row["gflops_achieved"] = work / ours_s / 1e9
        row["gflops_torch"] = work / torch_s / 1e9
        best_mm = max(matmul["xla"]["gflops_median"], matmul["torch"]["gflops_median"])
        row["fraction_of_best_matmul"] = row["gflops_achieved"] / best_mm
        engine.close()
        result["batches"][str(batch)] = row
        print(f"{name} batch {batch}: ours {row['ours_tok_s']:.1f} tok/s, torch "
              f"{row['torch_tok_s']:.1f} tok/s ({row['speedup']:.2f}x), "
              f"{row['gflops_achieved']:.1f} vs {row['gflops_torch']:.1f} GFLOP/s, agree "
              f"{row['greedy_all_agree']:.2f}, admit {row['split']['admit_s']:.2f} s, "
              f"step {row['per_step_ms']}", flush=True)  # fmt: skip
    if args.slots:
        sweep = {}
        for slots in args.slots:
            prompts = rng.integers(0, cfg.vocab_size, (slots, P)).astype(np.int32)
            engine = make_engine(model, slots, max_len, args.steps)
            engine_generate(engine, prompts, N)
            s, _ = timed(lambda e=engine, p=prompts: engine_generate(e, p, N), 1)
            sweep[str(slots)] = {"tok_s": slots * N / s, "compile_counts": engine.compile_counts}
            engine.close()
            print(f"{name} slots {slots}: {slots * N / s:.1f} tok/s", flush=True)
        result["slots_sweep"] = sweep
    if args.session_turns > 1:
        result["sessions"] = bench_sessions(model, cfg, args)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3_5_small,smollm2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--slots", default="1,2,4,8,16,32,64,128", help="'' to skip the sweep")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--split-all", action="store_true", help="model-only step time at every batch")
    ap.add_argument("--quick", action="store_true", help="qwen3_5_small, batches 1,16, no sweep")
    ap.add_argument("--session-turns", type=int, default=3, help="0: skip the sessions bench")
    ap.add_argument("--session-rows", type=int, default=8)
    ap.add_argument("--session-prompt", type=int, default=512, help="first prompt, tokens")
    ap.add_argument("--session-delta", type=int, default=64, help="tool result per turn, tokens")
    ap.add_argument("--out", default=str(RESULTS / "engine.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.slots = "qwen3_5_small", "1,16", ""
        args.session_rows, args.session_prompt = 4, 128
        args.new_tokens = min(args.new_tokens, 16)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.slots = [int(s) for s in args.slots.split(",") if s]
    report = {"machine": machine_info(), "args": dict(vars(args), out=Path(args.out).name)}
    report["matmul"] = bench_matmul(1024, 5)
    print(f"matmul GFLOP/s: xla {report['matmul']['xla']['gflops_median']:.0f}, torch "
          f"{report['matmul']['torch']['gflops_median']:.0f}", flush=True)  # fmt: skip
    report["models"] = {}
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            report["models"][name] = bench_model_engine(name, args, Path(tmp), report["matmul"])
        save_results(report, args.out)  # after each model: partial runs keep data
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
