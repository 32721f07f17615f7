"""One accelerator, one command: the device's own limits, then the rollout engine and the trainer
at Qwen3.5-2B/4B shapes against them, then rollouts end to end; JSON saved after every part.

    python benchmarks/bench_device.py                      # a GPU or TPU host (about 8 minutes)
    python benchmarks/bench_device.py --quick              # the same program in minutes on a CPU

Parts, in order (``--parts`` picks among all but the first):

1. ``limits``: memory bandwidth (an elementwise pass over a ``--hbm-gib`` bf16 array: read and
   write) and the bf16 matmul peak (``--matmul-n`` square matmuls), both measured here: the
   roofline and MFU below are against this device, not a data sheet.
2. ``models`` (``--models``; random weights, nothing downloaded; Qwen3.5-2B and -4B text configs
   from bench_train.py):
   - decode: the bare engine (``Engine``, sync timings: its generate time is device time) at each
     of ``--slots``, every slot sampling ``--new-tokens`` after a ``--prompt-len`` prompt, bf16;
     tokens/s beside the roofline ``slots / ((weight bytes + slots x decode-state bytes at the
     mean context) / bandwidth)``, a bound: it counts every byte read once and nothing written;
   - prefill: ``--prefill-batch`` prompts of ``--prefill-len`` tokens in one call; tokens/s and
     MFU (the forward's matmul FLOPs, attention at the mean causal context); the engine's memory
     estimate of its own prefill call at that shape (keeping and inserting its rows, 64 slots)
     beside XLA's compiled count on this device;
   - train: the RSFT train step (bf16 compute, fp32 masters, remat) over ``--train-rows`` rows of
     ``--train-len`` tokens, their second half trained; tokens/s and MFU (3x the forward's FLOPs).
   A part that fails (memory) is recorded with its error and the program goes on.
3. ``rollouts``: benchmarks/bench_rollout.py's workloads (``--workloads``) at 64 slots with
   SmolLM2-135M-Instruct (the bundled GGUF), the prefix cache on: end to end tokens/s over the bare
   engine's at the workload's shape.
4. ``knobs`` (not in the default parts: a few minutes more): h0 and the vote end to end at each
   decode steps per call x prefill batch of ``KNOBS``, to set the engine's defaults by backend
   (``whale_jax.engine.engine.BACKEND_DEFAULTS``).
5. ``cold_start`` (not in the default parts: a few minutes more): benchmarks/bench_cold_start.py
   on h0, a fresh process per case: compiled as met (empty cache), read from the persistent cache,
   and the cache plus the warm-up from the first case's record (``--engine_warm_up=recorded``).

``--quick`` runs the tiny Qwen3.5 config, small shapes and the rollout CPU proxy (``--model tiny``),
to check the program anywhere. Writes ``--out`` (default benchmarks/results/bench_device.json).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
from common import RESULTS, flops_per_token, machine_info, save_results

GIB = 1024**3


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which must wait for its device work) after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def device_limits(hbm_gib: float, matmul_n: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    n = int(hbm_gib * GIB) // 2
    arrays = [jnp.ones((n,), jnp.bfloat16)]
    scale = jax.jit(lambda a: a * jnp.bfloat16(1.0009765625))
    seconds = timed(lambda: scale(arrays[0]).block_until_ready(), repeats)
    bandwidth = 2 * n * 2 / seconds  # read and write
    arrays.clear()  # the memory goes back before the models'
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(key_b, (matmul_n, matmul_n), jnp.bfloat16)
    mm = jax.jit(jnp.matmul)
    mm_s = timed(lambda: mm(a, b).block_until_ready(), repeats)
    return {
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bandwidth_array_gib": hbm_gib,
        "matmul_bf16_tflops": round(2 * matmul_n**3 / mm_s / 1e12, 2),
        "matmul_n": matmul_n,
    }


def model_config(name: str) -> dict:
    if name == "tiny":
        from whale_jax.models.config import tiny_qwen3_5_hf

        return tiny_qwen3_5_hf(vocab_size=512)
    from bench_train import AOT_MODELS

    return dict(AOT_MODELS[name])


def bench_decode(model, cfg, args, limits: dict) -> list[dict]:
    import jax
    from flax import nnx

    from whale_jax.engine import Engine, EngineConfig, Request, Sampling
    from whale_jax.engine.device import cache_bytes_per_slot

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    context = args.prompt_len + args.new_tokens // 2
    rng = np.random.default_rng(0)
    rows = []
    for slots in args.slots:
        row = {"slots": slots}
        engine = None
        try:
            engine = Engine(model, EngineConfig(
                slots=slots, max_len=args.max_len, steps=args.steps, prefill_batch=16,
                cache_rows=slots, sync_timings=True), eos_ids=())  # fmt: skip
            sampling = Sampling(temperature=1.0, top_k=20, max_new_tokens=args.new_tokens)
            prompts = rng.integers(0, cfg.vocab_size, (slots, args.prompt_len))
            reqs = [Request(prompt_ids=tuple(p.tolist()), sampling=sampling, identity=(i,))
                    for i, p in enumerate(prompts)]  # fmt: skip
            t0 = time.perf_counter()
            engine.generate(reqs)  # compiles prefill, insert, generate
            row["first_pass_s"] = round(time.perf_counter() - t0, 2)
            engine.generate(reqs)  # compiles the insert from the store
            engine.stats.clear()
            engine.timings.clear()
            engine.generate(reqs)
            rate = engine.stats["decode_slot_steps"] / engine.timings["generate_s"]
            state = cache_bytes_per_slot(cfg, context, model.dtype)
            step_bytes = weight_bytes + slots * state
            roofline = slots / (step_bytes / (limits["memory_bandwidth_gb_s"] * 1e9))
            row.update(tokens_per_s=round(rate, 1), roofline_tokens_per_s=round(roofline, 1),
                       of_roofline=round(rate / roofline, 3), weight_gib=weight_bytes / GIB,
                       state_mib_per_slot=round(state / 2**20, 2))  # fmt: skip
        except Exception as e:  # memory, mostly: recorded, the next case runs
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            if engine is not None:
                engine.close()
            gc.collect()
        print(f"  decode {slots:4d} slots: {row}", flush=True)
        rows.append(row)
    return rows


def bench_prefill(model, cfg, args, limits: dict) -> dict:
    import jax
    from flax import nnx

    from whale_jax.engine.device import _prefill

    P, T = args.prefill_batch, args.prefill_len
    graphdef, params = nnx.split(model)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (P, T)).astype(np.int32)
    lengths = np.full((P,), T, np.int32)

    def prefill():  # the model's prompt pass alone, layers scanned as the engine runs it
        return jax.block_until_ready(_prefill(graphdef, params, None, tokens, lengths))

    seconds = timed(prefill, args.repeats)
    flops = P * T * flops_per_token(cfg, T / 2)
    out = {"prompts": P, "tokens_each": T, "tokens_per_s": round(P * T / seconds, 1),
           "mfu": round(flops / seconds / (limits["matmul_bf16_tflops"] * 1e12), 3)}  # fmt: skip
    out["memory_mib"] = prompt_memory(model, cfg, P, T)
    return out


def prompt_memory(model, cfg, P: int, T: int, slots: int = 64) -> dict:
    """The engine's estimate of its prefill call's memory (``device.prompt_call_bytes``, what its
    ``prompt_bytes`` budget is checked against) beside this device's compiled count of that call
    (the prefill keeping and inserting its rows, as the engine runs it, into ``slots`` slots;
    ``memory_analysis``: temporaries and outputs not aliased to the donated state and store):
    the estimate must not be below it."""
    from whale_jax.engine import device as dev

    engine = dev.DeviceEngine(model, slots=slots, max_len=T, cache_rows=P)
    moved = 0 if engine.loop_moves else P + slots
    estimate = dev.prompt_call_bytes(cfg, P, T, T, model.dtype, moved=moved) / 2**20
    analysis = engine.compile_ahead("prefill", ((P, T),)).memory_analysis()
    del engine
    if analysis is None:
        return {"estimate": round(estimate, 1), "compiled": None}
    compiled = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes) / 2**20  # fmt: skip
    return {"estimate": round(estimate, 1), "compiled": round(compiled, 1), "slots": slots,
            "estimate_over_compiled": round(estimate / compiled, 2)}  # fmt: skip


def bench_train_step(cfg, args, limits: dict) -> dict:
    import jax
    from bench_train import as_rows, make_batch, train_flops

    from whale_jax.io.load import random_model
    from whale_jax.sharding import make_mesh
    from whale_jax.train.trainer import OptimConfig, TrainConfig, Trainer

    model = random_model(cfg, seed=0)  # fp32 masters
    config = TrainConfig(optim=OptimConfig(learning_rate=1e-6), seq_len=args.train_len,
                         micro_tokens=args.train_rows * args.train_len, remat=True,
                         compute_dtype="bfloat16")  # fmt: skip
    trainer = Trainer(model, config, make_mesh(devices=jax.devices()[:1]))
    ids, mask = make_batch(cfg.vocab_size, args.train_rows, args.train_len)
    rows = as_rows(ids, mask)
    t0 = time.perf_counter()
    trainer.update(rows)
    first = time.perf_counter() - t0
    seconds = timed(lambda: trainer.update(rows), args.repeats)
    flops = ids.size * train_flops(cfg, args.train_len)
    return {"rows": args.train_rows, "tokens_each": args.train_len, "first_step_s": round(first, 2),
            "step_s": round(seconds, 3), "tokens_per_s": round(ids.size / seconds, 1),
            "mfu": round(flops / seconds / (limits["matmul_bf16_tflops"] * 1e12), 3)}  # fmt: skip


def attempt(part: str, run) -> dict:
    """``run()``'s result, or the error that stopped it (memory, mostly): recorded, and the
    program goes on."""
    try:
        result = run()
    except Exception as e:
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    print(f"  {part}: {result}", flush=True)
    return result


def bench_model(name: str, args, limits: dict) -> dict:
    import jax.numpy as jnp

    from whale_jax.io.load import random_model
    from whale_jax.models.config import ModelConfig

    cfg = ModelConfig.from_hf(model_config(name))
    out: dict = {"model": name, "params_b": round(cfg.num_params() / 1e9, 3)}
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16)
    print(f"{name}: {out['params_b']}B parameters", flush=True)
    out["decode"] = bench_decode(model, cfg, args, limits)
    out["prefill"] = attempt("prefill", functools.partial(bench_prefill, model, cfg, args, limits))
    del model  # the train step builds its own fp32 masters
    gc.collect()
    out["train"] = attempt("train", functools.partial(bench_train_step, cfg, args, limits))
    return out


def bench_rollouts(args) -> list[dict]:
    import bench_rollout

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rollout.json"
        argv = ["--workloads", args.workloads, "--modes", "on", "--slots", "64",
                "--tasks", str(args.rollout_tasks), "--session-tasks", str(args.rollout_tasks // 4),
                "--model", "tiny" if args.quick else "smollm2", "--out", str(out)]  # fmt: skip
        bench_rollout.main(argv)
        runs = json.loads(out.read_text())["runs"]
    keys = ("workload", "wall_s", "compile_s", "sampled_tokens_per_s", "bare_engine",
            "sampled_over_bare", "sampled_over_bare_excluding_compile", "engine_host_ms_per_call",
            "compile_counts", "warm_up")  # fmt: skip
    return [{k: r[k] for k in keys if k in r} for r in runs]


# Decode steps per call x most rows per prefill call: the engine's defaults by backend
# (whale_jax/engine/engine.py, BACKEND_DEFAULTS) are to be set from this sweep.
KNOBS = [(8, 16), (16, 16), (8, 64), (16, 64), (32, 64)]


def bench_knobs(args) -> list[dict]:
    import bench_rollout

    rows = []
    for steps, batch in KNOBS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rollout.json"
            bench_rollout.main(["--workloads", "h0,vote", "--modes", "on", "--slots", "64",
                                "--tasks", str(args.rollout_tasks), "--steps", str(steps),
                                "--prefill-batch", str(batch),
                                "--model", "tiny" if args.quick else "smollm2",
                                "--out", str(out)])  # fmt: skip
            for r in json.loads(out.read_text())["runs"]:
                rows.append({"steps": steps, "prefill_batch": batch, "workload": r["workload"],
                             "wall_s": r["wall_s"], "compile_s": r.get("compile_s"),
                             "sampled_over_bare": r.get("sampled_over_bare"),
                             "sampled_over_bare_excluding_compile":
                                 r.get("sampled_over_bare_excluding_compile")})  # fmt: skip
                print(f"  knobs: {rows[-1]}", flush=True)
    return rows


def bench_cold_start(args) -> list[dict]:
    import bench_cold_start

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cold_start.json"
        bench_cold_start.main(["--workloads", "h0", "--cases", "first,resume,resume_warm",
                               "--no-all", "--tasks", str(args.rollout_tasks // 2),
                               "--out", str(out)])  # fmt: skip
        return json.loads(out.read_text())["runs"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="models,rollouts",
                    help="after the limits (always measured): models, rollouts, knobs, "
                    "cold_start")  # fmt: skip
    ap.add_argument("--models", default="qwen3_5_2b,qwen3_5_4b")
    ap.add_argument("--slots", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per generate call")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--train-rows", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=2048)
    ap.add_argument("--hbm-gib", type=float, default=4.0)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workloads", default="h0,vote,session")
    ap.add_argument("--rollout-tasks", type=int, default=32)
    ap.add_argument("--quick", action="store_true",
                    help="the tiny config, small shapes, the rollout CPU proxy: a check anywhere")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "bench_device.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.slots, args.prompt_len, args.new_tokens, args.max_len = (
            "tiny", "1,8", 32, 16, 128)  # fmt: skip
        args.prefill_batch, args.prefill_len, args.train_rows, args.train_len = 2, 64, 2, 64
        args.hbm_gib, args.matmul_n, args.repeats = 0.125, 512, 2
        args.workloads, args.rollout_tasks = "h0,vote", 8
    args.slots = [int(s) for s in args.slots.split(",")]
    parts = args.parts.split(",")
    import jax

    results: dict = {"benchmark": "the device's limits, the engine and trainer at Qwen3.5 shapes, "
                     "rollouts end to end", "machine": machine_info(),
                     "device": jax.devices()[0].device_kind,
                     "args": {k: v for k, v in vars(args).items() if k != "out"}}  # fmt: skip
    t0 = time.perf_counter()
    limits = device_limits(args.hbm_gib, args.matmul_n, args.repeats)
    results["limits"] = limits
    print(f"limits: {limits}", flush=True)
    save_results(results, args.out)
    if "models" in parts:
        results["models"] = []
        for name in args.models.split(","):
            results["models"].append(bench_model(name, args, limits))
            save_results(results, args.out)
    if "rollouts" in parts:
        results["rollouts"] = bench_rollouts(args)
        save_results(results, args.out)
    if "knobs" in parts:
        results["knobs"] = attempt("knobs", functools.partial(bench_knobs, args))
        save_results(results, args.out)
    if "cold_start" in parts:
        results["cold_start"] = attempt("cold_start", functools.partial(bench_cold_start, args))
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    save_results(results, args.out)
    print(f"saved {args.out} ({results['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
