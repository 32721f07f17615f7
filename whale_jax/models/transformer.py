"""The decoder: embeddings, layer groups scanned with ``lax.scan``, final norm, LM head.

Layers are grouped by the period of ``layer_types`` (Qwen3.5: [linear, linear, linear, full]; dense
models: [full]); each position in the period is one ``Block`` whose parameters are stacked over the
G = num_layers / period groups, and one scan step runs a whole group. Compile time stays flat in
depth, and the decode cache rides in the scan carry so it is updated in place. ``extend`` can
instead run the groups as a Python loop over per-group weights (``split_groups``) and per-layer
cache arrays (``DecodeCache.per_group``): the engine does so on CPU, where a scan step copies its
weight slice out of the stack.

Two ways in:
- ``model(tokens_BT, valid_BT)``: full-sequence logits, no cache (training, scoring). Any pad
  pattern works; positions count valid tokens only, so left padding changes nothing.
- ``model.extend(cache, tokens_BT, n_new_B)``: continues every row of a ``DecodeCache`` by its own
  number of new tokens (right-padded in ``tokens_BT``); ``prefill`` is ``extend`` from an empty
  cache. Returns logits and the updated cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from whale_jax.models.config import FULL, ModelConfig
from whale_jax.models.layers import (
    MLP,
    Attention,
    GatedDeltaNet,
    RMSNorm,
    linear,
    linear_t,
    make_param,
    segment_starts,
)

Array = jax.Array


# Axis of the cache positions S in a stacked KV array [G, B, N, S, K] (one less per layer).
KV_SEQ_AXIS = 3


@struct.dataclass
class DecodeCache:
    """Per-row (slot) decode state. ``layers[i]`` belongs to block i of the period, stacked over G:
    full attention (k_GBNSK, v_GBNSK: positions S inside kv heads N, as each head's attention reads
    them); Gated DeltaNet (conv window_GBWC, state_GBHKV in fp32)."""

    lengths: Array  # [B] int32: tokens already in the cache per row
    layers: tuple

    @property
    def capacity(self) -> int:
        for kind_cache in self.layers:
            first = kind_cache[0]
            if isinstance(first, tuple):  # per-group form: [B, N, S, K] per layer
                if first[0].ndim == 4:
                    return first[0].shape[KV_SEQ_AXIS - 1]
            elif first.ndim == 5:
                return first.shape[KV_SEQ_AXIS]
        return 1 << 30  # no full-attention layer: the recurrent state has no length limit

    def per_group(self, split: tuple[bool, ...] | None = None) -> DecodeCache:
        """The same cache with stacked arrays split into tuples of G per-layer arrays, for the
        unrolled path (``extend(..., groups=...)``): a layer then reads and updates its own
        arrays in place instead of slicing them out of the stack on every step. ``split`` (per
        block of the period; None: all) picks which blocks are split; the others stay stacked
        (full-attention KV is written in place at its layer of the stack either way)."""
        split = (True,) * len(self.layers) if split is None else split
        layers = tuple(
            tuple(tuple(x[g] for g in range(x.shape[0])) for x in kind_cache) if cut else kind_cache
            for cut, kind_cache in zip(split, self.layers, strict=True)
        )
        return DecodeCache(lengths=self.lengths, layers=layers)

    def stacked(self) -> DecodeCache:
        """Inverse of ``per_group``."""
        layers = tuple(
            tuple(jnp.stack(xs) for xs in kind_cache)
            if isinstance(kind_cache[0], tuple)
            else kind_cache
            for kind_cache in self.layers
        )
        return DecodeCache(lengths=self.lengths, layers=layers)


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, kind: str, *, stack: int, dtype, rngs):
        self.kind = kind
        off = cfg.norm_offset
        self.input_norm = RMSNorm(cfg.hidden_size, cfg, offset=off, stack=stack, rngs=rngs)
        if kind == FULL:
            self.attn = Attention(cfg, stack=stack, dtype=dtype, rngs=rngs)
        else:
            self.gdn = GatedDeltaNet(cfg, stack=stack, dtype=dtype, rngs=rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg, offset=off, stack=stack, rngs=rngs)
        self.mlp = MLP(cfg, stack=stack, dtype=dtype, rngs=rngs)

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
        h_BTD = self.input_norm(x_BTD)
        if self.kind == FULL:
            h_BTD, cache = self.attn(
                h_BTD, positions_BT, valid_BT, cache, lengths_B, layer, fresh, segments_BT,
                kv_window,
            )  # fmt: skip
        else:
            h_BTD, cache = self.gdn(h_BTD, valid_BT, cache, segments_BT)
        x_BTD = x_BTD + h_BTD
        return x_BTD + self.mlp(self.post_norm(x_BTD)), cache


class Blocks(nnx.Module):
    """One Block per position of the layer-type period, each stacked over the groups."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.count = cfg.period
        for i, kind in enumerate(cfg.layer_types[: cfg.period]):
            setattr(self, f"b{i}", Block(cfg, kind, stack=cfg.num_groups, dtype=dtype, rngs=rngs))

    def block(self, i: int) -> Block:
        return getattr(self, f"b{i}")


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        d = cfg.hidden_size
        self.embed = make_param(rngs, 0, (cfg.vocab_size, d), ("vocab", "embed"), dtype=dtype)
        self.blocks = Blocks(cfg, dtype=dtype, rngs=rngs)
        self.final_norm = RMSNorm(d, cfg, offset=cfg.norm_offset, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = make_param(rngs, 0, (d, cfg.vocab_size), ("embed", "vocab"), dtype=dtype)

    # -- core ---------------------------------------------------------------------------------
    def _layers(
        self,
        x_BTD,
        positions_BT,
        valid_BT,
        cache: DecodeCache | None,
        groups=None,
        fresh=False,
        *,
        segments_BT=None,
        remat: bool = False,
        act_sharding=None,
        kv_window=None,
    ):
        graphdef, state = nnx.split(self.blocks)
        lengths_B = None if cache is None else cache.lengths
        if cache is not None and groups is None:
            if any(isinstance(kind_cache[0], tuple) for kind_cache in cache.layers):
                raise ValueError("a per-group cache (DecodeCache.per_group) needs groups=...")

        def group(carry, xs):
            x_BTD, caches = carry
            if act_sharding is not None:
                x_BTD = jax.lax.with_sharding_constraint(x_BTD, act_sharding)
            g, group_state = xs
            blocks = nnx.merge(graphdef, group_state)
            new_caches = []
            for i in range(blocks.count):
                if caches is None:
                    x_BTD, _ = blocks.block(i)(
                        x_BTD, positions_BT, valid_BT, segments_BT=segments_BT
                    )
                    continue
                block = blocks.block(i)
                if isinstance(caches[i][0], tuple):  # per-group arrays (unrolled, g static)
                    layer_cache = tuple(c[g] for c in caches[i])
                    x_BTD, layer_cache = block(
                        x_BTD, positions_BT, valid_BT, layer_cache, lengths_B, None, fresh,
                        kv_window=kv_window,
                    )  # fmt: skip
                    pairs = zip(caches[i], layer_cache, strict=True)
                    new_caches.append(tuple(c[:g] + (n,) + c[g + 1 :] for c, n in pairs))
                    continue
                if block.kind == FULL:
                    # KV stacks are written in place at layer g (no slice-out / write-back).
                    x_BTD, stacked = block(
                        x_BTD, positions_BT, valid_BT, caches[i], lengths_B, g, fresh,
                        kv_window=kv_window,
                    )  # fmt: skip
                    new_caches.append(stacked)
                    continue
                layer_cache = jax.tree.map(lambda c: c[g], caches[i])
                x_BTD, layer_cache = block(x_BTD, positions_BT, valid_BT, layer_cache, lengths_B)
                new_caches.append(jax.tree.map(lambda c, n: c.at[g].set(n), caches[i], layer_cache))
            return (x_BTD, None if caches is None else tuple(new_caches)), None

        if remat:  # keep only each group's input for the backward pass; recompute the rest
            group = jax.checkpoint(group, prevent_cse=False)
        G = self.cfg.num_groups
        layer_caches = None if cache is None else cache.layers
        if groups is not None:  # unrolled over per-group weights: no weight slices are copied
            carry = (x_BTD, layer_caches)
            for g, group_state in enumerate(groups):
                carry, _ = group(carry, (g, group_state))
            return carry
        (x_BTD, layer_caches), _ = jax.lax.scan(
            group, (x_BTD, layer_caches), (jnp.arange(G), state)
        )
        return x_BTD, layer_caches

    def logits(self, h_BTD: Array) -> Array:
        h_BTD = self.final_norm(h_BTD)
        if self.cfg.tie_word_embeddings:
            return linear_t(h_BTD, self.embed[...]).astype(jnp.float32)
        return linear(h_BTD, self.lm_head[...]).astype(jnp.float32)

    def hidden(
        self,
        tokens_BT: Array,
        valid_BT: Array | None = None,
        *,
        segments_BT: Array | None = None,
        remat: bool = False,
        act_sharding=None,
        groups: tuple | None = None,
    ) -> Array:
        """Final hidden states (before the final norm) for full sequences, no cache.

        ``segments_BT`` packs several independent sequences into one row (training): tokens with
        the same id > 0 form one sequence, 0 marks pads, and each sequence must be contiguous.
        A token then sees only its own sequence: attention is masked by segment, the GDN conv
        reads no taps across a boundary, the recurrent state restarts at each sequence's first
        token, and positions count from 0 within it. ``remat`` rematerialises each layer group in
        the backward pass (chosen per call: a training step at long T wants it, a short one not).
        ``act_sharding`` (a sharding of [B, T, D] activations, e.g. batch over data x fsdp) pins
        the residual stream's layout at the embedding and at every layer group; without it an
        FSDP mesh, whose weights split D over fsdp, lets XLA gather whole batches of
        activations onto every device. ``groups`` (``split_groups`` of the block state) runs the
        layer groups as a Python loop over per-group weights instead of a scan: without remat,
        each group's residuals are then ordinary buffers rather than slices of scan-stacked
        arrays, which XLA:CPU zero-fills and copies (the trainer does so when remat is off).
        """
        if segments_BT is not None:
            segments_BT = segments_BT.astype(jnp.int32)
            if valid_BT is None:
                valid_BT = segments_BT > 0
        if valid_BT is None:
            valid_BT = jnp.ones(tokens_BT.shape, bool)
        valid_BT = valid_BT.astype(bool)
        if segments_BT is None:
            positions_BT = jnp.maximum(jnp.cumsum(valid_BT, axis=-1) - 1, 0)
        else:
            positions_BT = segment_positions(segments_BT)
        x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(self.dtype)
        if act_sharding is not None:
            x_BTD = jax.lax.with_sharding_constraint(x_BTD, act_sharding)
        h_BTD, _ = self._layers(
            x_BTD,
            positions_BT,
            valid_BT,
            None,
            groups,
            segments_BT=segments_BT,
            remat=remat,
            act_sharding=act_sharding,
        )
        if act_sharding is not None:
            h_BTD = jax.lax.with_sharding_constraint(h_BTD, act_sharding)
        return h_BTD

    def __call__(self, tokens_BT: Array, valid_BT: Array | None = None) -> Array:
        """Logits [B, T, vocab] (fp32) for full sequences; ``valid_BT`` marks real tokens."""
        return self.logits(self.hidden(tokens_BT, valid_BT))

    # -- cached decoding ----------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=None) -> DecodeCache:
        """An empty cache with ``batch`` rows; full-attention layers hold ``max_len`` positions."""
        cfg, G = self.cfg, self.cfg.num_groups
        dtype = dtype or self.dtype
        layers = []
        for kind in cfg.layer_types[: cfg.period]:
            if kind == FULL:
                shape = (G, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
                layers.append((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
            else:
                window = (G, batch, cfg.linear_conv_kernel - 1, cfg.gdn_conv_dim)
                state = (
                    G,
                    batch,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                )
                layers.append((jnp.zeros(window, dtype), jnp.zeros(state, jnp.float32)))
        return DecodeCache(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers))

    def extend(
        self,
        cache: DecodeCache,
        tokens_BT: Array,
        n_new_B: Array,
        *,
        last_only: bool = False,
        groups: tuple | None = None,
        fresh: bool = False,
        kv_window: int | None = None,
    ) -> tuple[Array, DecodeCache]:
        """Appends ``n_new_B[b]`` tokens (a right-padded prefix of row b of ``tokens_BT``) to every
        row. Returns logits [B, T, vocab] (or [B, vocab] at each row's last new token when
        ``last_only``) and the cache with lengths advanced. ``groups`` (from ``split_groups``)
        runs the layers unrolled over per-group weights instead of scanning the stacked ones.
        ``fresh`` promises the cache is empty (``prefill``): attention then reads only the new
        tokens, blocked and causal, instead of the whole capacity. ``kv_window`` (static) bounds
        every row's length after the new tokens: attention reads only that many positions of the
        cache (which keeps its capacity; new keys are written in place)."""
        T = tokens_BT.shape[1]
        valid_BT = jnp.arange(T)[None, :] < n_new_B[:, None]
        positions_BT = cache.lengths[:, None] + jnp.arange(T)[None, :]
        x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(self.dtype)
        h_BTD, layers = self._layers(
            x_BTD, positions_BT, valid_BT, cache, groups, fresh, kv_window=kv_window
        )
        if last_only:
            last_B = jnp.maximum(n_new_B - 1, 0)
            h_BTD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)
            logits = self.logits(h_BTD)[:, 0]
        else:
            logits = self.logits(h_BTD)
        new_cache = DecodeCache(lengths=cache.lengths + n_new_B.astype(jnp.int32), layers=layers)
        return logits, new_cache

    def prefill(
        self,
        tokens_BT: Array,
        lengths_B: Array,
        *,
        max_len: int,
        last_only: bool = False,
        groups: tuple | None = None,
    ) -> tuple[Array, DecodeCache]:
        """Runs right-padded prompts into a fresh cache of ``max_len`` positions."""
        cache = self.init_cache(tokens_BT.shape[0], max_len)
        return self.extend(
            cache, tokens_BT, lengths_B, last_only=last_only, groups=groups, fresh=True
        )


def segment_positions(segments_BT: Array) -> Array:
    """Each token's index within its (contiguous) segment: t minus the start of its segment."""
    t_BT = jnp.broadcast_to(jnp.arange(segments_BT.shape[1]), segments_BT.shape)
    start_BT = jax.lax.cummax(jnp.where(segment_starts(segments_BT), t_BT, 0), axis=1)
    return t_BT - start_BT


def split_groups(blocks_state) -> tuple:
    """The stacked block parameters (``nnx.state(model.blocks)``) as one state per layer group, for
    ``extend(..., groups=...)``. Inside ``jax.jit`` this is G slices of each stacked parameter;
    run it once per weight update (``DeviceEngine`` does) so decoding reads each layer's weights
    in place. On XLA CPU a scan copies each layer's weight slice out of the stack on every step,
    which costs as much as the batch-1 matmuls themselves."""
    G = jax.tree.leaves(blocks_state)[0].shape[0]
    return tuple(jax.tree.map(lambda a, g=g: a[g], blocks_state) for g in range(G))


class Jitted:
    """Compiled entry points over a model's parameters as they are now (``nnx.split`` once, merged
    inside each jitted function). Rebuild after the parameters change."""

    def __init__(self, model: Transformer):
        self.graphdef, self.state = nnx.split(model)
        graphdef = self.graphdef

        @jax.jit
        def forward(state, tokens_BT, valid_BT):
            return nnx.merge(graphdef, state)(tokens_BT, valid_BT)

        @jax.jit(static_argnames=("last_only", "fresh"), donate_argnums=(1,))
        def extend(state, cache, tokens_BT, n_new_B, last_only=False, fresh=False):
            model = nnx.merge(graphdef, state)
            return model.extend(cache, tokens_BT, n_new_B, last_only=last_only, fresh=fresh)

        self._forward, self._extend = forward, extend
        self.model = model

    def __call__(self, tokens_BT, valid_BT=None) -> Array:
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        if valid_BT is None:
            valid_BT = jnp.ones(tokens_BT.shape, bool)
        return self._forward(self.state, tokens_BT, jnp.asarray(valid_BT, bool))

    def extend(self, cache, tokens_BT, n_new_B, *, last_only=False, fresh=False):
        """Like ``Transformer.extend``; the cache passed in is donated (do not reuse it)."""
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        n_new_B = jnp.asarray(n_new_B, jnp.int32)
        return self._extend(self.state, cache, tokens_BT, n_new_B, last_only=last_only, fresh=fresh)

    def prefill(self, tokens_BT, lengths_B, *, max_len: int, last_only=False):
        cache = self.model.init_cache(jnp.asarray(tokens_BT).shape[0], max_len)
        return self.extend(cache, tokens_BT, lengths_B, last_only=last_only, fresh=True)
