"""RSFT's loss: negative log-likelihood of the trained tokens, logits computed a chunk at a time.

For a packed microbatch (tokens, segments, mask), position t predicts token t+1; the prediction
counts when token t+1 is a trained (model-sampled) token of the same segment. The minibatch loss
is the token mean over all its microbatches,

    L = sum_{trained t} -log softmax(W h_t)[x_{t+1}]  /  (number of trained tokens),

so this module returns the sum and the trainer divides once by the minibatch's count.

Only the predicting positions reach the LM head. The host lists them per row
(``packing.pick_predictions``: [B, P] indices, P rounded up to a few sizes so shapes stay few,
pads with weight 0), and the loss gathers those hidden states: a row whose prompt is half its
tokens pays for half the head. The head is the largest single matmul of a small model
(SmolLM2-135M: a fifth of a training step's work; with Qwen3.5's 248,320-entry vocabulary more).

The head's gradient is computed in the forward pass (``_head_nll``, a custom VJP): each chunk of
``chunk`` positions per row makes its [B, chunk, vocab] fp32 logits once, and from the softmax
the gradients of the hidden states and of the head weight at once, so the backward pass does not
recompute the logits (three head-sized matmuls per chunk instead of four) and a whole
microbatch's [tokens, vocab] array never exists (tens of GB at Qwen3.5's vocabulary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from whale_jax.models.layers import linear, linear_t
from whale_jax.models.transformer import Transformer

Array = jax.Array


def nll_sum(
    model: Transformer,
    tokens_BT: Array,
    segments_BT: Array,
    pick_BP: Array,
    weight_BP: Array,
    *,
    chunk: int = 256,
    remat: bool = True,
    act_sharding=None,
    head_sharding=None,
    groups: tuple | None = None,
) -> tuple[Array, Array]:
    """(sum of the trained tokens' NLL, number of trained tokens) over one microbatch, fp32.
    ``pick_BP``/``weight_BP`` from ``packing.pick_predictions``; ``act_sharding``: the layout of
    [B, T, D] activations and ``groups`` the per-group weights of an unrolled layer loop
    (``Transformer.hidden``); ``head_sharding``: the head weight's (its gradient is accumulated in
    that layout)."""
    h_BTD = model.hidden(
        tokens_BT, segments_BT=segments_BT, remat=remat, act_sharding=act_sharding, groups=groups
    )
    return nll_from_hidden(
        model,
        h_BTD,
        tokens_BT,
        pick_BP,
        weight_BP,
        chunk=chunk,
        act_sharding=act_sharding,
        head_sharding=head_sharding,
    )


def nll_from_hidden(
    model: Transformer,
    h_BTD: Array,
    tokens_BT: Array,
    pick_BP: Array,
    weight_BP: Array,
    *,
    chunk: int = 256,
    act_sharding=None,
    head_sharding=None,
) -> tuple[Array, Array]:
    """``nll_sum`` from the final hidden states (before the final norm)."""
    T = tokens_BT.shape[1]
    pick_BP = jnp.asarray(pick_BP, jnp.int32)
    weight_BP = jnp.asarray(weight_BP, jnp.float32)
    target_BP = jnp.take_along_axis(jnp.asarray(tokens_BT), jnp.minimum(pick_BP + 1, T - 1), axis=1)
    h_BPD = jnp.take_along_axis(h_BTD, pick_BP[..., None], axis=1)
    hn_BPD = model.final_norm(h_BPD)
    tied = model.cfg.tie_word_embeddings
    head = model.embed[...] if tied else model.lm_head[...]
    total = _head_nll(chunk, tied, act_sharding, head_sharding)(hn_BPD, head, target_BP, weight_BP)
    return total, jnp.sum(weight_BP)


def _transposed(sharding):
    """The sharding of a 2-D array's transpose (a NamedSharding's two axes swapped)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None  # one device: nothing to constrain
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[1], spec[0]))


def _head_nll(chunk: int, tied: bool, act_sharding, head_sharding):
    """sum over positions of weight * (logsumexp(logits) - logits[target]) with logits = h @ W
    (W [D, V], or [V, D] when ``tied``), as a function whose VJP was computed in its forward."""

    def logits_of(h_BCD, W):
        return (linear_t(h_BCD, W) if tied else linear(h_BCD, W)).astype(jnp.float32)

    def run(h_BPD, W, target_BP, weight_BP, grads: bool):
        B, P, D = h_BPD.shape
        C = min(chunk, P)
        n = -(-P // C)
        pad = n * C - P
        if pad:  # pads carry weight 0: no loss, no gradient
            h_BPD = jnp.pad(h_BPD, ((0, 0), (0, pad), (0, 0)))
            target_BP = jnp.pad(target_BP, ((0, 0), (0, pad)))
            weight_BP = jnp.pad(weight_BP, ((0, 0), (0, pad)))
        # [n, B, C, ...]: the scan walks the chunks; the batch axis (and its sharding) stays put.
        xs = (
            h_BPD.reshape(B, n, C, D).swapaxes(0, 1),
            target_BP.reshape(B, n, C).swapaxes(0, 1),
            weight_BP.reshape(B, n, C).swapaxes(0, 1),
        )

        def body(carry, x):
            total, dW = carry
            h_BCD, target_BC, weight_BC = x
            if (
                act_sharding is not None
            ):  # rows stay on their devices; the vocabulary is not gathered
                h_BCD = jax.lax.with_sharding_constraint(h_BCD, act_sharding)
            logits_BCV = logits_of(h_BCD, W)
            # One exp pass serves the loss and the gradient: exp(logits - max) is kept.
            max_BC = jnp.max(logits_BCV, axis=-1)
            exp_BCV = jnp.exp(logits_BCV - max_BC[..., None])
            sum_BC = jnp.sum(exp_BCV, axis=-1)
            lse_BC = max_BC + jnp.log(sum_BC)
            picked_BC = jnp.take_along_axis(logits_BCV, target_BC[..., None], axis=-1)[..., 0]
            total = total + jnp.sum((lse_BC - picked_BC) * weight_BC)
            if not grads:
                return (total, dW), None
            # d/dlogits of weight * (lse - logit[target]) = weight * (softmax - onehot(target)).
            V = logits_BCV.shape[-1]
            onehot_BCV = target_BC[..., None] == jnp.arange(V)
            dlogits_BCV = (
                exp_BCV * (weight_BC / sum_BC)[..., None] - onehot_BCV * weight_BC[..., None]
            )
            dlogits_BCV = dlogits_BCV.astype(h_BCD.dtype)
            dh_BCD = linear(dlogits_BCV, W) if tied else linear_t(dlogits_BCV, W)
            h_ND, dl_NV = h_BCD.reshape(-1, D), dlogits_BCV.reshape(-1, V)
            # [D, V] either way (a tied head's is transposed once after the scan): XLA CPU ran
            # the [V, D] product, both operands contracted on their token axis, at half the
            # speed (1,024 x 16,384 x 256 on one core: 96 -> 43 ms with the transpose).
            step = jnp.dot(h_ND.T, dl_NV, preferred_element_type=jnp.float32)
            return (total, dW + step), dh_BCD

        V = W.shape[0] if tied else W.shape[1]
        dW = jnp.zeros((D, V), jnp.float32) if grads else jnp.zeros((), jnp.float32)
        sharding_DV = head_sharding
        if tied and head_sharding is not None:
            sharding_DV = _transposed(head_sharding)
        if grads and sharding_DV is not None:
            dW = jax.lax.with_sharding_constraint(dW, sharding_DV)
        (total, dW), dh = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dW), xs)
        if not grads:
            return total
        if tied:  # the barrier keeps XLA from folding the transpose back into the products
            dW = jax.lax.optimization_barrier(dW).T
            if head_sharding is not None:
                dW = jax.lax.with_sharding_constraint(dW, head_sharding)
        dh_BPD = dh.swapaxes(0, 1).reshape(B, n * C, D)[:, :P]
        return total, dh_BPD, dW

    @jax.custom_vjp
    def head_nll(h_BPD, W, target_BP, weight_BP):
        return run(h_BPD, W, target_BP, weight_BP, grads=False)

    def forward(h_BPD, W, target_BP, weight_BP):
        total, dh_BPD, dW = run(h_BPD, W, target_BP, weight_BP, grads=True)
        return total, (dh_BPD, dW.astype(W.dtype), weight_BP, target_BP)

    def backward(residuals, g):
        dh_BPD, dW, weight_BP, target_BP = residuals
        target_zero = np.zeros(target_BP.shape, jax.dtypes.float0)
        dh_BPD, dW = (g * dh_BPD).astype(dh_BPD.dtype), (g * dW).astype(dW.dtype)
        return dh_BPD, dW, target_zero, jnp.zeros_like(weight_BP)

    head_nll.defvjp(forward, backward)
    return head_nll
