"""Rollouts end to end at WHALE's shape: the executor (sandboxed harness workers, budgets,
records) and the engine (continuous batching, prefix cache) together, SmolLM2-135M (on the CPU;
on a GPU with JAX_PLATFORMS=cuda).

Workloads (``--tasks`` tasks x ``--samples`` samples each):
- ``h0``: the arith seed harness, one call per episode.
- ``vote``: three few-shot turns as messages, then the question, sampled seven times and voted.
- ``session``: a three-turn tool-using session on math: the problem, then two sandboxed Python
  results appended as user turns, each answered by the model (the client continues the session).

Session runs ``--session-tasks`` tasks (its episodes are three times as long). Each runs with the
prefix cache on and off (``EngineConfig.prefix_cache=False``: only the parked
session states are reused, as before the cache), on a fresh engine after a warm-up pass of the same
work on another engine (``--warm-tasks``: other tasks instead). Compilations are shared, so the
timed run is the steady state a long run reaches once its shapes are compiled (each shape of
prefill, resume or decode costs 2-6 s to compile here); the warm-up's wall and compile seconds
are the cold start. Reported: wall time (and the seconds of it JAX spent compiling
shapes the warm-up did not meet), episodes/s, sampled tokens/s, prompt tokens
requested / prefilled / unique (the size of the token trie of all prompts), prefilled per sampled
token, slot occupancy inside generate calls and the share of wall time spent in them; beside the
bare engine's decode rate at the same slot count and the workload's shape (every slot decoding the
mean completion length after a prompt of the median length: no harness, no admission), and the
same share with the compile seconds taken out of the wall time (the steady state of a long run).

    .venv/bin/python benchmarks/bench_rollout.py [--workloads h0,vote,session] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time
from pathlib import Path

from common import compile_timer, cpu_model, git_state, save_results
from thread_profile import ThreadSampler

VOTE = """
SYSTEM_PROMPT = "You are a calculator. Answer with only the number."
SHOTS = [("What is 12 + 7?", "19"), ("What is 9 * 8?", "72"), ("What is 40 - 13?", "27")]
VOTES = 7


def run(task, model, tools):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for question, answer in SHOTS:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": task.question})
    replies = [model.chat(messages, max_new_tokens=8).strip() for _ in range(VOTES)]
    counts = {}
    for r in replies:
        counts[r] = counts.get(r, 0) + 1
    return max(counts, key=counts.get)
"""

SESSION = """
SYSTEM_PROMPT = "You are a careful mathematician. Think briefly, then answer in \\\\boxed{}."


def run(task, model, tools):
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task.question}]
    reply = model.chat(messages, max_new_tokens=24)
    for code in ("print(2 ** 10)", "print(sum(range(10)))"):
        shown = tools.python(code)["stdout"]
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Python says: " + shown + "Continue."}]
        reply = model.chat(messages, max_new_tokens=24)
    return reply
"""


def workloads():
    from harness.domains import arith
    from harness.domains import math as mathdom

    h0 = arith.ArithDomain().seed_harness()
    return {
        "h0": (h0, arith.ArithDomain(), lambda n, s: arith.generate(n, seed=s)),
        "vote": (VOTE, arith.ArithDomain(), lambda n, s: arith.generate(n, seed=s)),
        "session": (
            SESSION,
            mathdom.MathDomain(),
            lambda n, s: mathdom.generate_offline(n, seed=s),
        ),
    }


def trie_size(prompts) -> int:
    """Distinct prefixes over all prompts: the tokens a perfect prefix cache would prefill."""
    seen: set[int] = set()
    for p in prompts:
        h = 0
        for t in p:
            h = hash((h, t))
            seen.add(h)
    return len(seen)


def bare_decode_rate(model, slots: int, max_len: int, steps: int, prompt_len: int,
                     new_tokens: int) -> float:  # fmt: skip
    """The engine alone at a workload's shape: every slot decoding ``new_tokens`` after a
    ``prompt_len``-token prompt (so the same KV windows), no harness; tokens/s inside generate."""
    import numpy as np

    from whale_jax.engine import Engine, EngineConfig, Request, Sampling

    rng = np.random.default_rng(0)
    # sync_timings: admission's device work is waited for inside admission, so generate_s is
    # decode. The prompts are kept whole, so repeats start from the store instead of prefilling
    # again (only to keep this measurement short: admission is not part of the rate).
    engine = Engine(model, EngineConfig(slots=slots, max_len=max_len, steps=steps, prefill_batch=16,
                                        cache_rows=slots, sync_timings=True), eos_ids=())  # fmt: skip
    sampling = Sampling(temperature=1.0, top_k=20, max_new_tokens=new_tokens)
    reqs = [Request(prompt_ids=tuple(rng.integers(0, 1000, prompt_len).tolist()),
                    sampling=sampling, identity=(i,))
            for i in range(slots)]  # fmt: skip
    engine.generate(reqs)  # compiles
    engine.generate(reqs)  # compiles the insert from the store
    engine.stats.clear()
    engine.timings.clear()
    for _ in range(max(1, 64 // new_tokens)):
        engine.generate(reqs)
    rate = engine.stats["decode_slot_steps"] / engine.timings["generate_s"]
    engine.close()
    return round(rate, 1)


def engine_host_s(engine) -> float:
    t = engine.timings
    return t["admit_s"] + t["dispatch_s"] + t["host_s"]


def workload_shape(records) -> tuple[int, int]:
    """The bare engine's shape for a run: its calls' median prompt and mean completion length."""
    calls = [c for r in records for c in r.calls]
    median_prompt = sorted(len(c.prompt_ids) for c in calls)[len(calls) // 2]
    return median_prompt, max(1, round(sum(len(c.completion_ids) for c in calls) / len(calls)))


def run_workload(model, tokenizer, name, spec, args, cache: bool) -> dict:
    from harness.executor import Executor, ExecutorConfig
    from whale_jax.engine.client import EngineClient

    source, domain, make_tasks = spec
    options = dict(slots=args.slots, max_len=args.max_len, steps=args.steps,
                   prefill_batch=args.prefill_batch,
                   cache_rows=args.cache_rows, prefix_cache=cache,
                   row_moves=args.row_moves, unroll_layers=args.unroll_layers,
                   pipeline=bool(args.pipeline), sync_timings=args.sync_timings)  # fmt: skip
    config = ExecutorConfig(concurrency=args.concurrency)
    tasks = make_tasks(args.session_tasks if name == "session" else args.tasks, args.seed)
    warm_tasks = make_tasks(args.warm_tasks, 1000 + args.seed) if args.warm_tasks else tasks
    warm = EngineClient(model, tokenizer, **options)
    compiling = compile_timer()
    with Executor(warm, config) as ex:  # compiles the shapes this workload meets
        t0 = time.perf_counter()
        warm_records = ex.run(source, domain, warm_tasks, samples=args.samples)
        cold = {"wall_s": round(time.perf_counter() - t0, 2), "compile_s": round(compiling(), 2)}
    warm.close()  # frees its decode state and store before the next engine allocates its own
    # The limit is measured just before and just after the timed run (this machine's speed drifts
    # by tens of percent within minutes); the share uses their mean.
    bare_before = bare_decode_rate(model, args.slots, args.max_len, args.steps,
                                   *workload_shape(warm_records))  # fmt: skip
    compiling()  # the bare engine's own compiles are not the timed run's
    client = EngineClient(model, tokenizer, **options)
    engine = client.engine
    sampler = None
    if args.profile:
        engine._ensure_thread()  # idle until the first request: sampled from the start
        sampler = ThreadSampler(engine._thread)
        sampler.start()
    with Executor(client, config) as ex:
        t0 = time.perf_counter()
        records = ex.run(source, domain, tasks, samples=args.samples)
        wall = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()  # before close: the thread's CPU clock ends with it
    compile_s = compiling()  # shapes the warm-up did not meet, compiled inside the timed run
    client.close()
    if sampler is not None:
        busy = sum(engine.timings.values())
        path = Path(args.profile) / f"{name}_{'on' if cache else 'off'}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{name} cache={'on' if cache else 'off'}: engine thread busy {busy:.2f} s "
                        f"of {wall:.2f} s wall; {sampler.report()}\n")  # fmt: skip
        cpu = "?" if sampler.cpu_s is None else f"{sampler.cpu_s:.2f}"
        print(f"  engine thread profile: {path} (busy {busy:.2f} s, CPU {cpu} s)", flush=True)
    calls = [c for r in records for c in r.calls]
    prompts = [tuple(c.prompt_ids) for c in calls]
    sampled = sum(len(c.completion_ids) for c in calls)
    stats, cache_stats = engine.stats, engine.cache_stats()
    stops = collections.Counter(r.stop_reason for r in records)
    occupancy = stats["decode_slot_steps"] / max(1, stats["decode_steps"] * args.slots)
    result = {
        "workload": name,
        "prefix_cache": cache,
        "episodes": len(records),
        "stop_reasons": dict(stops),
        "calls": len(calls),
        "wall_s": round(wall, 2),
        "compile_s": round(compile_s, 2),
        "warm_up": cold,  # the same work on a fresh process's first engine: the cold start
        "episodes_per_s": round(len(records) / wall, 2),
        "sampled_tokens": sampled,
        "sampled_tokens_per_s": round(sampled / wall, 1),
        "prompt_tokens": sum(map(len, prompts)),
        "prefilled_tokens": cache_stats["computed_tokens"],
        "unique_prompt_tokens": trie_size(prompts),
        "prefilled_per_sampled": round(cache_stats["computed_tokens"] / max(sampled, 1), 2),
        "cache": cache_stats,
        "slot_occupancy_in_generate": round(occupancy, 3),
        "generate_calls": stats["generate_calls"],
        "decode_steps": stats["decode_steps"],
        "generate_share_of_wall": round(engine.timings["generate_s"] / wall, 3),
        # The engine thread admitting, decoding or sorting results (the rest: no request to serve,
        # every episode in harness code or tools).
        "engine_busy_share_of_wall": round(sum(engine.timings.values()) / wall, 3),
        "timings_s": {k: round(v, 2) for k, v in engine.timings.items()},
        # The engine thread's own host work (admission, dispatching calls, reading their tokens:
        # everything but waiting for the device) per model call and per sampled token.
        "engine_host_ms_per_call": round(1e3 * engine_host_s(engine) / max(len(calls), 1), 3),
        "engine_host_us_per_token": round(1e6 * engine_host_s(engine) / max(sampled, 1), 2),
        "wall_ms_per_call": round(1e3 * wall / max(len(calls), 1), 3),
        "compile_counts": engine.compile_counts,
        "client_renders": dict(client.render_stats),  # rendered prompts remembered / made
        "mean_reward": round(sum(r.reward for r in records) / len(records), 4),
        "completions": [[tuple(c.completion_ids) for c in r.calls] for r in records],
    }
    result["prefilled_over_unique"] = round(
        result["prefilled_tokens"] / max(result["unique_prompt_tokens"], 1), 2
    )
    # The limit: the bare engine at this workload's median prompt and mean completion.
    median_prompt, mean_new = workload_shape(records)
    bare_after = bare_decode_rate(model, args.slots, args.max_len, args.steps, median_prompt,
                                  mean_new)  # fmt: skip
    bare = round((bare_before + bare_after) / 2, 1)
    result["bare_engine"] = {"prompt_len": median_prompt, "new_tokens": mean_new,
                             "decode_tokens_per_s": bare, "before": bare_before,
                             "after": bare_after}  # fmt: skip
    result["sampled_over_bare"] = round(result["sampled_tokens_per_s"] / bare, 3)
    # Compiles stop the engine thread (everything waits on them); a WHALE run meets each shape
    # once in hours. The warm-up meets nearly all of them (its own tasks: not every one).
    steady = sampled / max(wall - compile_s, 1e-9)
    result["sampled_tokens_per_s_excluding_compile"] = round(steady, 1)
    result["sampled_over_bare_excluding_compile"] = round(steady / bare, 3)
    print(f"{name:8s} cache={'on ' if cache else 'off'} {wall:7.1f} s ({compile_s:.1f} compiling; "
          f"cold start {cold['wall_s']:.1f} s, {cold['compile_s']:.1f} compiling)  "
          f"{result['episodes_per_s']:6.2f} ep/s  {result['sampled_tokens_per_s']:6.1f} tok/s  "
          f"prompt {result['prompt_tokens']} req / {result['prefilled_tokens']} prefilled / "
          f"{result['unique_prompt_tokens']} unique  full hits {cache_stats['full_hits']}  "
          f"evictions {cache_stats['evictions']}  occupancy {occupancy:.2f}  "
          f"generate {result['generate_share_of_wall']:.0%} of wall, engine busy "
          f"{result['engine_busy_share_of_wall']:.0%}  bare engine {bare} tok/s "
          f"({bare_before} before, {bare_after} after) "
          f"({result['sampled_over_bare']:.0%}; {steady / bare:.0%} excluding compiles)",
          flush=True)  # fmt: skip
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="h0,vote,session")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--session-tasks", type=int, default=16, help="tasks of the session workload")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--warm-tasks", type=int, default=0,
                    help="warm-up tasks (other seeds); 0: the timed run's own tasks")  # fmt: skip
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill-batch", type=int, default=16,
                    help="EngineConfig.prefill_batch: most prompts one prefill or resume call takes")  # fmt: skip
    ap.add_argument("--cache-rows", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256, help="episodes in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="on,off", help="prefix cache modes to run")
    ap.add_argument("--row-moves", choices=["loop", "scatter"], default=None,
                    help="EngineConfig.row_moves (default: by backend)")  # fmt: skip
    ap.add_argument("--unroll-layers", type=int, choices=[0, 1], default=None,
                    help="EngineConfig.unroll_layers: 1 = layers as straight-line code, 0 = "
                    "scanned (default: by backend, unrolled on the CPU)")  # fmt: skip
    ap.add_argument("--sync-timings", action="store_true",
                    help="EngineConfig.sync_timings: admission waits for its device work, so "
                    "timings_s splits admission (prefill, resume, insert) from decode; off by "
                    "default (it serialises host and device work)")  # fmt: skip
    ap.add_argument("--profile", default="",
                    help="folder for a sampled profile of the engine thread per timed run")  # fmt: skip
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run: how long a thread waiting for the GIL "
                    "waits before asking for it (Python's default 0.005 s)")  # fmt: skip
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                    help="smollm2: SmolLM2-135M-Instruct; tiny: the CPU proxy, SmolLM2's tokenizer "
                    "on a random 2-layer, 32-wide model (whale_jax.models.config.TINY_SMOLLM2_HF), "
                    "whose device work is small enough that the host's shows")  # fmt: skip
    ap.add_argument("--pipeline", type=int, choices=[0, 1], default=1,
                    help="EngineConfig.pipeline: read each generate call's tokens one call late")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="8 tasks x 8 samples, h0 and vote")
    ap.add_argument("--out", default="benchmarks/results/rollout.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.session_tasks, args.workloads = 8, 4, "h0,vote"
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    import jax

    if args.model == "tiny":
        from whale_jax.io.gguf import find_smollm2_gguf
        from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf
        from whale_jax.io.load import random_model
        from whale_jax.models.config import TINY_SMOLLM2_HF, ModelConfig

        model = random_model(ModelConfig.from_hf(TINY_SMOLLM2_HF), seed=0)
        tokenizer = tokenizer_from_gguf(find_smollm2_gguf())
    else:
        from whale_jax.io.load import load_model

        model, _, tokenizer = load_model("smollm2")
    specs = workloads()
    results = {
        "benchmark": "rollouts end to end: executor + engine, "
        + ("SmolLM2-135M-Instruct fp32" if args.model == "smollm2" else "the CPU proxy (tiny)"),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "platform": platform.platform(),
            "jax_device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            **git_state(),
        },  # fmt: skip
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": [],
    }
    for name in args.workloads.split(","):
        by_mode = {}
        for mode in args.modes.split(","):
            by_mode[mode] = run_workload(model, tokenizer, name, specs[name], args, mode == "on")
        if {"on", "off"} <= by_mode.keys():
            on, off = by_mode["on"], by_mode["off"]
            on["speedup_vs_off"] = round(off["wall_s"] / on["wall_s"], 2)
            on["same_tokens_as_off"] = on["completions"] == off["completions"]
            print(f"{name:8s} cache on: {on['speedup_vs_off']}x faster, same tokens "
                  f"{on['same_tokens_as_off']}", flush=True)  # fmt: skip
        for r in by_mode.values():
            del r["completions"]
            results["runs"].append(r)
        save_results(results, args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
