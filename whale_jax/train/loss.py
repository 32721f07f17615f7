"""RSFT's loss: negative log-likelihood of the trained tokens, logits computed a chunk at a time.

For a packed microbatch (tokens, segments, mask), position t predicts token t+1; the prediction
counts when token t+1 is a trained (model-sampled) token of the same segment. The minibatch loss
is the token mean over all its microbatches,

    L = sum_{trained t} -log softmax(W h_t)[x_{t+1}]  /  (number of trained tokens),

so this module returns the sum and the trainer divides once by the minibatch's count.

Qwen3.5's vocabulary has 248,320 entries: a [tokens, vocab] fp32 array of a whole microbatch would
be tens of GB. The final hidden states are therefore cut along T into chunks of ``chunk`` tokens;
a scan computes each chunk's logits, log-sum-exp and target logit under ``jax.checkpoint``, so at
most one [B, chunk, vocab] block exists at a time, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from whale_jax.models.transformer import Transformer

Array = jax.Array


def targets_and_weights(tokens_BT: Array, segments_BT: Array, mask_BT: Array):
    """Next-token targets and the 0/1 weight of each prediction (trained target, same segment)."""
    target_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))
    next_seg_BT = jnp.pad(segments_BT[:, 1:], ((0, 0), (0, 1)))
    next_mask_BT = jnp.pad(mask_BT[:, 1:], ((0, 0), (0, 1)))
    weight_BT = next_mask_BT & (next_seg_BT == segments_BT) & (segments_BT > 0)
    return target_BT, weight_BT.astype(jnp.float32)


def nll_sum(
    model: Transformer,
    tokens_BT: Array,
    segments_BT: Array,
    mask_BT: Array,
    *,
    chunk: int = 256,
    remat: bool = True,
    act_sharding=None,
) -> tuple[Array, Array]:
    """(sum of the trained tokens' NLL, number of trained tokens) over one microbatch, fp32.
    ``act_sharding``: the layout of [B, T, D] activations (``Transformer.hidden``)."""
    h_BTD = model.hidden(tokens_BT, segments_BT=segments_BT, remat=remat, act_sharding=act_sharding)
    return nll_from_hidden(
        model, h_BTD, tokens_BT, segments_BT, mask_BT, chunk=chunk, act_sharding=act_sharding
    )


def nll_from_hidden(
    model: Transformer,
    h_BTD: Array,
    tokens_BT: Array,
    segments_BT: Array,
    mask_BT: Array,
    *,
    chunk: int = 256,
    act_sharding=None,
) -> tuple[Array, Array]:
    """``nll_sum`` from the final hidden states (before the final norm)."""
    target_BT, weight_BT = targets_and_weights(tokens_BT, segments_BT, mask_BT)
    B, T, D = h_BTD.shape
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T
    if pad:
        h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
        target_BT = jnp.pad(target_BT, ((0, 0), (0, pad)))
        weight_BT = jnp.pad(weight_BT, ((0, 0), (0, pad)))
    # [n, B, C, ...]: the scan walks the chunks; the batch axis (and its sharding) stays put.
    h_NBCD = h_BTD.reshape(B, n, C, D).swapaxes(0, 1)
    target_NBC = target_BT.reshape(B, n, C).swapaxes(0, 1)
    weight_NBC = weight_BT.reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_nll(h_BCD, target_BC, weight_BC):
        if act_sharding is not None:  # rows stay on their devices; the vocabulary is not gathered
            h_BCD = jax.lax.with_sharding_constraint(h_BCD, act_sharding)
        logits_BCV = model.logits(h_BCD)  # fp32
        lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        picked_BC = jnp.take_along_axis(logits_BCV, target_BC[..., None], axis=-1)[..., 0]
        return jnp.sum((lse_BC - picked_BC) * weight_BC)

    def body(total, xs):
        return total + chunk_nll(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_NBCD, target_NBC, weight_NBC))
    return total, jnp.sum(weight_BT)
