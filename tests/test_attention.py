"""Blocked causal self-attention and the unrolled (per-group weights) decode path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from whale_jax import load_model
from whale_jax.models import layers
from whale_jax.models.layers import attend, causal_attention
from whale_jax.models.transformer import split_groups


def dense_reference(q, k, v, valid):
    T = q.shape[1]
    idx = jnp.arange(T)
    allowed = ((idx[:, None] >= idx[None, :]) & valid[:, None, :]) | (idx[:, None] == idx[None, :])
    return attend(q, k, v, allowed)


@pytest.mark.parametrize("T,block", [(150, 32), (150, 256), (700, 16)])
def test_blocked_causal_attention_equals_dense(T, block):
    r = np.random.default_rng(T)
    B, H, N, K = 2, 6, 2, 16
    q = jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, T, N, K)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, T, N, K)), jnp.float32)
    valid = np.ones((B, T), bool)
    valid[0, :11] = False  # left padding
    valid[1, 40:47] = False  # a hole in the middle
    valid[1, T - 5 :] = False  # right padding
    valid = jnp.asarray(valid)
    out = causal_attention(q, k, v, valid, block=block)
    np.testing.assert_allclose(out, dense_reference(q, k, v, valid), atol=2e-6)


def test_model_forward_and_prefill_with_small_blocks(fixtures_dir, monkeypatch):
    """Many query blocks (16-token blocks over 90 tokens) give the same logits as one block, in
    the no-cache forward and in a fresh prefill (which attends among the new tokens only)."""
    model = load_model(fixtures_dir / "tiny_qwen3_5").model
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 320, (2, 90)), jnp.int32)
    lengths = jnp.asarray([90, 61], jnp.int32)
    valid = jnp.arange(90)[None] < lengths[:, None]

    def run():
        full = jax.jit(lambda t, m: model(t, m))(tokens, valid)
        pre, cache = jax.jit(lambda t, n: model.prefill(t, n, max_len=96))(tokens, lengths)
        return full, pre, cache

    monkeypatch.setattr(layers, "ATTENTION_BLOCK", 10_000)
    full_one, pre_one, cache_one = run()
    monkeypatch.setattr(layers, "ATTENTION_BLOCK", 16)
    full_many, pre_many, cache_many = run()
    np.testing.assert_allclose(full_many, full_one, atol=1e-5)
    np.testing.assert_allclose(pre_many, pre_one, atol=1e-5)
    for b, n in enumerate(lengths):  # the fresh prefill equals the forward on each row's tokens
        np.testing.assert_allclose(pre_many[b, :n], full_one[b, :n], atol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), cache_many, cache_one)


def test_unrolled_groups_equal_the_scan(fixtures_dir):
    model = load_model(fixtures_dir / "tiny_qwen3_5").model
    groups = split_groups(nnx.state(model.blocks))
    assert len(groups) == model.cfg.num_groups
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 320, (2, 40)), jnp.int32)
    n = jnp.asarray([40, 23], jnp.int32)

    @functools.partial(jax.jit, static_argnums=1)
    def run(groups, per_group=False):
        logits_a, cache = model.prefill(tokens[:, :30], jnp.minimum(n, 30), max_len=64)
        rest = jnp.maximum(n - 30, 0)
        if per_group:  # each layer's cache arrays on their own, as the engine's decode loop has
            cache = cache.per_group()
            assert cache.capacity == 64 and isinstance(cache.layers[0][0], tuple)
        logits_b, cache = model.extend(cache, tokens[:, 30:], rest, groups=groups)
        return logits_a, logits_b, cache.stacked() if per_group else cache

    scanned, unrolled = run(None), run(groups)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), unrolled, scanned)
    separate = run(groups, True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), separate, scanned)
    _, cache = model.prefill(tokens, n, max_len=64)
    with pytest.raises(ValueError, match="per-group cache"):
        model.extend(cache.per_group(), tokens[:, :1], jnp.ones((2,), jnp.int32))
