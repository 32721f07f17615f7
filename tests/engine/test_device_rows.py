"""Moving decode-state rows between the slots and the store (``device._copy_rows``,
``_copy_logits`` and ``_gather_rows``): exact copies of the named rows and positions, nothing else
touched, padding entries (past the end, after the real ones) a no-op; a row at a time (``loop``,
the CPU's) and all at once (``scatter``, the accelerators') alike."""

import jax.numpy as jnp
import numpy as np
import pytest

from whale_jax.engine import device
from whale_jax.models.transformer import DecodeCache

KV = (True, False)  # one full-attention block and one recurrent block per period


def cache(rows: int, capacity: int, seed: int) -> DecodeCache:
    r = np.random.default_rng(seed)
    G, N, K = 2, 2, 4
    kv = tuple(jnp.asarray(r.normal(size=(G, rows, N, capacity, K)), jnp.float32) for _ in "kv")
    rec = (
        jnp.asarray(r.normal(size=(G, rows, 3, 5)), jnp.float32),
        jnp.asarray(r.normal(size=(G, rows, N, K, K)), jnp.float32),
    )
    lengths = jnp.asarray(r.integers(0, capacity, rows), jnp.int32)
    return DecodeCache(lengths=lengths, layers=(kv, rec))


def expected_copy(dst, src, src_rows, dst_rows, window):
    out = [[np.array(x) for x in pair] for pair in dst.layers]
    lengths = np.array(dst.lengths)
    for s_row, d_row in zip(src_rows, dst_rows, strict=True):
        if d_row >= lengths.shape[0]:
            continue
        for is_kv, o_pair, s_pair in zip(KV, out, src.layers, strict=True):
            for o, s in zip(o_pair, s_pair, strict=True):
                s = np.asarray(s)
                if is_kv:
                    n = min(window or s.shape[3], s.shape[3], o.shape[3])
                    o[:, d_row, :, :n] = s[:, s_row, :, :n]
                else:
                    o[:, d_row] = s[:, s_row]
        lengths[d_row] = int(src.lengths[s_row])
    return out, lengths


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "scatter"])
@pytest.mark.parametrize(
    "src_rows, dst_rows, window, src_capacity",
    [
        ([3, 0, 5], [6, 2, 7], None, 16),  # every row real; the last dst row among them
        ([1, 4, 0, 0], [7, 3, 8, 8], 8, 16),  # two padding entries (dst 8 = past the end)
        ([2, 1], [0, 9], 4, 16),  # one padding entry (a clamped write would hit row 7)
        ([1, 0], [5, 6], None, 8),  # a shorter source fills the front of each row
    ],
)
def test_copy_rows_moves_exactly_the_named_rows(src_rows, dst_rows, window, src_capacity, loop):
    dst, src = cache(8, 16, 0), cache(6, src_capacity, 1)
    want, want_lengths = expected_copy(dst, src, src_rows, dst_rows, window)
    got = device._copy_rows(
        dst,
        src,
        KV,
        jnp.asarray(src_rows, jnp.int32),
        jnp.asarray(dst_rows, jnp.int32),
        window,
        loop=loop,
    )
    np.testing.assert_array_equal(np.asarray(got.lengths), want_lengths)
    for got_pair, want_pair in zip(got.layers, want, strict=True):
        for g, w in zip(got_pair, want_pair, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "scatter"])
def test_copy_logits_moves_exactly_the_named_rows(loop):
    r = np.random.default_rng(3)
    dst = r.normal(size=(8, 5)).astype(np.float32)
    src = r.normal(size=(4, 5)).astype(np.float32)
    src_rows, dst_rows = [2, 0, 3, 0], [7, 1, 8, 8]  # two padding entries (dst 8: past the end)
    want = dst.copy()
    want[7], want[1] = src[2], src[0]
    got = device._copy_logits(jnp.asarray(dst), jnp.asarray(src), jnp.asarray(src_rows),
                              jnp.asarray(dst_rows), loop=loop)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), want)


def test_gather_rows_takes_rows_and_a_window():
    src = cache(6, 16, 2)
    rows = [4, 0, 4]
    got = device._gather_rows(src, KV, jnp.asarray(rows, jnp.int32), 8)
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(src.lengths)[rows])
    k, v = (np.asarray(x) for x in src.layers[0])
    np.testing.assert_array_equal(np.asarray(got.layers[0][0]), k[:, rows, :, :8])
    np.testing.assert_array_equal(np.asarray(got.layers[0][1]), v[:, rows, :, :8])
    for g, s in zip(got.layers[1], src.layers[1], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s)[:, rows])


def test_padding_before_a_real_entry_is_refused(tiny_llama):
    engine = device.DeviceEngine(tiny_llama.model, slots=2, max_len=32, cache_rows=2)
    with pytest.raises(ValueError, match="park: padding entries .* must come after"):
        engine.park([0, 1], [2, 0], 16)  # store rows 0..1: 2 is padding
    init = device.SlotInit(rows=[0, 0], slots=[2, 1], max_new=[1, 1], stop_ids=[[-1] * 8] * 2,
                           temperature=[0.0] * 2, top_k=[0] * 2, top_p=[1.0] * 2,
                           key=[[0, 0]] * 2)  # fmt: skip
    with pytest.raises(ValueError, match="insert: padding entries"):
        engine.insert(init, 16)


def test_an_unknown_row_move_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="row_moves must be 'loop', 'scatter' or None"):
        device.DeviceEngine(tiny_llama.model, slots=2, max_len=32, cache_rows=2, row_moves="gather")
