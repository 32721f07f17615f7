"""The gated delta rule and the cached forward: forms agree, pads are inert, causality holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import PATHS_REL, assert_close_to_scale
from whale_jax import load_model
from whale_jax.models.gated_delta import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)
from whale_jax.models.transformer import Jitted


def random_inputs(B=2, T=150, Hk=2, Hv=4, K=16, V=8, seed=0):
    r = np.random.default_rng(seed)

    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q = unit(r.normal(size=(B, T, Hk, K)))
    k = unit(r.normal(size=(B, T, Hk, K)))
    v = r.normal(size=(B, T, Hv, V)).astype(np.float32)
    g = (-np.abs(r.normal(size=(B, T, Hv))) * 0.3).astype(np.float32)
    beta = r.uniform(size=(B, T, Hv)).astype(np.float32)
    state = r.normal(size=(B, Hv, K, V)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 63, 64, 150])
def test_chunked_equals_recurrence(T):
    q, k, v, g, beta, state = random_inputs(T=T)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64)
    assert_close_to_scale(out_c, out_r, PATHS_REL, "out")
    assert_close_to_scale(s_c, s_r, PATHS_REL, "state")


def test_chunks_compose_through_the_state():
    q, k, v, g, beta, state = random_inputs(T=130)
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    out_a, mid = gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state)
    out_b, end = gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    assert_close_to_scale(np.concatenate([out_a, out_b], 1), out, PATHS_REL, "out")
    assert_close_to_scale(end, final, PATHS_REL, "state")


def test_noop_tokens_leave_state_untouched():
    q, k, v, g, beta, state = random_inputs(T=20)
    zero = np.zeros_like
    _, s = chunked_gated_delta_rule(q, zero(k), zero(v), zero(g), zero(beta), state)
    # Exact by construction: g = 0 makes every decay exp(0) = 1, and k = v = beta = 0 make every
    # added term an exact zero.
    np.testing.assert_array_equal(s, state)


def test_strong_decay_does_not_overflow():
    # Cumulative log-decays of -1e4 inside one chunk: exp(G_i - G_j) above the diagonal would be
    # inf without masking first.
    q, k, v, g, beta, state = random_inputs(T=64)
    g = np.full_like(g, -200.0)
    out, s = chunked_gated_delta_rule(q, k, v, g, beta, state)
    assert np.isfinite(out).all() and np.isfinite(s).all()
    out_r, _ = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert_close_to_scale(out, out_r, PATHS_REL)


def test_bf16_inputs_keep_fp32_state():
    q, k, v, g, beta, state = random_inputs(T=70)
    to16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    out, s = chunked_gated_delta_rule(to16(q), to16(k), to16(v), g, beta, state)
    assert out.dtype == jnp.bfloat16 and s.dtype == jnp.float32


# -- the model's cached paths --------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(fixtures_dir):
    # The parity fixture: every weight perturbed, mixed layer types, grouped value heads.
    return Jitted(load_model(fixtures_dir / "tiny_qwen3_5").model)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 320, (3, 90)), jnp.int32)


def test_prefill_then_continue_equals_full_forward(model, tokens):
    full = model(tokens)
    T, k = tokens.shape[1], 7
    logits_a, cache = model.prefill(tokens[:, : T - k], jnp.full((3,), T - k), max_len=128)
    logits_b, cache = model.extend(cache, tokens[:, T - k :], jnp.full((3,), k))
    assert_close_to_scale(np.concatenate([logits_a, logits_b], 1), full, PATHS_REL)
    assert list(cache.lengths) == [T] * 3


def test_prefill_then_single_steps_equals_full_forward(model, tokens):
    full = model(tokens)
    T, k = tokens.shape[1], 5
    _, cache = model.prefill(tokens[:, : T - k], jnp.full((3,), T - k), max_len=128)
    for t in range(T - k, T):
        step, cache = model.extend(cache, tokens[:, t : t + 1], jnp.ones((3,), jnp.int32))
        assert_close_to_scale(step[:, 0], full[:, t], PATHS_REL)


def test_rows_continue_by_their_own_counts(model, tokens):
    """Row b holds lengths[b] tokens and appends n_new[b]; each row matches its own forward."""
    lengths = np.array([10, 40, 73])
    n_new = np.array([5, 0, 9])
    padded = np.zeros((3, 80), np.int32)
    for b in range(3):
        padded[b, : lengths[b]] = tokens[b, : lengths[b]]
    _, cache = model.prefill(jnp.asarray(padded), jnp.asarray(lengths), max_len=128)
    new = np.zeros((3, 9), np.int32)
    for b in range(3):
        new[b, : n_new[b]] = tokens[b, lengths[b] : lengths[b] + n_new[b]]
    logits, cache = model.extend(cache, jnp.asarray(new), jnp.asarray(n_new), last_only=True)
    np.testing.assert_array_equal(cache.lengths, lengths + n_new)
    # Reference: each row's own sequence, right-padded, through the no-cache forward.
    total = lengths + n_new
    full = model(tokens, jnp.arange(90)[None] < jnp.asarray(total)[:, None])
    for b in range(3):
        if n_new[b]:
            assert_close_to_scale(logits[b], full[b, total[b] - 1], PATHS_REL)
    # The idle row's recurrent state is unchanged by a zero-token extend: exactly, as its pads have
    # g = 0 (decay exp(0) = 1) and k = v = beta = 0 (exact zero updates), and its conv window is
    # gathered back unchanged.
    _, cache0 = model.prefill(jnp.asarray(padded), jnp.asarray(lengths), max_len=128)
    leaves = zip(jax.tree.leaves(cache0.layers), jax.tree.leaves(cache.layers), strict=True)
    for before, after in leaves:
        np.testing.assert_array_equal(before[:, 1], after[:, 1])


def test_left_padding_changes_nothing(model, tokens):
    ref = model(tokens)
    pads = [13, 0, 29]  # junk pad ids: anything leaking through would show
    padded = jnp.stack(
        [
            jnp.concatenate([jnp.full((p,), 7, jnp.int32), tokens[b, : 90 - p]])
            for b, p in enumerate(pads)
        ]
    )
    valid = jnp.arange(90)[None] >= jnp.asarray(pads)[:, None]
    out = model(padded, valid)
    for b, p in enumerate(pads):
        assert_close_to_scale(out[b, p:], ref[b, : 90 - p], PATHS_REL)


def test_causal_gradient_of_logits_wrt_later_inputs_is_zero(model, tokens):
    """d logits[t] / d embedding[s] == 0 for s > t (inputs enter as embeddings to differentiate)."""
    t, net = 20, model.model
    x = jnp.take(net.embed[...], tokens[:1, :40], axis=0)

    def logit_at_t(x_BTD):
        positions = jnp.arange(40)[None]
        valid = jnp.ones((1, 40), bool)
        h, _ = net._layers(x_BTD, positions, valid, None)
        return net.logits(h)[0, t].sum()

    grad = jax.jit(jax.grad(logit_at_t))(x)
    # Exactly zero, not small: a later token's path to logits[t] is cut by masks (where / -inf), so
    # its gradient is a structural zero.
    assert float(jnp.abs(grad[0, t + 1 :]).max()) == 0.0
    assert float(jnp.abs(grad[0, : t + 1]).max()) > 0.0


def test_training_8k_tokens_of_2b_config_does_not_store_chunk_intermediates():
    """Compile (no run) the gradient of a 2B-sized GDN layer's delta rule at T=8192: with each
    chunk rematerialised the temp memory is far below storing every chunk's intermediates."""
    B, T, H, K, V = 1, 8192, 16, 128, 128
    spec = jax.ShapeDtypeStruct
    args = (
        spec((B, T, H, K), jnp.bfloat16),
        spec((B, T, H, K), jnp.bfloat16),
        spec((B, T, H, V), jnp.bfloat16),
        spec((B, T, H), jnp.float32),
        spec((B, T, H), jnp.float32),
    )

    def temp_bytes(remat):
        def loss(q, k, v, g, beta):
            out, _ = chunked_gated_delta_rule(q, k, v, g, beta, remat=remat)
            return out.astype(jnp.float32).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        stats = grad.lower(*args).compile().memory_analysis()
        if stats is None:
            pytest.skip("this backend reports no memory analysis")
        return stats.temp_size_in_bytes

    with_remat, without = temp_bytes(True), temp_bytes(False)
    assert with_remat < 0.7 * without, (with_remat, without)
    assert with_remat < 1 << 30  # ~0.6 GiB here: per-chunk states plus fp32 copies of q, k, v
