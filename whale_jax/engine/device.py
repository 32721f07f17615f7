"""The compiled half of the engine: JetStream's prefill -> insert -> generate over N decode slots.

``DecodeState`` is everything the device keeps per slot: the model's ``DecodeCache`` (contiguous KV
for full-attention layers, conv window + fp32 recurrent state for Gated DeltaNet layers, lengths),
the logits the next token is drawn from, how many tokens the slot's request has sampled, its stop
ids, token budget and sampling settings. Every function that changes it donates it.

- prefill: P fresh prompts (right-padded to a length bucket) into a small cache of capacity T: their
  last-token logits and that cache (a ``Prefix``).
- resume: continues P store rows (a parked session, a cached prompt prefix) by their new tokens
  without re-reading the earlier ones; on models with attention layers only, a row may be
  continued from any prefix of its tokens.
- keep and insert, in the same call as the prefill or resume that made the rows: prefix rows
  (state and logits) into store rows (a prompt prefix that later requests continue from, or a
  whole prompt that later ones start sampling from without any prefill), and into slots (one
  prefix row may fill several: n samples of one prompt, one prefill).
- ``insert`` from store rows: whole prompts kept with their logits, into slots.
- ``generate(state, occupied_B)``: up to ``steps`` tokens for every active slot inside one
  ``while_loop``: draw from the held logits, then feed the drawn token to the model. A slot stops
  on a stop id or its budget; the drawn stop token is not fed, so a finished slot's cache holds
  the prompt and all sampled tokens but the last.
- ``park(store, state, slots_M, rows_M)``: copies finished slots' decode state into the store,
  keyed by the host (``prefix_cache.PrefixIndex``), so a session's next turn continues from it.

The engine runs a prefill or resume with its keeping and inserting as one jitted call
(``_prefill_placed``, ``_resume_placed``): one dispatch and one compiled program per prompt shape
instead of three (on one H200 each call cost milliseconds whatever its work: docs/
benchmarks-log.md, 2026-12-04). ``_prefill`` and ``_insert`` alone serve the JetStream adapter.

Parameters are an argument of every call (never closed over), so new weights from the trainer are
used by the next call without recompiling or a copy through the host.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from whale_jax.engine.sampling import SlotSampling, sample
from whale_jax.models.config import FULL
from whale_jax.models.gated_delta import CHUNK
from whale_jax.models.layers import ATTENTION_BLOCK
from whale_jax.models.transformer import KV_SEQ_AXIS, DecodeCache, Transformer, split_groups
from whale_jax.sharding import on_device

Array = jax.Array


@struct.dataclass
class DecodeState:
    cache: DecodeCache
    logits: Array  # [B, V] fp32: the distribution of each slot's next token
    count: Array  # [B] int32: tokens sampled so far by the slot's request
    max_new: Array  # [B] int32
    active: Array  # [B] bool
    stop_ids: Array  # [B, E] int32, -1 = unused
    sampling: SlotSampling


class Prefix(NamedTuple):
    """Output of prefill/resume: per-row last-token logits and a decode cache (capacity T or S)."""

    logits: Array  # [P, V]
    cache: DecodeCache


@dataclasses.dataclass(frozen=True)
class SlotInit:
    """Host-side per-slot values for ``insert``; arrays of length M."""

    rows: Any
    slots: Any
    max_new: Any
    stop_ids: Any  # [M, E]
    temperature: Any
    top_k: Any
    top_p: Any
    key: Any  # [M, 2] uint32


def _is_kv(kinds: tuple[str, ...]) -> tuple[bool, ...]:
    return tuple(kind == FULL for kind in kinds)


def _row(x: Array, row, length: int | None = None) -> Array:
    """Row ``row`` of a per-row array [G, B, ...] as [G, 1, ...]; with ``length``, a KV array's
    first ``length`` positions only."""
    sizes = list(x.shape)
    sizes[1] = 1
    if length is not None:
        sizes[KV_SEQ_AXIS] = length
    return jax.lax.dynamic_slice(x, (0, row) + (0,) * (x.ndim - 2), sizes)


# Rows move between the decode state and the store in one of two ways (``DeviceEngine``'s
# ``row_moves``). ``loop``, the CPU's: one dynamic slice per row, in a loop over the real entries:
# XLA CPU's gather and scatter of [G, M, N, W, K] blocks run element by element, and jnp indexing
# applies a static position slice to every row before gathering. Parking 8 SmolLM2 rows of 128
# positions: 78 ms with indexing, 8 ms this way. The loop (not unrolled) keeps the program small
# whatever M, and padding entries cost nothing. ``scatter``, the accelerators': one gather and one
# scatter per array over all M entries (padding dropped by the scatter). On a GPU a loop with a
# trip count known only on device runs its iterations one after another, each a round trip to
# the host and a few small kernels per array; the scatter is a handful of wide kernels.


def _window_index(ndim: int, rows, n: int | None) -> tuple:
    """Index of ``rows`` (axis 1) of an array, and with ``n`` its first ``n`` positions."""
    index: list = [slice(None)] * ndim
    index[1] = rows
    if n is not None:
        index[KV_SEQ_AXIS] = slice(0, n)
    return tuple(index)


def _copy_rows(
    dst: DecodeCache, src: DecodeCache, kv: tuple[bool, ...], src_rows, dst_rows,
    window: int | None = None, *, loop: bool = True,
) -> DecodeCache:  # fmt: skip
    """dst rows ``dst_rows`` <- src rows ``src_rows``: of each KV array only the first ``window``
    positions (None: all src has; a shorter src capacity fills the front of dst). Entries whose
    dst row is past the end of dst are padding; they come after every real entry. ``loop``:
    one row at a time over the real entries, else one scatter (see above)."""
    sizes = []
    for is_kv, src_pair, dst_pair in zip(kv, src.layers, dst.layers, strict=True):
        for s, d in zip(src_pair, dst_pair, strict=True):
            cap = s.shape[KV_SEQ_AXIS]
            sizes.append(min(cap, d.shape[KV_SEQ_AXIS], window or cap) if is_kv else None)
    sources = jax.tree.leaves(src.layers)
    if loop:
        count = jnp.sum(dst_rows < dst.lengths.shape[0])

        def one(m, arrays):
            return tuple(
                jax.lax.dynamic_update_slice(
                    d,
                    _row(s, src_rows[m], n).astype(d.dtype),
                    (0, dst_rows[m]) + (0,) * (d.ndim - 2),
                )  # fmt: skip
                for d, s, n in zip(arrays, sources, sizes, strict=True)
            )

        moved = jax.lax.fori_loop(0, count, one, tuple(jax.tree.leaves(dst.layers)))
    else:
        moved = tuple(
            d.at[_window_index(d.ndim, dst_rows, n)].set(
                s[_window_index(s.ndim, src_rows, n)].astype(d.dtype), mode="drop"
            )
            for d, s, n in zip(jax.tree.leaves(dst.layers), sources, sizes, strict=True)
        )
    layers = jax.tree.unflatten(jax.tree.structure(dst.layers), moved)
    lengths = dst.lengths.at[dst_rows].set(src.lengths[src_rows], mode="drop")
    return DecodeCache(lengths=lengths, layers=layers)


def _copy_logits(dst: Array, src: Array, src_rows, dst_rows, *, loop: bool = True) -> Array:
    """dst rows ``dst_rows`` <- src rows ``src_rows`` of [rows, V] logits, real entries only (as
    ``_copy_rows``): on the CPU a gather and scatter of every padded entry's whole row would cost
    more."""
    if not loop:
        return dst.at[dst_rows].set(src[src_rows].astype(dst.dtype), mode="drop")
    count = jnp.sum(dst_rows < dst.shape[0])

    def one(m, d):
        row = jax.lax.dynamic_slice_in_dim(src, src_rows[m], 1, axis=0)
        return jax.lax.dynamic_update_slice(d, row.astype(d.dtype), (dst_rows[m], 0))

    return jax.lax.fori_loop(0, count, one, dst)


def _gather_rows(src: DecodeCache, kv: tuple[bool, ...], rows, window: int) -> DecodeCache:
    """Rows ``rows`` of ``src``, each KV array cut to its first ``window`` positions."""
    layers = tuple(
        tuple(
            jnp.concatenate([_row(x, r, window if is_kv else None) for r in rows], axis=1)
            for x in pair
        )
        for is_kv, pair in zip(kv, src.layers, strict=True)
    )
    return DecodeCache(lengths=src.lengths[rows], layers=layers)


# The jitted steps are module-level with the graph definition as a static argument, so engines
# over models of one config share compilations (tests and benchmarks build several engines).
@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, groups, tokens_PT, lengths_P) -> Prefix:
    """``groups``: None (the engine's choice: scan the layers, see ``DeviceEngine``) or per-group
    weights to run them unrolled (benchmarks/bench_prompt_layers.py compares the two)."""
    model = nnx.merge(graphdef, params)
    T = tokens_PT.shape[1]
    logits, cache = model.prefill(tokens_PT, lengths_P, max_len=T, last_only=True, groups=groups)
    return Prefix(logits, cache)


@jax.jit
def _split_groups(params):
    return split_groups(params["blocks"])


def _insert_rows(
    kv, loop, state: DecodeState, prefix: Prefix, init: dict, window: int | None = None
) -> DecodeState:
    rows, slots_M = init["rows"], init["slots"]
    cache = _copy_rows(state.cache, prefix.cache, kv, rows, slots_M, window, loop=loop)
    put = lambda x, v: x.at[slots_M].set(v, mode="drop")
    sp = state.sampling
    sampling = SlotSampling(
        temperature=put(sp.temperature, init["temperature"]),
        top_k=put(sp.top_k, init["top_k"]),
        top_p=put(sp.top_p, init["top_p"]),
        key=put(sp.key, init["key"]),
    )
    return DecodeState(
        cache=cache,
        logits=_copy_logits(state.logits, prefix.logits, rows, slots_M, loop=loop),
        count=put(state.count, jnp.zeros_like(slots_M)),
        max_new=put(state.max_new, init["max_new"]),
        active=put(state.active, jnp.ones(slots_M.shape, bool)),
        stop_ids=put(state.stop_ids, init["stop_ids"]),
        sampling=sampling,
    )


_insert = functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)(_insert_rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _resume(
    graphdef, kv, kv_len, params, groups, store: DecodeCache, rows_P, start_P, tokens_PT, n_new_P
) -> Prefix:
    """Continues store rows, each from its first ``start_P`` positions, by new tokens; attention
    reads only the first ``kv_len`` (static, a bucket that bounds every row after the new tokens)
    positions, and the prefix has that capacity. Only that window of the rows is gathered out of
    the store. A start below a row's length reads a prefix of its keys (the new tokens overwrite
    the rest, and attention masks anything past each query): only where every layer is
    attention; a recurrent state holds its row's whole length. ``groups`` as for ``_prefill``."""
    model = nnx.merge(graphdef, params)
    cache = _gather_rows(store, kv, rows_P, min(kv_len, store.capacity))
    cache = DecodeCache(lengths=start_P, layers=cache.layers)
    logits, cache = model.extend(cache, tokens_PT, n_new_P, last_only=True, groups=groups)
    return Prefix(logits, cache)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=7)
def _generate(
    graphdef, kv, steps, max_top_k, kv_len, params, groups, state: DecodeState, occupied_B,
    min_active,
):  # fmt: skip
    """``kv_len`` (static, a bucket) bounds every active slot's length for this call: attention
    reads only that many positions of each KV cache, while the loop carries the whole cache and
    writes each new key in place. (Slicing the window out and writing it back per call cost
    SmolLM2 at 64 slots 0.73 s against 0.21 s for a one-step call.) The loop also ends once no
    more than ``min_active`` slots are still active (traced: the host sets it so the call returns
    as soon as enough slots are free for the requests waiting). ``groups`` (per-group weights, or
    None to scan the stacked ones) is passed to ``extend``; with them the Gated DeltaNet states
    ride in the loop carry one array per layer (updated in place), the KV stacks stay whole."""
    model = nnx.merge(graphdef, params)
    B = occupied_B.shape[0]
    out0 = jnp.full((B, steps), -1, jnp.int32)
    cache = state.cache
    if groups is not None:
        cache = cache.per_group(tuple(not is_kv for is_kv in kv))
    state = state.replace(active=state.active & occupied_B, cache=cache)

    def cond(carry):
        i, st, _ = carry
        return (i < steps) & (jnp.sum(st.active) > min_active)

    def body(carry):
        i, st, out = carry
        tok_B = sample(st.logits, st.sampling, st.count, max_top_k=max_top_k)
        act_B = st.active
        out = out.at[:, i].set(jnp.where(act_B, tok_B, -1))
        count = st.count + act_B.astype(jnp.int32)
        hit_stop = jnp.any(tok_B[:, None] == st.stop_ids, axis=1)
        still_B = act_B & ~hit_stop & (count < st.max_new)
        logits, cache = model.extend(
            st.cache,
            tok_B[:, None],
            still_B.astype(jnp.int32),
            last_only=True,
            groups=groups,
            kv_window=kv_len,
        )
        st = st.replace(cache=cache, logits=logits, count=count, active=still_B)
        return i + 1, st, out

    _, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out0))
    if groups is not None:
        state = state.replace(cache=state.cache.stacked())
    return state, out


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=3)
def _park(kv, loop, window, store: Prefix, cache: DecodeCache, slots_M, rows_M) -> Prefix:
    """Store rows ``rows_M`` <- the first ``window`` positions of slots ``slots_M`` (their held
    logits are not kept: a parked state's last sampled token was never fed)."""
    moved = _copy_rows(store.cache, cache, kv, slots_M, rows_M, window, loop=loop)
    return store._replace(cache=moved)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=3)
def _insert_stored(kv, loop, window, state: DecodeState, store: Prefix, init: dict) -> DecodeState:
    """``_insert`` straight from store rows (a whole prompt kept with its logits): only the first
    ``window`` positions of each row are copied."""
    return _insert_rows(kv, loop, state, store, init, window)


def _place(kv, loop, state: DecodeState, store: Prefix, prefix: Prefix, keep: tuple, init: dict):
    """A prefill's or resume's rows where they go, in the call that computed them: prefix rows
    ``keep[0]`` into store rows ``keep[1]``, logits included, and into slots (``_insert``).
    Entries past the end of the store or the slots are padding: a call that keeps or inserts
    nothing costs nothing on the CPU's row loop and one dropped scatter elsewhere."""
    src, dst = keep
    store = Prefix(
        logits=_copy_logits(store.logits, prefix.logits, src, dst, loop=loop),
        cache=_copy_rows(store.cache, prefix.cache, kv, src, dst, loop=loop),
    )
    return _insert_rows(kv, loop, state, prefix, init), store


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5, 6))
def _prefill_placed(graphdef, kv, loop, params, groups, state, store, tokens_PT, lengths_P, keep,
                    init):  # fmt: skip
    """``_prefill``, then ``_place`` of its rows: one call, one program, instead of three."""
    prefix = _prefill.__wrapped__(graphdef, params, groups, tokens_PT, lengths_P)
    return _place(kv, loop, state, store, prefix, keep, init)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6, 7))
def _resume_placed(graphdef, kv, kv_len, loop, params, groups, state, store: Prefix, rows_P,
                   start_P, tokens_PT, n_new_P, keep, init):  # fmt: skip
    """``_resume`` from store rows, then ``_place`` of its rows (into that same store)."""
    prefix = _resume.__wrapped__(graphdef, kv, kv_len, params, groups, store.cache, rows_P,
                                 start_P, tokens_PT, n_new_P)  # fmt: skip
    return _place(kv, loop, state, store, prefix, keep, init)


def _init_arrays(init: SlotInit) -> dict:
    """``insert``'s host arrays, as they go to the jitted call (its dispatch moves them to the
    device together, cheaper than one transfer each)."""
    return {
        "rows": np.asarray(init.rows, np.int32),
        "slots": np.asarray(init.slots, np.int32),
        "max_new": np.asarray(init.max_new, np.int32),
        "stop_ids": np.asarray(init.stop_ids, np.int32),
        "temperature": np.asarray(init.temperature, np.float32),
        "top_k": np.asarray(init.top_k, np.int32),
        "top_p": np.asarray(init.top_p, np.float32),
        "key": np.asarray(init.key, np.uint32),
    }


def _abstract(tree):
    """Shape, dtype and sharding of every array of ``tree``: a jitted step's arguments, for
    ``lower`` (None stays None)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _check_padding(name: str, dst, limit: int) -> None:
    """Row moves take the real entries (destination inside [0, limit)) first, padding (past the
    end) after them."""
    real = np.asarray(dst) < limit
    if real.size and not real[: int(real.sum())].all():
        raise ValueError(f"{name}: padding entries (past the end) must come after the real ones")


class DeviceEngine:
    """Jitted prefill / resume / insert / generate / park for one model and a fixed slot count.

    ``unroll``: generate (the decode loop) runs the layers unrolled over a per-group copy of the
    block weights (made on device at each ``set_params``) instead of scanning the stacked ones.
    XLA CPU copies a layer's weight slice out of the stack on every scan step, which for a decode
    step's few rows costs more than the matmuls; the copy doubles the block weights' memory, and
    compile time grows with depth. None = on where the default backend is the CPU. Prefill and
    resume always scan: a call's P x T tokens share each layer's copy, and a scanned shape
    compiles 2-4x faster (SmolLM2, 30 layers, one CPU core: 0.7-2.8 s against 2.5-6.7 s) and
    runs within -6 % to +11 % of the unrolled call, which matters because prompts meet many
    shapes (rows x length bucket x KV window) while decode meets a few
    (``benchmarks/bench_prompt_layers.py``).

    ``row_moves``: how rows move between slots and the store, ``"loop"`` (one row at a time) or
    ``"scatter"`` (all at once); None = the loop on the CPU, the scatter elsewhere (see
    ``_copy_rows``). ``hold_state=False``: no decode state or store is allocated; the caller
    passes its own state to the module's jitted steps (``jetstream_engine``)."""

    def __init__(
        self,
        model: Transformer,
        *,
        slots: int,
        max_len: int,
        cache_rows: int,
        steps: int = 8,
        max_top_k: int = 64,
        max_stop_ids: int = 8,
        unroll: bool | None = None,
        row_moves: str | None = None,
        hold_state: bool = True,
    ):
        self.cfg = model.cfg
        self.slots, self.max_len, self.cache_rows = slots, max_len, cache_rows
        self.steps, self.max_top_k, self.max_stop_ids = steps, max_top_k, max_stop_ids
        self.unroll = jax.default_backend() == "cpu" if unroll is None else bool(unroll)
        if row_moves is None:
            row_moves = "loop" if jax.default_backend() == "cpu" else "scatter"
        if row_moves not in ("loop", "scatter"):
            raise ValueError(f"row_moves must be 'loop', 'scatter' or None, got {row_moves!r}")
        self.row_moves = row_moves
        self.loop_moves = row_moves == "loop"
        self.graphdef, self.params = nnx.split(model)
        # The engine's layout: weights from elsewhere (a trainer's mesh) are moved into it on
        # device, so every compiled step keeps its input shardings and never recompiles.
        self.shardings = jax.tree.map(lambda a: a.sharding, self.params)
        # Committed arrays everywhere (weights, the decode state): a jitted call's signature then
        # stays the same from the first call on, whichever arrays the weights later come from.
        self.params = jax.device_put(self.params, self.shardings)
        devices = {d for sharding in jax.tree.leaves(self.shardings) for d in sharding.device_set}
        self.home_device = devices.pop() if len(devices) == 1 else None  # None: sharded weights
        self._home = None if self.home_device is None else on_device(self.home_device)
        self.groups = _split_groups(self.params) if self.unroll else None
        self.dtype = model.dtype  # of the weights and the decode state
        self.kv = _is_kv(self.cfg.layer_types[: self.cfg.period])
        self.signatures: dict[str, set] = {}  # distinct compiled shapes per function
        self.ahead: dict[tuple[str, tuple], Future] = {}  # a warm-up's compiles (warmup.py)
        # ``hold_state=False``: the caller holds the decode state (JetStream's orchestrator passes
        # it through every call) and there is no store.
        self.state = self.empty_state() if hold_state else None
        self.store = self.empty_store() if hold_state else None

    # -- state ---------------------------------------------------------------------------------
    def _commit(self, tree):
        return tree if self._home is None else jax.device_put(tree, self._home)

    def _init_cache(self, rows: int) -> DecodeCache:
        model = nnx.merge(self.graphdef, self.params)
        return self._commit(model.init_cache(rows, self.max_len))

    def empty_state(self) -> DecodeState:
        B = self.slots
        return self._commit(DecodeState(
            cache=self._init_cache(B),
            logits=jnp.zeros((B, self.cfg.vocab_size), jnp.float32),
            count=jnp.zeros((B,), jnp.int32),
            max_new=jnp.zeros((B,), jnp.int32),
            active=jnp.zeros((B,), bool),
            stop_ids=jnp.full((B, self.max_stop_ids), -1, jnp.int32),
            sampling=SlotSampling.zeros(B),
        ))  # fmt: skip

    def empty_store(self) -> Prefix:
        """The prefix cache's rows (at least one, so shapes stay valid with caching off)."""
        rows = max(self.cache_rows, 1)
        return self._commit(Prefix(
            logits=jnp.zeros((rows, self.cfg.vocab_size), jnp.float32),
            cache=self._init_cache(rows),
        ))  # fmt: skip

    def set_params(self, params) -> None:
        """New weights (an ``nnx.State`` of the same structure, or a model). Arrays already in the
        engine's layout and dtype are used as they are; others (e.g. a trainer's fp32 FSDP shards)
        are cast and resharded device to device into it, never through the host, so nothing
        recompiles."""
        if isinstance(params, nnx.Module):
            _, params = nnx.split(params)
        old_paths = jax.tree_util.tree_flatten_with_path(self.params)[0]
        new_paths = jax.tree_util.tree_flatten_with_path(params)[0]
        if [p for p, _ in old_paths] != [p for p, _ in new_paths]:
            missing = {jax.tree_util.keystr(p) for p, _ in old_paths} ^ {
                jax.tree_util.keystr(p) for p, _ in new_paths
            }
            raise ValueError(
                f"new weights differ in structure from the engine's: {sorted(missing)[:5]}"
            )
        for (path, old), (_, new) in zip(old_paths, new_paths, strict=True):
            if tuple(old.shape) != tuple(new.shape):
                raise ValueError(
                    f"new weight {jax.tree_util.keystr(path)} has shape {tuple(new.shape)}, "
                    f"the engine's has {tuple(old.shape)}"
                )
        # A trainer's fp32 master weights into a bf16 engine: cast where they lie, then move.
        params = jax.tree.map(
            lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype),
            params,
            self.params,
        )
        self.params = jax.device_put(params, self.shardings)
        self.groups = _split_groups(self.params) if self.unroll else None

    def note(self, name: str, *shapes) -> None:
        """Records a compiled shape of ``name`` (``compile_counts``), before its call: a warm-up
        compile of that shape still queued is dropped (the call compiles it now), one under way
        is waited for (warmup.WarmUp)."""
        ahead = self.ahead.get((name, shapes))
        if ahead is not None and not ahead.done() and not ahead.cancel():
            ahead.result()
        self.signatures.setdefault(name, set()).add(shapes)

    @property
    def compile_counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.signatures.items()}

    # -- the steps -------------------------------------------------------------------------------
    def prefill(self, tokens_PT, lengths_P, keep, init: SlotInit) -> None:
        """Prefills P fresh prompts and, in the same call, keeps prefix rows ``keep[0]`` in
        store rows ``keep[1]`` and fills slots from prefix rows (``init``); index entries past
        the end of the store or the slots are padding."""
        self.note("prefill", tokens_PT.shape)
        self.state, self.store = _prefill_placed(
            self.graphdef, self.kv, self.loop_moves, self.params, None, self.state, self.store,
            tokens_PT, lengths_P, self._places(keep, init), _init_arrays(init),
        )  # fmt: skip

    def resume(self, rows_P, start_P, tokens_PT, n_new_P, kv_len: int | None, keep,
               init: SlotInit) -> None:  # fmt: skip
        """Continues store rows, from their first ``start_P`` positions (a row's whole length,
        or less where every layer is attention: ``partial_resume``), by their new tokens, and
        places the results as ``prefill`` does; ``kv_len`` bounds every row's length after them
        (None: the whole capacity)."""
        kv_len = self.max_len if kv_len is None else min(kv_len, self.max_len)
        self.note("resume", tokens_PT.shape, kv_len)
        self.state, self.store = _resume_placed(
            self.graphdef, self.kv, kv_len, self.loop_moves, self.params, None, self.state,
            self.store, rows_P, np.asarray(start_P, np.int32), tokens_PT, n_new_P,
            self._places(keep, init), _init_arrays(init),
        )  # fmt: skip

    def _places(self, keep, init: SlotInit) -> tuple[np.ndarray, np.ndarray]:
        """``keep`` as the call's index arrays, once both its store rows and ``init``'s slots
        are checked (padding after the real entries)."""
        src, dst = (np.asarray(x, np.int32) for x in keep)
        _check_padding("keep", dst, self.store.logits.shape[0])
        _check_padding("insert", init.slots, self.slots)
        return src, dst

    @property
    def partial_resume(self) -> bool:
        """Every layer is attention: a kept row serves any prefix of its tokens."""
        return all(self.kv)

    def insert(self, init: SlotInit, window: int | None = None) -> None:
        """Fills slots from store rows (whole prompts kept with their logits), copying their
        first ``window`` positions (a bucket bounding the rows' lengths)."""
        _check_padding("insert", init.slots, self.slots)
        window = self.max_len if window is None else min(window, self.max_len)
        self.note("insert_stored", window, len(init.rows))
        self.state = _insert_stored(self.kv, self.loop_moves, window, self.state, self.store,
                                    _init_arrays(init))  # fmt: skip

    def generate(self, occupied_B, kv_len: int | None = None, min_active: int = 0) -> Array:
        """Advances every occupied, active slot by up to ``steps`` tokens; returns [B, steps] ids
        (-1 where a slot drew nothing). ``kv_len`` must bound every occupied slot's cache length
        after the call (the host knows it); None reads the whole capacity. The call returns early
        once at most ``min_active`` slots are still active (0: when all have stopped)."""
        kv_len = self.max_len if kv_len is None else min(kv_len, self.max_len)
        self.note("generate", self.slots, kv_len)
        self.state, out = _generate(
            self.graphdef,
            self.kv,
            self.steps,
            self.max_top_k,
            kv_len,
            self.params,
            self.groups,
            self.state,
            np.asarray(occupied_B, bool),
            np.int32(min_active),
        )
        return out

    def park(self, slots_M, rows_M, window: int | None = None) -> None:
        """Keeps finished slots' decode state (the first ``window`` positions) in store rows."""
        window = self.max_len if window is None else min(window, self.max_len)
        _check_padding("park", rows_M, self.store.logits.shape[0])
        self.note("park", len(slots_M), window)
        self.store = _park(
            self.kv, self.loop_moves, window, self.store, self.state.cache,
            np.asarray(slots_M, np.int32), np.asarray(rows_M, np.int32),
        )  # fmt: skip

    # -- ahead-of-time compiles -----------------------------------------------------------------
    def compile_ahead(self, name: str, signature: tuple):
        """Compiles step ``name`` for ``signature`` (as ``note`` records it) without running it:
        the abstract arguments carry the shardings the real call's arrays have, so a later call
        with that signature finds the program in jax's cache and runs it at once (and the
        persistent compilation cache, where it is on, keeps it for the next process). Returns the
        compiled program (its ``memory_analysis``: benchmarks, tests)."""
        i32 = jnp.int32

        def arg(shape, dtype=i32):  # a host array of the call (numpy: no sharding of its own)
            return jax.ShapeDtypeStruct(tuple(shape), dtype)

        def init(m):
            return {"rows": arg((m,)), "slots": arg((m,)), "max_new": arg((m,)),
                    "stop_ids": arg((m, self.max_stop_ids)), "temperature": arg((m,), jnp.float32),
                    "top_k": arg((m,)), "top_p": arg((m,), jnp.float32),
                    "key": arg((m, 2), jnp.uint32)}  # fmt: skip

        params, kv, loop = _abstract(self.params), self.kv, self.loop_moves
        state, store = _abstract(self.state), _abstract(self.store)
        if name == "prefill":
            ((P, T),) = signature
            lowered = _prefill_placed.lower(
                self.graphdef, kv, loop, params, None, state, store, arg((P, T)), arg((P,)),
                (arg((P,)), arg((P,))), init(self.slots),
            )  # fmt: skip
        elif name == "resume":
            (P, T), kv_len = signature
            lowered = _resume_placed.lower(
                self.graphdef, kv, kv_len, loop, params, None, state, store, arg((P,)),
                arg((P,)), arg((P, T)), arg((P,)), (arg((P,)), arg((P,))), init(self.slots),
            )  # fmt: skip
        elif name == "generate":
            B, kv_len = signature
            lowered = _generate.lower(
                self.graphdef, kv, self.steps, self.max_top_k, kv_len, params,
                _abstract(self.groups), state, arg((B,), bool), arg(()),
            )  # fmt: skip
        elif name == "park":
            M, window = signature
            lowered = _park.lower(kv, loop, window, store, _abstract(self.state.cache), arg((M,)),
                                  arg((M,)))  # fmt: skip
        elif name == "insert_stored":
            window, M = signature
            lowered = _insert_stored.lower(kv, loop, window, state, store, init(M))
        else:
            raise ValueError(f"no engine step {name!r}")
        return lowered.compile()

    # -- memory ----------------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        return cache_bytes_per_slot(self.cfg, self.max_len, self.dtype)


def cache_bytes_per_slot(cfg, max_len: int, dtype=jnp.float32) -> int:
    """Decode-state bytes one slot holds: KV for every full-attention layer at ``max_len``, the
    GDN conv window and fp32 state, and the held logits."""
    item = jnp.dtype(dtype).itemsize
    total = cfg.vocab_size * 4
    for kind in cfg.layer_types:
        if kind == FULL:
            total += 2 * max_len * cfg.num_kv_heads * cfg.head_dim * item
        else:
            total += (cfg.linear_conv_kernel - 1) * cfg.gdn_conv_dim * item
            total += (
                cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
            )
    return total


def prompt_call_bytes(
    cfg, rows: int, new: int, window: int, dtype=jnp.float32, *, resume: bool = False,
    moved: int = 0,
) -> int:  # fmt: skip
    """An upper estimate of the device memory one prefill (``window`` = ``new``) or resume call
    of ``rows`` rows x ``new`` new tokens over a KV window of ``window`` positions allocates
    beyond the weights and the engine's state: the prefix it returns (each row's state at the
    window, and its logits; a resume's gathered rows beside it), one layer's activations with
    its fp32 attention scores and probabilities over the whole window (the causal blocks of a
    prefill read about half of it) or a Gated DeltaNet layer's fp32 chunk arrays, and one layer
    group's weights (a scan step may copy them out of the stack); with ``moved``, as many rows
    of the window gathered at once (the accelerators' scatter row moves, which keep and insert
    the call's rows in the same call: one per store row and slot entry, padding included; the
    CPU's loop moves a row at a time and gathers none). XLA's own count for such a
    call on the CPU (``memory_analysis``: temporaries plus outputs) stays below it in fp32:
    tests/engine/test_prompt_budget.py. It counts what grows with the call's rows, tokens and
    window; fixed costs of well under a MiB can exceed it on the smallest calls, and XLA:CPU
    computes in fp32 what a bf16 model does elsewhere (each call converts the weights it reads),
    which no split of the call would help."""
    item = jnp.dtype(dtype).itemsize
    f32 = 4
    tokens = rows * new
    out = (rows * (2 if resume else 1) + moved) * cache_bytes_per_slot(cfg, window, dtype)
    d, f = cfg.hidden_size, cfg.intermediate_size
    layer = tokens * (4 * d + 3 * f) * item  # the residual stream and the SwiGLU
    kinds = set(cfg.layer_types)
    if FULL in kinds:
        h, n, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = tokens * (h * k * (2 if cfg.attn_output_gate else 1) + 2 * n * k + h * k) * item
        # A prefill's causal blocks (``layers.causal_attention``: at most 16) read about half
        # the window.
        block = max(ATTENTION_BLOCK, -(-window // 16))
        span = window if resume else (window + block) // 2
        scores = 2 * rows * h * new * min(span, window) * f32
        layer = max(layer, qkv + scores + tokens * 2 * d * item)
    if kinds - {FULL}:
        chunk = min(CHUNK, new)
        hv = cfg.linear_num_value_heads
        arrays = tokens * (3 * cfg.gdn_conv_dim + 2 * cfg.gdn_value_dim + 4 * hv) * f32
        intra = 3 * rows * hv * new * chunk * f32
        states = rows * hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim * f32 * 2
        layer = max(layer, arrays + intra + states + tokens * 2 * d * item)
    group = cfg.num_params() - cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    group = group // max(cfg.num_groups, 1) * item
    # A quarter over: buffers of XLA's fusions that the count above leaves out.
    return int(1.25 * (out + layer + group))


def free_device_bytes(device=None) -> int | None:
    """Free memory of an accelerator (``memory_stats``), or the host's available memory on CPU."""
    device = device or jax.local_devices()[0]  # another host's devices have no stats here
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def auto_cache_rows(
    cfg, max_len: int, *, slots: int, episodes: int, free_bytes: int | None,
    dtype=jnp.float32, share: float = 0.25, per_episode: int = 2,
) -> int:  # fmt: skip
    """Prefix-cache rows for ``episodes`` in flight: ``per_episode`` each (a session parks its
    decode state between turns, and a state evicted there is prefilled again; the prompts and
    snapshot points the episodes share take rows beside the parked states: with one row per
    episode a 128-episode session workload still evicted 439 times and prefilled 1.3x its
    unique tokens, with two 177 times and 0.6x), fewer where they would take more than
    ``share`` of the memory ``free_bytes`` leaves once the engine's ``slots`` are resident,
    never fewer than ``slots`` (the engine's own default)."""
    if free_bytes is None:
        return slots
    per_row = cache_bytes_per_slot(cfg, max_len, dtype)
    fit = int((free_bytes - slots * per_row) * share // per_row)
    return max(slots, min(per_episode * episodes, fit))


def max_slots(
    cfg, max_len: int, *, free_bytes: int, dtype=jnp.float32, cache_ratio: float = 1.0,
    reserve: float = 0.1,
) -> int:  # fmt: skip
    """How many decode slots fit in ``free_bytes`` (after the weights are resident): each slot
    holds its decode state plus ``cache_ratio`` of a kept state (prefix cache rows per slot), and ``reserve`` of the
    memory is left for activations of prefill and the sampler."""
    per_slot = cache_bytes_per_slot(cfg, max_len, dtype) * (1.0 + cache_ratio)
    return max(0, int(free_bytes * (1.0 - reserve) // per_slot))
