"""Layers shared by the Qwen3.5 and dense decoders: norms, RoPE, SwiGLU, gated full attention and
Gated DeltaNet. Axis letters: B batch, T new tokens, S cache slots, D model, F ffn, H query/value
heads, N kv heads, K head dim, V value head dim, C conv channels, W conv window, G stacked layers.

Every module may be built with a leading stack axis G (layers scanned together); its methods see
one layer's slice. Parameters carry logical axis names (``axes``) for the sharding table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from whale_jax.models.config import ModelConfig
from whale_jax.models.gated_delta import gated_delta_rule

Array = jax.Array
NEG_INF = -1e30  # finite: a fully masked row (an idle slot) stays finite instead of NaN


def make_param(rngs, stack, shape, axes, *, init="normal", scale=0.02, dtype=jnp.float32):
    """A parameter of ``shape`` with an optional leading stack axis (logical name "layers")."""
    full = ((stack,) if stack else ()) + tuple(shape)
    names = (("layers",) if stack else ()) + tuple(axes)
    if init == "normal":
        value = scale * jax.random.normal(rngs.params(), full, dtype)
    elif init == "zeros":
        value = jnp.zeros(full, dtype)
    elif init == "ones":
        value = jnp.ones(full, dtype)
    elif init == "a_log":  # A uniform in [1, 16]: decay rates spread over timescales
        value = jnp.log(jax.random.uniform(rngs.params(), full, jnp.float32, 1.0, 16.0))
    else:
        raise ValueError(init)
    return nnx.Param(value.astype(dtype), axes=names)


def linear(x: Array, w: Array, contract: int = 1) -> Array:
    """``x``'s last ``contract`` axes times ``w``'s first ``contract`` axes, as one 2-D matmul over
    the flattened leading axes: x [..., I1..Ic] @ w [I1..Ic, O1..] -> [..., O1..]. The same
    product as the einsum, but its backward pass is two plain 2-D matmuls too; on XLA CPU the
    gradient of a batched einsum ("btd,df->btf") ran at half the speed (SwiGLU, 2,048 tokens:
    119 -> 60 ms)."""
    lead, inner = x.shape[: x.ndim - contract], w.shape[:contract]
    out = w.shape[contract:]
    size = int(np.prod(inner))
    y = jnp.dot(x.reshape(-1, size), w.reshape(size, -1))
    return y.reshape(*lead, *out)


def linear_t(x: Array, w_OI: Array) -> Array:
    """``x [..., I] @ w_OI.T`` for a weight stored [out, in] (the tied embedding as LM head), one
    2-D matmul contracting both operands' last axes: no transposed copy of the weight (on an
    FSDP mesh that copy would be gathered whole besides the weight itself)."""
    y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), w_OI, (((1,), (1,)), ((), ())))
    return y.reshape(*x.shape[:-1], w_OI.shape[0])


def rms_norm(x: Array, weight: Array, eps: float, offset: float = 0.0) -> Array:
    """x / rms(x) * (offset + w), computed in fp32. offset=1 is Qwen3.5's zero-centred norm."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def apply_rope(x_BTHK: Array, positions_BT: Array, inv_freq) -> Array:
    """NeoX rotation of the first 2*len(inv_freq) dims of each head; the remaining dims pass."""
    inv_freq = np.asarray(inv_freq, np.float32)
    rot = 2 * inv_freq.shape[0]
    if rot == 0:
        return x_BTHK
    angles_BTR = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(angles_BTR)[:, :, None, :].astype(x_BTHK.dtype)
    sin = jnp.sin(angles_BTR)[:, :, None, :].astype(x_BTHK.dtype)
    x1, x2, rest = x_BTHK[..., : rot // 2], x_BTHK[..., rot // 2 : rot], x_BTHK[..., rot:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, dim, cfg: ModelConfig, *, offset: float, stack=0, axes=("norm",), rngs):
        self.eps, self.offset = cfg.rms_norm_eps, offset
        self.weight = make_param(rngs, stack, (dim,), axes, init="zeros" if offset else "ones")

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps, self.offset)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, cfg: ModelConfig, *, stack=0, dtype=jnp.float32, rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = make_param(rngs, stack, (d, f), ("embed", "mlp"), dtype=dtype)
        self.up_proj = make_param(rngs, stack, (d, f), ("embed", "mlp"), dtype=dtype)
        self.down_proj = make_param(rngs, stack, (f, d), ("mlp", "embed"), dtype=dtype)

    def __call__(self, x_BTD):
        gate_BTF = linear(x_BTD, self.gate_proj[...])
        up_BTF = linear(x_BTD, self.up_proj[...])
        return linear(jax.nn.silu(gate_BTF) * up_BTF, self.down_proj[...])


class Attention(nnx.Module):
    """Full causal attention with GQA, RoPE on the first rotary dims, optional q/k RMSNorm, qkv bias
    and Qwen3.5's sigmoid output gate (q_proj then holds [q | gate] per head)."""

    def __init__(self, cfg: ModelConfig, *, stack=0, dtype=jnp.float32, rngs):
        d, h, n, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.inv_freq = tuple(float(f) for f in cfg.rope.inv_freq())  # static, hashable
        q_width = 2 * k if cfg.attn_output_gate else k
        self.q_proj = make_param(
            rngs, stack, (d, h, q_width), ("embed", "heads", None), dtype=dtype
        )
        self.k_proj = make_param(rngs, stack, (d, n, k), ("embed", "kv_heads", None), dtype=dtype)
        self.v_proj = make_param(rngs, stack, (d, n, k), ("embed", "kv_heads", None), dtype=dtype)
        self.o_proj = make_param(rngs, stack, (h, k, d), ("heads", None, "embed"), dtype=dtype)
        if cfg.attention_bias:
            self.q_bias = make_param(rngs, stack, (h, q_width), ("heads", None), init="zeros")
            self.k_bias = make_param(rngs, stack, (n, k), ("kv_heads", None), init="zeros")
            self.v_bias = make_param(rngs, stack, (n, k), ("kv_heads", None), init="zeros")
        if cfg.qk_norm:
            offset = cfg.norm_offset
            self.q_norm = RMSNorm(k, cfg, offset=offset, stack=stack, rngs=rngs)
            self.k_norm = RMSNorm(k, cfg, offset=offset, stack=stack, rngs=rngs)

    def __call__(
        self,
        x_BTD,
        positions_BT,
        valid_BT,
        cache=None,
        lengths_B=None,
        layer=None,
        fresh=False,
        segments_BT=None,
        kv_window=None,
    ):
        """cache: None (self-attention over the T tokens) or (k_BNSK, v_BNSK) for this layer, in
        which case the new keys are written at ``lengths_B + t`` and the updated pair is returned.
        With ``layer`` (an index g) the pair is the whole stack (k_GBNSK, v_GBNSK): the new keys
        are scattered straight into layer g and only that layer is read, so the stack is updated
        in place without slicing a layer out and writing it back. ``fresh``: the cache holds
        nothing yet (a prefill), so the tokens attend to each other only and the cache is just
        written. ``segments_BT`` (no cache only): tokens attend within their own segment.
        ``kv_window`` (static): attention reads only the cache's first ``kv_window`` positions (the
        caller promises every row's length after these tokens fits in it); writes go to the whole
        cache, so a decode loop carries the full cache and copies no window in or out."""
        cfg = self.cfg
        K = cfg.head_dim
        q_BTHX = linear(x_BTD, self.q_proj[...])
        k_BTNK = linear(x_BTD, self.k_proj[...])
        v_BTNK = linear(x_BTD, self.v_proj[...])
        if cfg.attention_bias:
            q_BTHX = q_BTHX + self.q_bias[...].astype(q_BTHX.dtype)
            k_BTNK = k_BTNK + self.k_bias[...].astype(k_BTNK.dtype)
            v_BTNK = v_BTNK + self.v_bias[...].astype(v_BTNK.dtype)
        q_BTHK, gate_BTHK = q_BTHX[..., :K], q_BTHX[..., K:]
        if cfg.qk_norm:
            q_BTHK, k_BTNK = self.q_norm(q_BTHK), self.k_norm(k_BTNK)
        q_BTHK = apply_rope(q_BTHK, positions_BT, self.inv_freq)
        k_BTNK = apply_rope(k_BTNK, positions_BT, self.inv_freq)

        new_cache = None
        if cache is not None:
            k_cache, v_cache = cache
            S = k_cache.shape[-2]
            # Pads (and anything past the cache) go to index S, which scatter drops. The two index
            # arrays are split by the heads' slice, so the update is laid out [B, T, N, K].
            write_BT = jnp.where(valid_BT, positions_BT, S)
            rows_B1 = jnp.arange(x_BTD.shape[0])[:, None]
            at = (rows_B1, slice(None), write_BT)
            at = at if layer is None else (layer, *at)
            k_cache = k_cache.at[at].set(k_BTNK.astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[at].set(v_BTNK.astype(v_cache.dtype), mode="drop")
            new_cache = (k_cache, v_cache)
        if cache is None or fresh:
            # Nothing earlier to read: the T tokens attend to each other (causal, blocked).
            out_BTHK = causal_attention(q_BTHK, k_BTNK, v_BTNK, valid_BT, segments_BT=segments_BT)
        else:
            if layer is None:
                keys_BNSK, values_BNSK = k_cache, v_cache
            else:
                keys_BNSK, values_BNSK = k_cache[layer], v_cache[layer]
            if kv_window is not None and kv_window < S:
                keys_BNSK = keys_BNSK[:, :, :kv_window]
                values_BNSK = values_BNSK[:, :, :kv_window]
            new_len_B = lengths_B + valid_BT.sum(-1)
            slots_S = jnp.arange(keys_BNSK.shape[2])
            allowed_BTS = (slots_S[None, None, :] <= positions_BT[:, :, None]) & (
                slots_S[None, None, :] < new_len_B[:, None, None]
            )
            out_BTHK = attend(q_BTHK, keys_BNSK, values_BNSK, allowed_BTS)
        out_BTHK = out_BTHK.astype(x_BTD.dtype)
        if cfg.attn_output_gate:
            out_BTHK = out_BTHK * jax.nn.sigmoid(gate_BTHK)
        return linear(out_BTHK, self.o_proj[...], 2), new_cache


# Query block of the causal self-attention (a block reads only its causal key prefix). Measured
# on one CPU core, SmolLM2 attention shapes: 64 beats 256 at every length tried, forward and
# backward (8 x 256 tokens: forward 24 -> 10 ms, forward + backward 61 -> 43 ms; 64 x 128
# tokens forward 76 -> 56 ms); 32 was no better and sometimes worse.
ATTENTION_BLOCK = 64
# Log-decay at the first token of a packed segment: exp(-120) underflows to exactly 0 in fp32 (the
# smallest subnormal is exp(-103.3)), so nothing of the previous segment's state survives, while a
# chunk's cumulative log-decay stays small enough (120 per segment start in its 64 tokens) that
# fp32 keeps the in-segment decay differences to ~1e-5 relative.
SEGMENT_RESET_G = -120.0


def segment_starts(segments_BT: Array) -> Array:
    """True at the first token of each packed sequence (a change of segment id)."""
    before_BT = jnp.pad(segments_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return segments_BT != before_BT


def attend(q_BTHK: Array, keys_BNSK: Array, values_BNSK: Array, allowed_BTS: Array) -> Array:
    """Softmax attention of T queries over S keys (GQA: H query heads share N kv heads) where
    ``allowed_BTS``; scores and softmax in fp32. Keys and values are laid out [B, N, S, K] (the
    decode cache's layout), so each head's dot products read contiguous rows. Returns
    [B, T, H, K] in the values' dtype."""
    B, T, H, K = q_BTHK.shape
    N = keys_BNSK.shape[1]
    if T == 1:
        return _attend_one(q_BTHK, keys_BNSK, values_BNSK, allowed_BTS)
    R, S = H // N, keys_BNSK.shape[2]
    # The R query heads of a kv head go in as R * T rows of one [rows, K] x [K, S] product per
    # (b, n): 3-D batched dots, which XLA CPU runs at several times the speed of the same einsum
    # with the head axes left in place (SmolLM2, 8 x 256 tokens: 61 -> 34 ms forward).
    q_BNIK = jnp.transpose(q_BTHK.reshape(B, T, N, R, K), (0, 2, 3, 1, 4)).reshape(B, N, R * T, K)
    scores = jnp.einsum("bnik,bnsk->bnis", q_BNIK, keys_BNSK.astype(q_BTHK.dtype))
    scores = scores.astype(jnp.float32).reshape(B, N, R, T, S) * (K**-0.5)
    scores = jnp.where(allowed_BTS[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(values_BNSK.dtype).reshape(B, N, R * T, S)
    out_BNRTK = jnp.einsum("bnis,bnsk->bnik", probs, values_BNSK).reshape(B, N, R, T, K)
    return jnp.transpose(out_BNRTK, (0, 3, 1, 2, 4)).reshape(B, T, H, K)


def _attend_one(q_BTHK: Array, keys_BNSK: Array, values_BNSK: Array, allowed_BTS: Array) -> Array:
    """``attend`` for one query per row (a decode step), as element-wise products and sums: the
    score and value products are then a few multiply-adds per cached position, read once, where
    batched dots of [R, K] x [K, S] per row and head cost far more than their work on XLA CPU
    (SmolLM2, 64 rows: 332 -> 228 ms per decode step). Normalises after the value sum."""
    B, _, H, K = q_BTHK.shape
    N = keys_BNSK.shape[1]
    f32 = jnp.float32
    q_BNR1K = q_BTHK.reshape(B, N, H // N, 1, K).astype(f32) * (K**-0.5)
    scores_BNRS = jnp.sum(q_BNR1K * keys_BNSK[:, :, None].astype(f32), axis=-1)
    scores_BNRS = jnp.where(allowed_BTS[:, :, None, :], scores_BNRS, NEG_INF)
    weights_BNRS = jnp.exp(scores_BNRS - jnp.max(scores_BNRS, axis=-1, keepdims=True))
    out_BNRK = jnp.sum(weights_BNRS[..., None] * values_BNSK[:, :, None].astype(f32), axis=3)
    out_BNRK = out_BNRK / jnp.sum(weights_BNRS, axis=-1)[..., None]
    return out_BNRK.reshape(B, 1, H, K).astype(values_BNSK.dtype)


def causal_attention(
    q_BTHK, k_BTNK, v_BTNK, valid_BT, block: int | None = None, *, segments_BT=None
) -> Array:
    """Causal self-attention of T tokens where key s is visible to query t when s <= t and s is
    valid (a pad query still sees itself, so its row stays finite) and, with ``segments_BT``, s is
    in t's segment (packed sequences). Queries go in blocks that read only their causal key
    prefix — about half the score matrix of the full [T, T] form — with at most 16 blocks so the
    program stays small at long T. ``block``: default ``ATTENTION_BLOCK``."""
    T = q_BTHK.shape[1]
    size = max(block or ATTENTION_BLOCK, -(-T // 16))
    idx = jnp.arange(T)
    k_BNTK, v_BNTK = jnp.swapaxes(k_BTNK, 1, 2), jnp.swapaxes(v_BTNK, 1, 2)
    outs = []
    for start in range(0, T, size):
        end = min(start + size, T)
        rows, cols = idx[start:end, None], idx[None, :end]
        allowed_BTS = (rows >= cols) & valid_BT[:, None, :end]
        if segments_BT is not None:
            same_BTS = segments_BT[:, start:end, None] == segments_BT[:, None, :end]
            allowed_BTS = allowed_BTS & same_BTS
        allowed_BTS = allowed_BTS | (rows == cols)
        keys, values = k_BNTK[:, :, :end], v_BNTK[:, :, :end]
        outs.append(attend(q_BTHK[:, start:end], keys, values, allowed_BTS))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear-attention mixer.

    x -> fused [q | k | v] projection -> causal depthwise conv (window W) + silu -> l2-normalised
    q, k; beta = sigmoid(b x); g = -exp(A_log) * softplus(a x + dt_bias) -> gated delta rule ->
    RMSNorm(out) * silu(z x) (a plain, not zero-centred, norm) -> out projection.
    """

    def __init__(self, cfg: ModelConfig, *, stack=0, dtype=jnp.float32, rngs):
        d, c, hv = cfg.hidden_size, cfg.gdn_conv_dim, cfg.linear_num_value_heads
        self.cfg = cfg
        self.in_proj_qkv = make_param(rngs, stack, (d, c), ("embed", "gdn_qkv"), dtype=dtype)
        self.in_proj_z = make_param(
            rngs, stack, (d, cfg.gdn_value_dim), ("embed", "gdn_v"), dtype=dtype
        )
        self.in_proj_b = make_param(rngs, stack, (d, hv), ("embed", None), dtype=dtype)
        self.in_proj_a = make_param(rngs, stack, (d, hv), ("embed", None), dtype=dtype)
        self.conv = make_param(
            rngs, stack, (cfg.linear_conv_kernel, c), (None, "gdn_qkv"), scale=0.3, dtype=dtype
        )
        self.dt_bias = make_param(rngs, stack, (hv,), (None,), init="ones")
        self.A_log = make_param(rngs, stack, (hv,), (None,), init="a_log")
        self.norm = RMSNorm(cfg.linear_value_head_dim, cfg, offset=0.0, stack=stack, rngs=rngs)
        self.out_proj = make_param(
            rngs, stack, (cfg.gdn_value_dim, d), ("gdn_v", "embed"), dtype=dtype
        )

    def __call__(self, x_BTD, valid_BT, cache=None, segments_BT=None):
        """cache: None (fresh sequence) or (conv_BWC, state_BHKV) for this layer; the updated pair is
        returned. Pads contribute nothing: their conv inputs are zero and g = beta = k = v = 0.
        ``segments_BT`` (no cache only): packed sequences; a conv tap never reads another
        segment's token and each segment's first token sets g = ``SEGMENT_RESET_G``, so the state
        carried in from the previous segment is multiplied by exp(-120), which is 0 in fp32."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        W = cfg.linear_conv_kernel
        keep_BT1 = valid_BT[..., None]
        x_BTD = jnp.where(keep_BT1, x_BTD, 0)
        mixed_BTC = linear(x_BTD, self.in_proj_qkv[...])
        if cache is None:
            window_BWC = jnp.zeros((B, W - 1, mixed_BTC.shape[-1]), mixed_BTC.dtype)
            state = None
        else:
            window_BWC, state = cache
            window_BWC = window_BWC.astype(mixed_BTC.dtype)
        # Causal depthwise conv over [cached window | new tokens]; output t sees inputs t-W+1 .. t.
        full_BLC = jnp.concatenate([window_BWC, mixed_BTC], axis=1)
        conv_WC = self.conv[...]
        if segments_BT is None:
            conv_BTC = sum(full_BLC[:, i : i + T] * conv_WC[i] for i in range(W))
        else:
            seg_BL = jnp.pad(segments_BT, ((0, 0), (W - 1, 0)), constant_values=-1)
            conv_BTC = sum(
                jnp.where(
                    (seg_BL[:, i : i + T] == segments_BT)[..., None], full_BLC[:, i : i + T], 0
                )
                * conv_WC[i]
                for i in range(W)
            )
        conv_BTC = jax.nn.silu(conv_BTC)

        kd, hk, hv = cfg.linear_key_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        q_BTHK = conv_BTC[..., : cfg.gdn_key_dim].reshape(B, T, hk, kd)
        k_BTHK = conv_BTC[..., cfg.gdn_key_dim : 2 * cfg.gdn_key_dim].reshape(B, T, hk, kd)
        v_BTHV = conv_BTC[..., 2 * cfg.gdn_key_dim :].reshape(B, T, hv, cfg.linear_value_head_dim)
        q_BTHK, k_BTHK = l2_normalize(q_BTHK), l2_normalize(k_BTHK)
        b_BTH = linear(x_BTD, self.in_proj_b[...]).astype(jnp.float32)
        a_BTH = linear(x_BTD, self.in_proj_a[...]).astype(jnp.float32)
        beta_BTH = jax.nn.sigmoid(b_BTH)
        g_BTH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a_BTH + self.dt_bias[...].astype(jnp.float32)
        )
        if segments_BT is not None:
            g_BTH = jnp.where(segment_starts(segments_BT)[..., None], SEGMENT_RESET_G, g_BTH)
        beta_BTH = jnp.where(valid_BT[..., None], beta_BTH, 0.0)
        g_BTH = jnp.where(valid_BT[..., None], g_BTH, 0.0)
        k_BTHK = jnp.where(keep_BT1[..., None], k_BTHK, 0)
        v_BTHV = jnp.where(keep_BT1[..., None], v_BTHV, 0)
        out_BTHV, state = gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state)

        z_BTHV = linear(x_BTD, self.in_proj_z[...]).reshape(out_BTHV.shape)
        out_BTHV = rms_norm(out_BTHV, self.norm.weight[...], cfg.rms_norm_eps).astype(jnp.float32)
        out_BTHV = (out_BTHV * jax.nn.silu(z_BTHV.astype(jnp.float32))).astype(x_BTD.dtype)
        out_BTD = linear(out_BTHV.reshape(B, T, -1), self.out_proj[...])

        new_cache = None
        if cache is not None:
            # The next window is the last W-1 conv inputs of each row, ending at its last valid token.
            n_new_B = valid_BT.sum(-1)
            idx_BW = n_new_B[:, None] + jnp.arange(W - 1)[None, :]
            new_window = jnp.take_along_axis(full_BLC, idx_BW[..., None], axis=1)
            new_cache = (new_window.astype(cache[0].dtype), state)
        return out_BTD, new_cache
