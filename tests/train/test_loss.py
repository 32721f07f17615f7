"""The RSFT loss: token-mean NLL over trained tokens, logits a chunk at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import whale_jax
from whale_jax.train.loss import nll_from_hidden, nll_sum
from whale_jax.train.packing import pick_predictions, pick_width, trained_predictions


@pytest.fixture(scope="module")
def tiny(fixtures_dir):
    return whale_jax.load_model(fixtures_dir / "tiny_qwen3_5")


def batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (2, 11)).astype(np.int32)
    # Row 0: two packed sequences (6 + 4 tokens) and a pad; row 1: one sequence.
    segments = np.array([[1] * 6 + [2] * 4 + [0], [1] * 11], np.int32)
    mask = np.zeros((2, 11), bool)
    mask[0, [3, 4, 5, 6, 8, 9, 10]] = True  # 6: first token of segment 2, 10: a pad
    mask[1, 5:] = True
    return tokens, segments, mask


def test_loss_equals_a_hand_computation(tiny):
    model, cfg, _ = tiny
    tokens, segments, mask = batch(cfg.vocab_size)
    pred = trained_predictions(segments, mask)
    pick, weight = pick_predictions(pred, segments.shape[1])  # all 11 positions
    total, count = nll_sum(model, tokens, segments, pick, weight, chunk=4)  # 4 + 4 + 3: ragged
    # By hand: each sequence alone through the plain forward, log-softmax, the next token's entry.
    expected, n = 0.0, 0
    for b in range(2):
        for s in np.unique(segments[b][segments[b] > 0]):
            where = np.where(segments[b] == s)[0]
            ids = tokens[b, where]
            logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids[None]))[0], axis=-1))
            for i in range(len(where) - 1):
                if mask[b, where[i + 1]]:
                    expected -= float(logp[i, ids[i + 1]])
                    n += 1
    # Trained targets: row 0 -> 3, 4, 5 (seg 1), 8, 9 (seg 2); 6 starts seg 2, 10 is a pad.
    assert n == 5 + 6 and float(count) == n
    # fp32 log-softmax over the vocabulary and a sum of 11 terms of size ~4: relative 1e-5.
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)


def test_untrained_positions_get_exactly_zero_gradient(tiny):
    model, cfg, _ = tiny
    tokens, segments, mask = batch(cfg.vocab_size, seed=1)
    h = model.hidden(jnp.asarray(tokens), segments_BT=jnp.asarray(segments))
    pred = trained_predictions(segments, mask)
    pick, weight = pick_predictions(pred, pick_width(pred))
    grad = jax.grad(lambda h: nll_from_hidden(model, h, tokens, pick, weight, chunk=4)[0])(h)
    grad = np.abs(np.asarray(grad)).sum(-1)
    target_trained = np.zeros_like(mask)
    target_trained[:, :-1] = mask[:, 1:] & (segments[:, 1:] == segments[:, :-1])
    target_trained &= segments > 0
    assert (grad[~target_trained] == 0).all()  # exactly: their weight is 0, not small
    assert (grad[target_trained] > 0).all()


@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_qwen3", "tiny_llama"])
def test_head_gradient_from_the_forward_equals_autodiff_of_the_plain_loss(fixtures_dir, name):
    """The loss computes the head's gradient in its forward pass (a custom VJP) and only at the
    picked positions: its gradient w.r.t. every weight must equal plain autodiff of the textbook
    loss over full [B, T, vocab] logits (tied and untied heads)."""
    model, cfg, _ = whale_jax.load_model(fixtures_dir / name)
    tokens, segments, mask = batch(cfg.vocab_size, seed=2)
    graphdef, state = nnx.split(model)
    pred = trained_predictions(segments, mask)
    width = pick_width(pred, buckets=2)  # 6 of 11: fewer positions than tokens
    assert width < tokens.shape[1]
    pick, weight = pick_predictions(pred, width)

    def ours(state):
        return nll_sum(nnx.merge(graphdef, state), tokens, segments, pick, weight, chunk=4)[0]

    def plain(state):
        m = nnx.merge(graphdef, state)
        logp = jax.nn.log_softmax(m.logits(m.hidden(jnp.asarray(tokens), segments_BT=segments)))
        target = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        picked = jnp.take_along_axis(logp, jnp.asarray(target)[..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * pred)

    value, grads = jax.value_and_grad(ours)(state)
    expected_value, expected = jax.value_and_grad(plain)(state)
    # The same sums in another order; fp32, a sum of 11 terms of size ~4: relative 1e-5.
    np.testing.assert_allclose(float(value), float(expected_value), rtol=1e-5)
    np.testing.assert_allclose(float(ours(state)), float(value), rtol=1e-6)  # no-gradient path
    for (path, g), e in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True
    ):
        g, e = np.asarray(g), np.asarray(e)
        scale = np.abs(e).max()
        assert scale > 0, path
        # Each entry sums ~11 position terms of fp32 products: 1e-4 of the leaf's largest entry
        # is far above rounding and far below any wrong term (a missed position, sign or weight).
        assert np.abs(g - e).max() <= 1e-4 * scale, (jax.tree_util.keystr(path), g, e)
