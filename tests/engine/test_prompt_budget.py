"""What the engine's calls may take: decode steps and prefill rows by backend (``resolve``), the
memory estimate of a prefill or resume call against XLA's own count, and admission that splits
a batch whose call would not fit ``prompt_bytes`` (same tokens, smaller calls)."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import pytest

from tests.engine.test_engine import greedy, prompts_for
from whale_jax.engine import Engine, EngineConfig, Request
from whale_jax.engine import device as dev
from whale_jax.engine import engine as engine_module
from whale_jax.io.load import random_model
from whale_jax.models.config import ModelConfig, tiny_qwen3_5_hf


def test_steps_and_prefill_rows_come_from_the_backend_unless_given():
    cpu = engine_module.resolve(EngineConfig(), "cpu")
    assert (cpu.steps, cpu.prefill_batch) == (8, 8)
    for backend in ("gpu", "tpu", "rocm"):  # every accelerator: the accelerators' defaults
        acc = engine_module.resolve(EngineConfig(), backend)
        assert (acc.steps, acc.prefill_batch) == (16, 64)
    given = engine_module.resolve(EngineConfig(steps=3, prefill_batch=5), "gpu")
    assert (given.steps, given.prefill_batch) == (3, 5)
    assert given.prompt_bytes is None  # the engine sets it, knowing the memory left
    for bad in ({"steps": 0}, {"prefill_batch": 0}, {"prompt_bytes": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            engine_module.resolve(EngineConfig(**bad), "cpu")


# A dense model shaped like SmolLM2-135M but 4 layers deep, and a hybrid Qwen3.5-style model with
# an output gate and GDN value heads grouped over key heads: the estimate's two layer kinds.
DENSE = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 576, "intermediate_size": 1536,
         "num_hidden_layers": 4, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e5, "tie_word_embeddings": True}  # fmt: skip
HYBRID = tiny_qwen3_5_hf(vocab_size=2048, hidden_size=256, intermediate_size=512,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                         linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                         linear_value_head_dim=32, attn_output_gate=True)  # fmt: skip
SHAPES = [(1, 16, 16), (8, 64, 64), (2, 1024, 1024), (8, 16, 512), (4, 128, 1024)]  # rows, new, KV


@pytest.mark.parametrize("moves", ["loop", "scatter"])
@pytest.mark.parametrize("hf", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_the_call_estimate_bounds_what_xla_allocates(hf, moves):
    """XLA's memory analysis of the engine's compiled prefill (new == window) and resume calls,
    which keep and insert their rows in the same call: what they allocate beyond their donated
    state and store (temporaries; outputs not aliased to an input) stays under
    ``prompt_call_bytes``, with the scatter moves' gathers (the accelerators') counted, and the
    estimate is not so loose that it would split calls for nothing (under 4x: the CPU measured
    1.3-2.6x)."""
    cfg = ModelConfig.from_hf(hf)
    slots = 16
    engine = dev.DeviceEngine(random_model(cfg, seed=0), slots=slots, max_len=1024, cache_rows=8,
                              row_moves=moves)  # fmt: skip
    for P, T, window in SHAPES:
        resume = window != T
        signature = ((P, T), window) if resume else ((P, T),)
        analysis = engine.compile_ahead("resume" if resume else "prefill", signature)
        analysis = analysis.memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        xla = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
               - analysis.alias_size_in_bytes)  # fmt: skip
        moved = 0 if moves == "loop" else P + slots
        estimate = dev.prompt_call_bytes(cfg, P, T, window, jnp.float32, resume=resume,
                                         moved=moved)  # fmt: skip
        assert xla <= estimate < 4 * xla, (P, T, window, xla, estimate)


CONFIG = EngineConfig(slots=16, max_len=128, steps=4, prefill_batch=8, min_kv_bucket=32,
                      min_kept_tokens=0, cache_rows=32, prefix_cache=False)  # fmt: skip


def budgeted(model, **options):
    return Engine(model, dataclasses.replace(CONFIG, **options), eos_ids=())


def test_admission_splits_a_call_that_would_not_fit(tiny_llama):
    """A budget that fits 8 rows of 16 tokens but 2 of 64: the short prompts go in one call, the
    long ones in calls of 2, and every call the engine met lies inside its shape space. The
    tokens are those of an engine whose calls all fit."""
    model, cfg, _ = tiny_llama
    prompts = prompts_for(cfg.vocab_size, seed=7,
                          lengths=(5, 9, 12, 14, 7, 3, 10, 16, 40, 50, 60, 45, 55, 63))  # fmt: skip
    requests = [Request(prompt_ids=p, sampling=greedy(3)) for p in prompts]
    with budgeted(model, prompt_bytes=1 << 40) as free:
        want = [c.token_ids for c in free.generate(requests)]
        assert max(P for ((P, T),) in free.device.signatures["prefill"] if T == 64) > 2
        fits = lambda P, T: free._call_bytes(P, T, T, False)  # noqa: E731
    budget = max(fits(8, 16), fits(2, 64))
    assert fits(4, 64) > budget, "the model's numbers no longer give this test its split"
    with budgeted(model, prompt_bytes=budget) as engine:
        assert engine._rows_fit(16, 16, False) == 8 and engine._rows_fit(64, 64, False) == 2
        got = [c.token_ids for c in engine.generate(requests)]
        met = engine.device.signatures
        calls = {sig for (sig,) in met["prefill"]}
        assert got == want
        assert all(P <= engine._rows_fit(T, T, False) for P, T in calls), calls
        assert (8, 16) in calls and max(P for P, T in calls if T == 64) == 2
        space = engine.shape_space()
        for name, sigs in met.items():
            assert sigs <= space[name], name
        assert all(P <= engine._rows_fit(T, T, False) for ((P, T),) in space["prefill"])
        assert all(P <= engine._rows_fit(T, n, True) for ((P, T), n) in space["resume"])


def test_the_budget_defaults_to_a_share_of_free_memory(tiny_llama, monkeypatch, caplog):
    model, _, _ = tiny_llama
    monkeypatch.setattr(engine_module, "free_device_bytes", lambda *a: 3 << 30)
    with budgeted(model) as engine:
        assert engine.config.prompt_bytes == int(engine_module.PROMPT_SHARE * (3 << 30))
        assert engine.config.steps == 4 and engine.config.prefill_batch == 8
    monkeypatch.setattr(engine_module, "free_device_bytes", lambda *a: None)
    with budgeted(model) as engine:  # no figure: room for the biggest call allowed
        assert engine._rows_fit(128, 128, True) == 8
    # A budget under one prompt of max_len is said at the start (it may not fit the device).
    with caplog.at_level(logging.WARNING, logger="whale_jax.engine.engine"):
        budgeted(model, prompt_bytes=1024).close()
    assert "lower max_len" in caplog.text
