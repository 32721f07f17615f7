"""Our logits against transformers' PyTorch implementation (committed golden fixtures + live)."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

import whale_jax

MODELS = ["tiny_qwen3_5", "tiny_llama", "tiny_qwen3"]


def max_rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_golden_fixture(fixtures_dir, name):
    model, _, _ = whale_jax.load_model(fixtures_dir / name)
    ref = np.load(fixtures_dir / name / "reference.npz")
    ours = np.asarray(model(jnp.asarray(ref["input_ids"])))
    assert ours.shape == ref["logits"].shape
    assert max_rel_err(ours, ref["logits"]) <= 1e-4


def test_left_padded_logits_match_golden_fixture(fixtures_dir):
    model, _, _ = whale_jax.load_model(fixtures_dir / "tiny_qwen3_5")
    ref = np.load(fixtures_dir / "tiny_qwen3_5" / "reference_padded.npz")
    mask = ref["attention_mask"].astype(bool)
    ours = np.asarray(model(jnp.asarray(ref["input_ids"]), jnp.asarray(mask)))
    assert np.isfinite(ours).all()
    assert max_rel_err(ours[mask], ref["logits"][mask]) <= 1e-4


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_live_transformers(tmp_path, name):
    from tests.oracle import make_fixtures

    out = make_fixtures.write(name, tmp_path)
    model, _, _ = whale_jax.load_model(out)
    ref = np.load(out / "reference.npz")
    ours = np.asarray(model(jnp.asarray(ref["input_ids"])))
    assert max_rel_err(ours, ref["logits"]) <= 1e-4
