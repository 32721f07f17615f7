"""Blocked causal self-attention and the unrolled (per-group weights) decode path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conftest import (
    EPS32,
    EPS_BF16,
    PATHS_REL,
    assert_close_to_scale,
    assert_trees_close_to_scale,
)
from whale_jax import load_model
from whale_jax.models import layers
from whale_jax.models.layers import causal_attention
from whale_jax.models.transformer import split_groups


def dense_reference(q, k, v, valid):
    """Full [T, T] softmax attention in numpy (float64), kv heads repeated to the query heads."""
    q, k, v, valid = (
        np.asarray(x, np.float64 if x.dtype != bool else bool) for x in (q, k, v, valid)
    )
    T, H, K = q.shape[1:]
    rep = H // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    idx = np.arange(T)
    allowed = ((idx[:, None] >= idx[None, :]) & valid[:, None, :]) | (idx[:, None] == idx[None, :])
    scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(K)
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", probs, v)


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
    # fp32 against exact (float64) arithmetic on the same inputs: the softmax sums over up to T
    # keys round by at most ~T * eps of the largest value (measured ~1.5 eps); a key wrongly masked
    # or let through moves some outputs by more than 1e-3 of it, even at T = 700.
    assert_close_to_scale(out, dense_reference(q, k, v, valid), EPS32 * T)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_query_attention_equals_reference(dtype):
    """A decode step's attention (one query per row: element-wise form) against numpy, over a
    [B, N, S, K] cache with per-row lengths, a hole, and an idle row that may see nothing (it
    must stay finite: the mean of the values)."""
    r = np.random.default_rng(3)
    B, H, N, S, K = 4, 6, 2, 37, 16
    q = r.normal(size=(B, 1, H, K)).astype(np.float32)
    k = r.normal(size=(B, N, S, K)).astype(np.float32)
    v = r.normal(size=(B, N, S, K)).astype(np.float32)
    allowed = np.arange(S)[None, None, :] < np.array([37, 5, 20, 0])[:, None, None]
    allowed[2, 0, 3:9] = False
    q_d, k_d, v_d = (jnp.asarray(x, dtype) for x in (q, k, v))
    out = layers.attend(q_d, k_d, v_d, jnp.asarray(allowed))
    assert out.dtype == dtype and out.shape == (B, 1, H, K)
    out = np.asarray(out, np.float64)
    q, k, v = (np.asarray(jnp.asarray(x, np.float32), np.float64) for x in (q_d, k_d, v_d))
    kh, vh = np.repeat(k, H // N, axis=1), np.repeat(v, H // N, axis=1)  # [B, H, S, K]
    scores = np.einsum("bhk,bhsk->bhs", q[:, 0], kh) / np.sqrt(K)
    scores = np.where(allowed, scores, -np.inf)
    scores[3] = 0.0  # nothing visible: uniform weights
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    ref = np.einsum("bhs,bhsk->bhk", probs / probs.sum(-1, keepdims=True), vh)[:, None]
    # fp32: sums over S keys, at most ~S * eps of the largest value (measured ~0.7 eps). bf16: the
    # inputs are rounded alike on both sides; the output's rounding to bf16 (eps / 2 of each value)
    # dominates (measured 0.2 eps), so 2 eps.
    rel = EPS32 * S if dtype == jnp.float32 else 2 * EPS_BF16
    assert_close_to_scale(out, ref, rel)
    assert np.isfinite(out).all()


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
    assert_close_to_scale(full_many, full_one, PATHS_REL)
    assert_close_to_scale(pre_many, pre_one, PATHS_REL)
    for b, n in enumerate(lengths):  # the fresh prefill equals the forward on each row's tokens
        assert_close_to_scale(pre_many[b, :n], full_one[b, :n], PATHS_REL)
    assert_trees_close_to_scale(cache_many, cache_one, PATHS_REL)


def test_unrolled_groups_equal_the_scan(fixtures_dir):
    model = load_model(fixtures_dir / "tiny_qwen3_5").model
    groups = split_groups(nnx.state(model.blocks))
    assert len(groups) == model.cfg.num_groups
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 320, (2, 40)), jnp.int32)
    n = jnp.asarray([40, 23], jnp.int32)

    kv = tuple(kind == "full_attention" for kind in model.cfg.layer_types[: model.cfg.period])

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def run(groups, per_group=False, kv_window=None, poison=False):
        logits_a, cache = model.prefill(tokens[:, :30], jnp.minimum(n, 30), max_len=64)
        rest = jnp.maximum(n - 30, 0)
        if poison:  # NaN keys and values past the window: read, they would reach the logits
            layers_ = tuple(
                tuple(x.at[..., 48:, :].set(jnp.nan) for x in pair) if is_kv else pair
                for is_kv, pair in zip(kv, cache.layers, strict=True)
            )
            cache = cache.replace(layers=layers_)
        if per_group == "all":  # each layer's cache arrays on their own
            cache = cache.per_group()
            assert cache.capacity == 64 and isinstance(cache.layers[0][0], tuple)
        elif per_group == "gdn":  # as the engine's decode loop: GDN split, KV stacks whole
            cache = cache.per_group(tuple(not k for k in kv))
            assert cache.capacity == 64
        logits_b, cache = model.extend(
            cache, tokens[:, 30:], rest, groups=groups, kv_window=kv_window
        )
        return logits_a, logits_b, cache.stacked() if per_group else cache

    scanned, unrolled = run(None), run(groups)
    assert_trees_close_to_scale(unrolled, scanned, PATHS_REL)
    separate = run(groups, "all")
    assert_trees_close_to_scale(separate, scanned, PATHS_REL)
    # The decode loop's form: attention reads a window bounding every row (40 <= 48) of a cache
    # that keeps its capacity; positions past the window are never read.
    for groups_, split in ((None, False), (groups, "gdn")):
        windowed = run(groups_, split, 48, True)
        assert_trees_close_to_scale(windowed[:2], scanned[:2], PATHS_REL)
        assert windowed[2].capacity == 64
        read_all = run(groups_, split, None, True)
        assert not np.isfinite(np.asarray(read_all[1])).all()
    _, cache = model.prefill(tokens, n, max_len=64)
    with pytest.raises(ValueError, match="per-group cache"):
        model.extend(cache.per_group(), tokens[:, :1], jnp.ones((2,), jnp.int32))
