"""Training benchmark: our RSFT train step beside transformers + torch.optim.AdamW, and the memory of
the Qwen3.5-2B/4B train steps compiled ahead of time for an 8-device mesh.

1. **train** (this CPU, fp32): for each model (``qwen3_5_small`` and SmolLM2-135M from the
   bundled GGUF; both sides load the same weights through ``common.load_models``), one fixed
   batch of ``--rows`` random rows of ``--row-len`` tokens whose second half is trained (the
   "completion"). One step = forward + backward + AdamW over the whole batch (one microbatch):

   - ours: ``Trainer(model, TrainConfig(optim=OptimConfig(learning_rate=1e-5), seq_len=L,
     micro_tokens=rows * L, remat=...), mesh).update(rows)``, on a mesh of 1 device and of every
     XLA host device (``--devices``; with 2 the batch splits over ``fsdp``), remat off and on;
   - torch: ``model.train()``; ``loss = model(input_ids=ids, labels=labels).loss`` with
     ``labels[t] = ids[t]`` where the mask is set and -100 elsewhere (transformers shifts labels,
     so this is our mask-on-target convention); ``loss.backward()``, gradient clipping at the
     same global norm as ours (``--max-grad-norm``, our default 1.0), ``AdamW(lr=1e-5,
     weight_decay=0.0)`` (our defaults: betas 0.9/0.999, eps 1e-8), ``zero_grad(set_to_none)``.

   The first step's loss (token mean over the trained targets, before the update) of every
   variant must match torch's to 1e-3 relative (exit status 1 otherwise). Timing: each case is
   warmed up once (ours: that call compiles; reported as ``first_call_s``, and ``compile_s`` =
   the tracing, lowering and XLA compile time JAX's monitoring events report during it), then
   cases run round-robin (common.time_cases); tokens/s = all token positions of the batch /
   median step time. Same-run fp32 matmul GFLOP/s
   (XLA and torch) are context. On a shared machine torch's multi-threaded ops slow down by 10x
   and more when a neighbour holds a core (each op's thread hand-off waits): ``--cpus 1`` pins
   the process to one CPU so both sides run single-threaded, the comparison to quote then.

2. **aot** (no weights materialised): Qwen3.5-2B and -4B text models (configs below), bf16
   compute with fp32 masters, remat on, a microbatch of ``--aot-seqs`` x ``--aot-seq-len`` tokens,
   on simulated CPU meshes (default data=1 fsdp=8 tp=1 and data=1 fsdp=4 tp=2). The trainer's
   jitted accumulate and apply steps are lowered from ShapeDtypeStructs carrying the trainer's
   NamedShardings and compiled; ``compiled.memory_analysis()`` gives the bytes per device. Each
   (model, mesh) compiles in a child process (the device count must be set before JAX starts),
   stopped above ``--aot-mem-gib`` of resident memory or ``--aot-timeout`` seconds; then the
   model is compiled at 4 and 8 layers and the bytes are extrapolated linearly in depth.

Run:  .venv/bin/python benchmarks/bench_train.py                       (both parts; ~15 min)
      .venv/bin/python benchmarks/bench_train.py --only train --repeats 5
      .venv/bin/python benchmarks/bench_train.py --only train --cpus 1 --out PATH  (1 CPU)
      .venv/bin/python benchmarks/bench_train.py --only aot
Writes benchmarks/results/train.json (``--out``) and benchmarks/results/train_aot.json
(``--aot-out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import (
    QWEN3_5_FAMILY,
    REPO,
    RESULTS,
    WATCHDOG,
    bench_matmul,
    compile_timer,
    flops_per_token,
    load_models,
    machine_info,
    save_results,
    time_cases,
    use_cpus,
)

# Qwen3.5 text models (the paper's policies). Attention, MLP, depth, vocabulary, RoPE and tying
# are the Megatron arguments of the slime/miles training recipes: williammtan/miles
# scripts/models/qwen3.5-2B.sh (24 layers, hidden 2048, ffn 6144, 8 heads, 2 query groups,
# kv-channels 256) and radixark/miles scripts/models/qwen3.5-4B.sh = THUDM/slime's
# slime/scripts/models/qwen3.5-4B.sh (32 layers, hidden 2560, ffn 9216, 16 heads, 4 query
# groups, kv-channels 256); both: vocab 248320, rotary-percent 0.25, rotary-base 1e7, and no
# --untie-embeddings-and-output-weights (tied; the 27B recipe unties). Those recipes do not carry
# the Gated DeltaNet shapes (their spec reads them from the HF config): 16 key / 16 value heads
# of 128 for 2B (as 0.8B; bench_model.py's GDN_SHAPE) and 16 key / 32 value heads of 128 for 4B are
# from public config fixtures of other projects that mirror the HF text_config (found by text
# search, repository not identified), so those counts are the least certain numbers here.
# The multi-token-prediction layer (mtp_num_hidden_layers 1) is not part of our model.
_QWEN3_5_COMMON = {
    **QWEN3_5_FAMILY,
    "vocab_size": 248320,
    "head_dim": 256,
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
}
QWEN3_5_2B = {
    **_QWEN3_5_COMMON,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
}
QWEN3_5_4B = {
    **_QWEN3_5_COMMON,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
AOT_MODELS = {"qwen3_5_2b": QWEN3_5_2B, "qwen3_5_4b": QWEN3_5_4B}
AOT_SOURCES = {
    "qwen3_5_2b": {
        "core": "williammtan/miles scripts/models/qwen3.5-2B.sh",
        "gdn_heads": "third-party config fixtures (16 key / 16 value heads, as Qwen3.5-0.8B)",
    },
    "qwen3_5_4b": {
        "core": "radixark/miles scripts/models/qwen3.5-4B.sh (= THUDM/slime recipe)",
        "gdn_heads": "third-party config fixtures (16 key / 32 value heads)",
    },
}
GIB = 1024**3


# ------------------------------------------------------------------------------------------------
# 1. train step vs transformers + torch.optim.AdamW


def make_batch(vocab: int, rows: int, length: int, seed: int = 0):
    """(ids [rows, length] int64, mask [rows, length] bool): random tokens, second half trained."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, length), dtype=np.int64)
    mask = np.zeros((rows, length), bool)
    mask[:, length // 2 :] = True
    return ids, mask


def as_rows(ids: np.ndarray, mask: np.ndarray):
    from whale_jax.train.rows import Row

    return [
        Row(ids=tuple(int(t) for t in i), mask=tuple(bool(m) for m in k), episode=e,
            task_id="bench", session_id=f"s{e}")
        for e, (i, k) in enumerate(zip(ids, mask, strict=True))
    ]  # fmt: skip


def make_trainer(model, args, remat: bool, devices: int):
    import jax

    from whale_jax.sharding import make_mesh
    from whale_jax.train.trainer import OptimConfig, TrainConfig, Trainer

    optim = OptimConfig(learning_rate=args.lr, max_grad_norm=args.max_grad_norm)
    config = TrainConfig(
        optim=optim, seq_len=args.row_len, micro_tokens=args.rows * args.row_len, remat=remat
    )
    return Trainer(model, config, make_mesh(devices=jax.devices()[:devices]))


def torch_stepper(tmodel, ids: np.ndarray, mask: np.ndarray, args):
    """A function running one training step of the torch model; returns the loss before it."""
    import torch

    tmodel.train()
    input_ids = torch.from_numpy(ids)
    labels = torch.from_numpy(np.where(mask, ids, -100))
    params = [p for p in tmodel.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )  # our OptimConfig defaults

    def step() -> float:
        loss = tmodel(input_ids=input_ids, labels=labels, use_cache=False).loss
        loss.backward()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def train_flops(cfg, length: int) -> float:
    """Model FLOPs of one training token: 3x the forward matmuls (LM head included) at the mean
    causal context; remat's recomputation is not counted."""
    return 3.0 * flops_per_token(cfg, length / 2)


def bench_train_model(name: str, args, tmp: Path, matmul: dict) -> dict:
    import jax

    model, tmodel, cfg = load_models(name, tmp)
    ids, mask = make_batch(cfg.vocab_size, args.rows, args.row_len)
    rows = as_rows(ids, mask)
    positions = ids.size
    trained = int(mask[:, 1:].sum())  # position 0 predicts nothing
    torch_step = torch_stepper(tmodel, ids, mask, args)
    torch_first = torch_step()  # the loss of the initial weights (also torch's warm-up)
    result = {"model": name, "num_params": cfg.num_params(), "rows": args.rows,
              "row_len": args.row_len, "token_positions": positions,
              "trained_tokens": trained, "torch_first_loss": torch_first,
              "model_gflop_per_step": train_flops(cfg, args.row_len) * positions / 1e9,
              "groups": [], "variants": {}}  # fmt: skip
    best_mm = max(matmul["xla"]["gflops_median"], matmul["torch"]["gflops_median"])
    devices = [d for d in args.devices if d <= jax.device_count()]
    compiling = compile_timer()
    for remat in args.remat:
        # One group per remat setting, each with its own torch timing: fewer trainers (fp32
        # masters + AdamW state each) alive at once.
        trainers, firsts = {}, {}
        for d in devices:
            key = f"ours_{d}dev" + ("_remat" if remat else "")
            trainers[key] = make_trainer(model, args, bool(remat), d)
        cases, warm = {}, {}
        for key, trainer in trainers.items():

            def run(t=trainer):
                return t.update(rows)

            def first(t=trainer, k=key, out=firsts):
                compiling()
                out[k] = (t.update(rows), compiling())
                return out[k]

            cases[key], warm[key] = run, first
        cases["torch"], warm["torch"] = torch_step, torch_step
        stats, _, first_s, load = time_cases(cases, args.repeats, warm)
        torch_s = stats["torch"]["median_s"]
        group = {"remat": bool(remat), "load_1m": load, "torch": {
            **stats["torch"], "tokens_per_s": positions / torch_s}}  # fmt: skip
        result["groups"].append(group)
        for key, trainer in trainers.items():
            s, (m, compile_s) = stats[key], firsts[key]
            rel = abs(m.loss - torch_first) / abs(torch_first)
            entry = {
                **s,
                "devices": trainer.mesh.devices.size,
                "mesh": dict(trainer.mesh.shape),
                "remat": bool(remat),
                "tokens_per_s": positions / s["median_s"],
                "torch_tokens_per_s": positions / torch_s,
                "ratio_vs_torch": torch_s / s["median_s"],
                "first_call_s": first_s[key],
                "compile_s": compile_s,
                "first_loss": m.loss,
                "loss_rel_diff": rel,
                "first_grad_norm": m.grad_norm,
                "trained_tokens_reported": m.trained_tokens,
                "pad_fraction": m.pad_fraction,
                "microbatches": m.microbatches,
                "compile_counts": trainer.compile_counts,
                "gflops_achieved": result["model_gflop_per_step"] / s["median_s"],
                "torch_gflops": result["model_gflop_per_step"] / torch_s,
                "load_1m": load,
            }
            entry["fraction_of_best_matmul"] = entry["gflops_achieved"] / best_mm
            result["variants"][key] = entry
            print(f"{name} {key}: {entry['tokens_per_s']:.0f} tok/s vs torch "
                  f"{entry['torch_tokens_per_s']:.0f} ({entry['ratio_vs_torch']:.2f}x), first "
                  f"call {entry['first_call_s']:.1f} s, loss {m.loss:.6f} vs {torch_first:.6f} "
                  f"(rel {rel:.1e}), load {load:.1f}", flush=True)  # fmt: skip
        del trainers, cases, warm
        gc.collect()
    return result


def print_train(report: dict) -> None:
    mm = report["matmul"]
    print(f"\nfp32 matmul {mm['n']}^3 GFLOP/s: XLA {mm['xla']['gflops_median']:.1f}, torch "
          f"{mm['torch']['gflops_median']:.1f} (load {mm['load_1m']:.1f}); XLA host devices "
          f"{report['machine']['host_devices']}, torch threads "
          f"{report['machine']['torch_threads']}")  # fmt: skip
    print(
        "\n| model | variant | ours tok/s | torch tok/s | ours / torch | first call s | "
        "compile s | first loss ours / torch (rel) | GFLOP/s ours / torch | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in report.get("models", {}).items():
        for key, v in m["variants"].items():
            print(f"| {name} | {key} | {v['tokens_per_s']:.0f} | {v['torch_tokens_per_s']:.0f} | "
                  f"{v['ratio_vs_torch']:.2f}x | {v['first_call_s']:.1f} | {v['compile_s']:.1f} "
                  f"| {v['first_loss']:.5f} / {m['torch_first_loss']:.5f} "
                  f"({v['loss_rel_diff']:.1e}) | {v['gflops_achieved']:.1f} / "
                  f"{v['torch_gflops']:.1f} | {v['load_1m']:.1f} |")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 2. ahead-of-time compile of the 2B/4B train steps (runs in a child process per model and mesh)


def _memory_guard(limit_gib: float, out: Path, label: str) -> None:
    """Ends the process if its resident memory passes ``limit_gib`` (compiling a big graph can
    take the machine down with it)."""

    def watch():
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * page
            if rss > limit_gib * GIB:
                msg = f"{label}: resident memory {rss / GIB:.1f} GiB > {limit_gib} GiB; stopped"
                out.write_text(json.dumps({"error": msg}))
                print(msg, file=sys.stderr, flush=True)
                os._exit(4)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def _per_device_bytes(abstract_tree, shardings) -> int:
    import jax

    return int(sum(
        np.prod(s.shard_shape(a.shape), dtype=np.int64) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings), strict=True)
    ))  # fmt: skip


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    keys = ("argument", "output", "alias", "temp", "generated_code")
    out = {f"{k}_bytes": int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in keys}
    return out


def _collectives(compiled, top: int = 12) -> list[dict]:
    """The largest collectives of the compiled (per-device) program: op, result shape(s) (a
    combined collective has several), count, bytes of one."""
    import re
    from collections import Counter

    sizes = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2}
    ops = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    found = Counter(
        (result, op)
        for result, op in re.findall(
            rf"= (\([^=]*?\)|\w+\[[\d,]*\]\S*) ({ops})(?:-start)?\(", compiled.as_text()
        )
    )
    rows = []
    for (result, op), n in found.items():
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", result)
        size = sum(
            int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            * sizes.get(dtype, 4)
            for dtype, dims in shapes
        )
        shape = ", ".join(f"{dtype}[{dims}]" for dtype, dims in shapes)
        rows.append({"op": op, "shape": shape, "count": n, "bytes": size})
    return sorted(rows, key=lambda r: -r["bytes"] * r["count"])[:top]


def aot_child(spec: dict) -> dict:
    """Compile the accumulate and apply steps of one model on one mesh, without weights."""
    import resource

    import jax

    data, fsdp, tp = spec["mesh"]
    jax.config.update("jax_num_cpu_devices", data * fsdp * tp)
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from whale_jax.io.safetensors import abstract_model
    from whale_jax.models.config import ModelConfig
    from whale_jax.sharding import make_mesh
    from whale_jax.train.trainer import OptimConfig, TrainConfig, Trainer

    hf = dict(AOT_MODELS[spec["model"]])
    if spec["layers"]:
        hf["num_hidden_layers"] = spec["layers"]
    cfg = ModelConfig.from_hf(hf)
    mesh = make_mesh(data=data, fsdp=fsdp, tp=tp)
    S, T = spec["seqs"], spec["seq_len"]
    config = TrainConfig(
        optim=OptimConfig(), seq_len=T, micro_tokens=S * T, compute_dtype="bfloat16", remat=True
    )
    # The Trainer constructor copies real weights into fp32 masters and initialises AdamW; run
    # it under eval_shape on the abstract weights, so those copies are shapes only, and keep the
    # trainer it built (its jitted steps, shardings and optimizer are what we lower).
    graphdef, abstract_state = nnx.split(abstract_model(cfg, jnp.float32))
    built = {}

    def construct(state):
        built["trainer"] = Trainer(nnx.merge(graphdef, state), config, mesh)
        return built["trainer"].params, built["trainer"].opt_state

    t0 = time.perf_counter()
    params_shape, opt_shape = jax.eval_shape(construct, abstract_state)
    trainer = built["trainer"]

    def typed(tree, shardings):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )

    params = typed(params_shape, trainer.shardings)
    opt = typed(opt_shape, trainer.opt_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    batch = trainer._batch_sharding
    tokens = jax.ShapeDtypeStruct((S, T), jnp.int32, sharding=batch)
    # Loss positions: every one (the widest loss shape a step can have).
    weight = jax.ShapeDtypeStruct((S, T), jnp.float32, sharding=batch)
    out = {
        "num_params": cfg.num_params(),
        "num_layers": cfg.num_layers,
        "build_s": time.perf_counter() - t0,
        "param_bytes_per_device": _per_device_bytes(params_shape, trainer.shardings),
        "opt_bytes_per_device": _per_device_bytes(opt_shape, trainer.opt_shardings),
    }
    out["grad_acc_bytes_per_device"] = out["param_bytes_per_device"]
    for step, fn, call in (
        (
            "accumulate",
            trainer._accumulate,
            (params, params, scalar, tokens, tokens, tokens, weight),
        ),
        ("apply", trainer._apply, (params, opt, params, scalar, scalar)),
    ):
        t0 = time.perf_counter()
        lowered = fn.lower(*call)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        out[step] = {"lower_s": t1 - t0, "compile_s": t2 - t1, **_memory(compiled),
                     "largest_collectives": _collectives(compiled)}  # fmt: skip
        del compiled, lowered
        gc.collect()
    out["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    return out


def _peaks(r: dict) -> dict:
    """Bytes per device live during each step: its arguments, its new (not aliased) outputs and
    its temporaries, plus what stays resident outside it (AdamW state during accumulate)."""
    acc, app = r["accumulate"], r["apply"]
    acc_peak = r["opt_bytes_per_device"] + acc["argument_bytes"] + acc["output_bytes"]
    acc_peak += acc["temp_bytes"] - acc["alias_bytes"]
    app_peak = app["argument_bytes"] + app["output_bytes"] - app["alias_bytes"] + app["temp_bytes"]
    return {"accumulate_peak_bytes": acc_peak, "apply_peak_bytes": app_peak,
            "step_peak_bytes": max(acc_peak, app_peak),
            "state_bytes": r["param_bytes_per_device"] + r["opt_bytes_per_device"]}  # fmt: skip


def _extrapolate(small: dict, big: dict, layers: tuple[int, int], full: int) -> dict:
    """Bytes at ``full`` layers from compiles at two depths (linear in the layer count)."""
    (a, b), out = layers, json.loads(json.dumps(big))

    def line(x, y):
        return int(round(x + (y - x) * (full - a) / (b - a)))

    for k in ("param_bytes_per_device", "opt_bytes_per_device", "grad_acc_bytes_per_device"):
        out[k] = line(small[k], big[k])
    for step in ("accumulate", "apply"):
        for k, v in big[step].items():
            if k.endswith("_bytes"):
                out[step][k] = line(small[step][k], v)
    out["num_layers"] = full
    out["extrapolated_from_layers"] = list(layers)
    return out


def run_aot_child(spec: dict, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "aot.json"
        spec = dict(spec, out=str(out), mem_gib=args.aot_mem_gib)
        cmd = [sys.executable, __file__, "--_aot-child", json.dumps(spec)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=args.aot_timeout, capture_output=True, text=True)
            rc, tail = proc.returncode, (proc.stderr or "")[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = -1, f"timed out after {args.aot_timeout} s"
        wall = time.perf_counter() - t0
        result = json.loads(out.read_text()) if out.exists() else {}
    if rc != 0 or "error" in result:
        return {"error": result.get("error") or f"exit {rc}: {tail}", "wall_s": wall}
    return dict(result, wall_s=wall)


def bench_aot(args) -> dict:
    report = {"seqs": args.aot_seqs, "seq_len": args.aot_seq_len,
              "microbatch_tokens": args.aot_seqs * args.aot_seq_len,
              "episodes_per_step": args.episodes,
              "microbatches_per_step": -(-args.episodes // args.aot_seqs),
              "note": "microbatches_per_step assumes each episode packs into at most one "
                      "sequence; memory does not depend on it (one accumulate call at a time)",
              "compute_dtype": "bfloat16", "master_dtype": "float32", "remat": True,
              "bytes_are": "per device (the SPMD-partitioned program's buffers)",
              "runs": []}  # fmt: skip
    for name in args.aot_models:
        period = 4
        for mesh in args.aot_meshes:
            spec = {"model": name, "mesh": mesh, "seqs": args.aot_seqs,
                    "seq_len": args.aot_seq_len, "layers": args.aot_layers}  # fmt: skip
            label = f"{name} mesh data={mesh[0]} fsdp={mesh[1]} tp={mesh[2]}"
            print(f"aot {label} ...", flush=True)
            r = run_aot_child(spec, args)
            if "error" in r and not args.aot_layers:
                print(f"  full depth failed ({r['error'][:200]}); extrapolating from "
                      f"{period} and {2 * period} layers", flush=True)  # fmt: skip
                small = run_aot_child(dict(spec, layers=period), args)
                big = run_aot_child(dict(spec, layers=2 * period), args)
                if "error" in small or "error" in big:
                    r = {"error": r["error"], "reduced": [small, big]}
                else:
                    full = AOT_MODELS[name]["num_hidden_layers"]
                    r = dict(_extrapolate(small, big, (period, 2 * period), full),
                             full_depth_error=r["error"])  # fmt: skip
            entry = {"model": name, "mesh": dict(zip(("data", "fsdp", "tp"), mesh, strict=True)),
                     "config": AOT_MODELS[name], "config_source": AOT_SOURCES[name], **r}  # fmt: skip
            if "error" not in r:
                entry.update(_peaks(r))
                print(f"  {entry['num_layers']} layers: state {entry['state_bytes'] / GIB:.2f} "
                      f"GiB/device, accumulate temp {r['accumulate']['temp_bytes'] / GIB:.2f}, "
                      f"apply temp {r['apply']['temp_bytes'] / GIB:.2f}, step peak "
                      f"{entry['step_peak_bytes'] / GIB:.2f} GiB/device; compile "
                      f"{r['accumulate'].get('compile_s', 0):.0f}+"
                      f"{r['apply'].get('compile_s', 0):.0f} s, rss "
                      f"{r.get('max_rss_gib', 0):.1f} GiB", flush=True)  # fmt: skip
            else:
                print(f"  error: {r['error'][:500]}", flush=True)
            report["runs"].append(entry)
    return report


def print_aot(report: dict) -> None:
    print(f"\nAOT train step, {report['seqs']} x {report['seq_len']} tokens per microbatch, bf16 "
          "compute, fp32 masters, remat; GiB per device")  # fmt: skip
    print(
        "\n| model | mesh (data, fsdp, tp) | layers | params | AdamW | grad acc | "
        "accumulate temp | apply temp | step peak | compile s (acc + apply) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in report["runs"]:
        mesh = f"{e['mesh']['data']}, {e['mesh']['fsdp']}, {e['mesh']['tp']}"
        if "error" in e:
            print(f"| {e['model']} | {mesh} | error: {e['error'][:80]} |")
            continue
        layers = str(e["num_layers"]) + (" (extrapolated)" if "extrapolated_from_layers" in e
                                         else "")  # fmt: skip
        print(f"| {e['model']} | {mesh} | {layers} | {e['param_bytes_per_device'] / GIB:.2f} | "
              f"{e['opt_bytes_per_device'] / GIB:.2f} | "
              f"{e['grad_acc_bytes_per_device'] / GIB:.2f} | "
              f"{e['accumulate']['temp_bytes'] / GIB:.2f} | "
              f"{e['apply']['temp_bytes'] / GIB:.2f} | {e['step_peak_bytes'] / GIB:.2f} | "
              f"{e['accumulate'].get('compile_s', 0):.0f} + "
              f"{e['apply'].get('compile_s', 0):.0f} |")  # fmt: skip


# ------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _mesh(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.split("x"))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"mesh must be DATAxFSDPxTP, got {text!r}")
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["train", "aot"], action="append", help="repeatable")
    ap.add_argument("--models", default="qwen3_5_small,smollm2")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--row-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="both sides; 0: no clip")
    ap.add_argument("--devices", default="1,2", help="our mesh sizes (capped at host devices)")
    ap.add_argument("--remat", default="0,1", help="our remat settings to run (0, 1)")
    ap.add_argument(
        "--cpus",
        type=int,
        default=0,
        help="pin the process to this many CPUs before JAX and torch start (0: all); with 1,"
        " both run single-threaded (as bench_model.py --cpus)",
    )
    ap.add_argument(
        "--host_devices",
        type=int,
        default=0,
        help="XLA CPU devices for the train part (0: one per CPU the process may use)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "train.json")
    ap.add_argument("--aot-out", type=Path, default=RESULTS / "train_aot.json")
    ap.add_argument("--aot-models", default="qwen3_5_2b,qwen3_5_4b")
    ap.add_argument(
        "--aot-meshes", default="1x8x1,1x4x2", help="comma-separated DATAxFSDPxTP meshes"
    )
    ap.add_argument("--aot-seqs", type=int, default=16, help="sequences per microbatch")
    ap.add_argument("--aot-seq-len", type=int, default=2048)
    ap.add_argument("--episodes", type=int, default=64, help="episodes per optimizer step")
    ap.add_argument("--aot-layers", type=int, default=0, help="0: the real depth")
    ap.add_argument("--aot-mem-gib", type=float, default=15.0)
    ap.add_argument("--aot-timeout", type=float, default=600.0)
    ap.add_argument("--watchdog", type=float, default=900.0, help="seconds per timed call")
    ap.add_argument("--_aot-child", dest="aot_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.aot_child is not None:
        spec = json.loads(args.aot_child)
        out = Path(spec["out"])
        _memory_guard(spec["mem_gib"], out, spec["model"])
        out.write_text(json.dumps(aot_child(spec)))
        return 0

    use_cpus(args.cpus, args.host_devices)
    sections = set(args.only or ["train", "aot"])
    args.devices, args.remat = _ints(args.devices), _ints(args.remat)
    args.aot_models = [m for m in args.aot_models.split(",") if m]
    args.aot_meshes = [_mesh(m) for m in args.aot_meshes.split(",") if m]
    machine = machine_info()
    print(f"{machine['cpu_model']}  {machine['cpu_count']} cores  jax {machine['jax']} "
          f"({machine['host_devices']} host devices)  torch {machine['torch']} "
          f"({machine['torch_threads']} threads)  load {machine['load_avg_start']}",
          flush=True)  # fmt: skip
    # Paths as the user gave them relative to the repository (no machine paths in results).
    arg_record = {
        k: (os.path.relpath(v, REPO) if isinstance(v, Path) else v) for k, v in vars(args).items()
    }
    status = 0
    if "train" in sections:
        report = {"machine": machine, "args": arg_record,
                  "timing": "median wall time of a whole step over round-robin repeats after "
                            "one warm-up step per case", "models": {}}  # fmt: skip
        WATCHDOG.limit_s, WATCHDOG.results, WATCHDOG.out = args.watchdog, report, args.out
        report["matmul"] = bench_matmul(1024, 5)
        for name in [m for m in args.models.split(",") if m]:
            with tempfile.TemporaryDirectory() as tmp:
                report["models"][name] = bench_train_model(name, args, Path(tmp), report["matmul"])
            save_results(report, args.out)  # after each model: partial runs keep data
            gc.collect()
        bad = [(n, k, v["loss_rel_diff"]) for n, m in report["models"].items()
               for k, v in m["variants"].items() if not v["loss_rel_diff"] <= 1e-3]  # fmt: skip
        report["loss_agreement_ok"] = not bad
        report["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        save_results(report, args.out)
        print_train(report)
        print(f"wrote {os.path.relpath(args.out)}")
        if bad:
            print(f"\nFAIL: first-step loss differs from torch by more than 1e-3: {bad}",
                  file=sys.stderr, flush=True)  # fmt: skip
            status = 1
    if "aot" in sections:
        t0 = time.perf_counter()
        aot = {"machine": machine, "args": arg_record, **bench_aot(args)}
        aot["total_s"] = time.perf_counter() - t0
        save_results(aot, args.aot_out)
        print_aot(aot)
        print(f"wrote {os.path.relpath(args.aot_out)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
