"""The engine's decode program for Qwen3.5-2B/4B, compiled ahead of time (no weights, no device
memory) at the slot counts one device holds, and XLA's memory analysis of it: the arguments (the
bf16 weights and the decode state), what the output aliases (the donated state) and the
temporaries. No peer: the memory of our own compiled program, for docs/engine.md's per-device
layouts.

    python benchmarks/engine_aot.py            # ~30 s on a CPU

XLA:CPU keeps many bf16 operations in f32, so its temporaries bound what an accelerator's compile
of the same program needs rather than equal it.
"""

from __future__ import annotations

import argparse
import time

from common import RESULTS, machine_info, save_results

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
ARGS.add_argument("--cases", nargs="+", default=["qwen3_5_2b:8", "qwen3_5_2b:32", "qwen3_5_4b:8",
                                                 "qwen3_5_4b:16"])  # fmt: skip
ARGS.add_argument("--max_len", type=int, default=10240)
ARGS.add_argument("--out", default=str(RESULTS / "engine_aot.json"))


def analyse(name: str, slots: int, max_len: int) -> dict:
    import jax
    import jax.numpy as jnp
    from bench_train import AOT_MODELS
    from flax import nnx

    from whale_jax.engine import device as dev
    from whale_jax.engine.sampling import SlotSampling
    from whale_jax.io.safetensors import abstract_model
    from whale_jax.models.config import ModelConfig

    cfg = ModelConfig.from_hf(AOT_MODELS[name])
    graphdef, params = nnx.split(abstract_model(cfg, jnp.bfloat16))
    kv = dev._is_kv(cfg.layer_types[: cfg.period])

    def empty_state():  # as DeviceEngine.empty_state, shapes only
        model = nnx.merge(graphdef, params)
        return dev.DecodeState(
            cache=model.init_cache(slots, max_len),
            logits=jnp.zeros((slots, cfg.vocab_size), jnp.float32),
            count=jnp.zeros((slots,), jnp.int32),
            max_new=jnp.zeros((slots,), jnp.int32),
            active=jnp.zeros((slots,), bool),
            stop_ids=jnp.full((slots, 8), -1, jnp.int32),
            sampling=SlotSampling.zeros(slots),
        )

    state = jax.eval_shape(empty_state)
    occupied = jax.ShapeDtypeStruct((slots,), bool)
    min_active = jax.ShapeDtypeStruct((), jnp.int32)
    t0 = time.monotonic()
    # The accelerator's program: layers scanned, 8 decode steps per call, the whole KV window.
    compiled = dev._generate.lower(graphdef, kv, 8, 64, max_len, params, None, state, occupied,
                                   min_active).compile()  # fmt: skip
    m = compiled.memory_analysis()
    gib = 2**30
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return {
        "model": name, "slots": slots, "max_len": max_len, "params": cfg.num_params(),
        "compile_s": round(time.monotonic() - t0, 1),
        "weights_gib": round(weights / gib, 2), "state_gib": round(state_bytes / gib, 2),
        "argument_gib": round(m.argument_size_in_bytes / gib, 2),
        "output_gib": round(m.output_size_in_bytes / gib, 2),
        "alias_gib": round(m.alias_size_in_bytes / gib, 2),
        "temp_gib": round(m.temp_size_in_bytes / gib, 2),
        "peak_gib": round((m.argument_size_in_bytes + m.output_size_in_bytes
                           - m.alias_size_in_bytes + m.temp_size_in_bytes) / gib, 2),
    }  # fmt: skip


def main() -> None:
    a = ARGS.parse_args()
    rows = []
    for case in a.cases:
        name, slots = case.split(":")
        row = analyse(name, int(slots), a.max_len)
        rows.append(row)
        print(f"{row['model']:12s} {row['slots']:4d} slots x {row['max_len']}: weights "
              f"{row['weights_gib']:.2f} + state {row['state_gib']:.2f} GiB, temporaries "
              f"{row['temp_gib']:.2f} GiB, peak {row['peak_gib']:.2f} GiB "
              f"(compiled in {row['compile_s']} s)", flush=True)  # fmt: skip
    save_results({"benchmark": "engine decode program, ahead-of-time memory", "machine":
                  machine_info(), "rows": rows}, a.out)  # fmt: skip
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
