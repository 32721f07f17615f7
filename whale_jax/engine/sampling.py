"""Token sampling for a batch of slots, each with its own temperature, top-k, top-p and RNG key.

Order per row (as in transformers): logits / temperature -> keep the top-k -> keep the smallest
prefix of the sorted distribution whose mass reaches top-p (the best token always stays) -> draw.
``temperature <= 0`` is greedy (argmax of the raw logits). ``top_k <= 0`` means no top-k limit.

A row's draw depends only on its logits, its settings, its base key and the index of the token
within its request: the per-token key is ``fold_in(base_key, index)``. Which slot the request sits
in, and what else is in the batch, cannot change it.

The top-k path works on ``lax.top_k`` of a static width (``max_top_k``); a row that wants top-p
over the whole vocabulary (no top-k, or top-k wider than that) takes a full sort, which runs only
when some row needs it (``lax.cond``).
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array
_NEG = -jnp.inf


@struct.dataclass
class SlotSampling:
    """Per-slot sampling settings [B]; ``key`` holds raw uint32 key data [B, 2]."""

    temperature: Array
    top_k: Array
    top_p: Array
    key: Array

    @classmethod
    def zeros(cls, batch: int) -> SlotSampling:
        return cls(
            temperature=jnp.zeros((batch,), jnp.float32),
            top_k=jnp.zeros((batch,), jnp.int32),
            top_p=jnp.ones((batch,), jnp.float32),
            key=jnp.zeros((batch, 2), jnp.uint32),
        )


def request_key(seed: int, identity: tuple) -> np.ndarray:
    """Raw key data (uint32[2]) for a request, from the run seed and what the request *is*.

    The identity tuple (e.g. step, task id, sample index, call index) is hashed with blake2b, so
    the key is the same in every process, on every run, in any submission order.
    """
    digest = hashlib.blake2b(repr((int(seed), tuple(identity))).encode(), digest_size=8).digest()
    return np.frombuffer(digest, dtype=np.uint32).copy()


def _row_keys(key_B2: Array, index_B: Array) -> Array:
    def one(k, i):
        return jax.random.fold_in(jax.random.wrap_key_data(k, impl="threefry2x32"), i)

    return jax.vmap(one)(key_B2, index_B)


def _keep_top_p(sorted_logits_BK: Array, top_p_B: Array) -> Array:
    """Mask over a descending row: the smallest prefix whose probability mass reaches top_p."""
    probs = jax.nn.softmax(sorted_logits_BK, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p_B[:, None]
    return keep.at[:, 0].set(True)


def _draw(keys_B, logits_BK: Array) -> Array:
    """Index of a categorical draw per row (Gumbel-max; -inf entries are never drawn)."""

    def one(k, row):
        return jnp.argmax(row + jax.random.gumbel(k, row.shape, jnp.float32))

    return jax.vmap(one)(keys_B, logits_BK)


def sample(logits_BV: Array, params: SlotSampling, index_B: Array, *, max_top_k: int) -> Array:
    """One token per row; see the module docstring for the rules. Each path runs only when some
    row takes it (``lax.cond``): an all-greedy batch costs an argmax."""
    V = logits_BV.shape[-1]
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    K = min(max_top_k, V)
    sampled = params.temperature > 0
    wide_B = (params.top_k <= 0) | (params.top_k > K)
    zeros_B = jnp.zeros_like(greedy_B)

    def sampled_path():
        scaled_BV = logits_BV / jnp.maximum(params.temperature, 1e-6)[:, None]
        keys_B = _row_keys(params.key, index_B)

        def top_k_path():  # rows with 0 < top_k <= K: exact, top-p inside the k best
            vals_BK, idx_BK = jax.lax.top_k(scaled_BV, K)
            rank_K = jnp.arange(K)
            vals_BK = jnp.where(rank_K[None, :] < params.top_k[:, None], vals_BK, _NEG)
            vals_BK = jnp.where(_keep_top_p(vals_BK, params.top_p), vals_BK, _NEG)
            choice_B = _draw(keys_B, vals_BK)
            return jnp.take_along_axis(idx_BK, choice_B[:, None], axis=1)[:, 0].astype(jnp.int32)

        def full_sorted():
            order_BV = jnp.argsort(-scaled_BV, axis=-1)
            sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
            sorted_BV = jnp.where(_keep_top_p(sorted_BV, params.top_p), sorted_BV, _NEG)
            pick = _draw(keys_B, sorted_BV)
            return jnp.take_along_axis(order_BV, pick[:, None], axis=1)[:, 0].astype(jnp.int32)

        def full_plain():
            return _draw(keys_B, scaled_BV).astype(jnp.int32)

        def wide_path():
            needs_sort = jnp.any(wide_B & sampled & (params.top_p < 1.0))
            return jax.lax.cond(needs_sort, full_sorted, full_plain)

        topk_B = jax.lax.cond(jnp.any(sampled & ~wide_B), top_k_path, lambda: zeros_B)
        wide_tok_B = jax.lax.cond(jnp.any(sampled & wide_B), wide_path, lambda: zeros_B)
        return jnp.where(wide_B, wide_tok_B, topk_B)

    sampled_B = jax.lax.cond(jnp.any(sampled), sampled_path, lambda: zeros_B)
    return jnp.where(sampled, sampled_B, greedy_B)
