"""Packing: several rows in one sequence compute exactly what each computes alone."""

import jax.numpy as jnp
import numpy as np
import pytest

import whale_jax
from whale_jax.train.packing import microbatches, pack_sequences, pad_fraction
from whale_jax.train.rows import Row


def row(ids, mask=None, episode=0):
    ids = tuple(int(i) for i in ids)
    mask = tuple(bool(m) for m in (mask if mask is not None else [True] * len(ids)))
    return Row(ids=ids, mask=mask, episode=episode, task_id="t", session_id="s")


@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_llama"])
def test_packed_rows_equal_rows_alone(fixtures_dir, name):
    model, cfg, _ = whale_jax.load_model(fixtures_dir / name)
    rng = np.random.default_rng(0)
    # 70 tokens cross a 64-token GDN chunk boundary; 5 tokens is shorter than the conv window.
    rows = [rng.integers(0, cfg.vocab_size, n) for n in (37, 5, 70)]
    (mb,) = microbatches([row(r) for r in rows], seq_len=128, micro_tokens=128)
    assert mb.tokens.shape == (1, 128)
    logits = np.asarray(
        model.logits(model.hidden(jnp.asarray(mb.tokens), segments_BT=jnp.asarray(mb.segments)))
    )
    by_length = {len(r): r for r in rows}
    for seg in (1, 2, 3):
        where = np.where(mb.segments[0] == seg)[0]
        r = by_length[len(where)]
        assert np.array_equal(mb.tokens[0, where], r)
        alone = np.asarray(model(jnp.asarray(r[None])))[0]
        # Same arithmetic reordered (attention over a longer masked row, chunk boundaries moved):
        # fp32 rounding of logits of size ~4, relative to the largest.
        scale = np.abs(alone).max()
        assert np.abs(logits[0, where] - alone).max() <= 2e-5 * scale


def test_first_fit_decreasing_keeps_every_row_once():
    rows = [row(range(n), episode=i) for i, n in enumerate([50, 30, 20, 64, 10, 1, 40])]
    bins = pack_sequences(rows, 64)
    assert sorted(r.episode for b in bins for r in b) == list(range(7))
    assert all(sum(len(r.ids) for r in b) <= 64 for b in bins)
    assert len(bins) == 4  # 215 tokens need at least 4 sequences of 64
    with pytest.raises(ValueError, match="longer than seq_len"):
        pack_sequences([row(range(65))], 64)


def test_microbatch_shapes_padding_and_pad_fraction():
    rows = [row(range(n), mask=[False] * (n - 2) + [True] * 2) for n in [50, 30, 20, 64, 10]]
    packed = microbatches(rows, seq_len=64, micro_tokens=128, batch_multiple=4)
    assert {b.tokens.shape for b in packed} == {(4, 64)}  # 2 per microbatch, rounded up to 4
    assert sum(b.trained_tokens for b in packed) == 10
    assert sum(b.real_tokens for b in packed) == 174
    assert pad_fraction(packed) == pytest.approx(1 - 174 / (len(packed) * 256))
    bucketed = microbatches(rows, seq_len=64, micro_tokens=128, pack=False, min_bucket=16)
    assert {b.tokens.shape[1] for b in bucketed} == {16, 32, 64}
    assert sum(b.real_tokens for b in bucketed) == 174
    padded = microbatches(rows, seq_len=64, micro_tokens=128, min_microbatches=5)
    assert len(padded) == 5 and padded[-1].real_tokens == 0


def test_loss_positions_are_the_trained_predictions_in_order_with_few_widths():
    from whale_jax.train.packing import pick_predictions, pick_width, trained_predictions

    segments = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    mask = np.array([[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0]], bool)
    pred = trained_predictions(segments, mask)
    # Row 0: 0->1, 1->2 in segment 1; 3 starts segment 2 (not predicted); 3->4, 4->5. Row 1: 4, 5.
    assert np.flatnonzero(pred[0]).tolist() == [0, 1, 3, 4]
    assert np.flatnonzero(pred[1]).tolist() == [4, 5]
    assert pick_width(pred, buckets=4) == 4  # longest row 4, quantum 8 / 4 = 2
    assert pick_width(pred, buckets=2) == 4  # quantum 4
    assert pick_width(pred, buckets=1) == 8  # one width: the whole sequence
    pick, weight = pick_predictions(pred, 6)
    assert pick.tolist() == [[0, 1, 3, 4, 0, 0], [4, 5, 0, 0, 0, 0]]
    assert weight.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    for bad in (3, 9):  # below a row's count, above the sequence length
        with pytest.raises(ValueError, match="width"):
            pick_predictions(pred, bad)
