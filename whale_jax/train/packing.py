"""Rows into fixed-shape microbatches: packed (the default) or bucketed by length.

RSFT rows are short and uneven (one 40-token turn next to a sixteen-turn session), so padding each
row to the longest wastes most of a batch. Two layouts, both ending in arrays of
``[sequences, length]`` whose sequence count is a multiple of the batch shards:

- **packed**: rows go first-fit-decreasing into sequences of ``seq_len`` tokens, told apart by
  segment ids (1, 2, ... within a sequence; 0 = pad). The model reads segments
  (``Transformer.hidden(segments_BT=...)``), so a packed row computes exactly what it computes
  alone. One sequence length for every microbatch.
- **bucketed**: one row per sequence, padded to a power-of-two length bucket; rows sorted by
  length so a microbatch holds similar lengths. One compile per bucket in use.

Each microbatch holds at most ``micro_tokens`` token positions (gradient accumulation runs over
the microbatches of a minibatch); a microbatch that is not full shrinks to the next power-of-two
sequence count, so a small minibatch does not pay for a full one and shapes stay few. docs/benchmarks.md records the pad fraction and speed of both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from whale_jax.train.rows import Row


def trained_predictions(segments_BT: np.ndarray, mask_BT: np.ndarray) -> np.ndarray:
    """[B, T] bool, on the host: position t's prediction of token t+1 is trained (t+1 is masked
    in and in t's segment, t is not a pad). The one definition of what the loss counts."""
    segments_BT, mask_BT = np.asarray(segments_BT), np.asarray(mask_BT, bool)
    out = np.zeros(segments_BT.shape, bool)
    same = segments_BT[:, 1:] == segments_BT[:, :-1]
    out[:, :-1] = mask_BT[:, 1:] & same & (segments_BT[:, :-1] > 0)
    return out


def pick_width(pred_BT: np.ndarray, buckets: int = 4) -> int:
    """P for ``pick_predictions`` from ``trained_predictions``: the longest row's count of
    predicting positions rounded up to a multiple of T / ``buckets`` (at most ``buckets`` loss
    shapes per sequence length)."""
    T = pred_BT.shape[1]
    quantum = max(-(-T // max(buckets, 1)), 1)
    longest = int(pred_BT.sum(1).max(initial=0))
    return min(max(-(-longest // quantum), 1) * quantum, T)


def pick_predictions(pred_BT: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(pick_BP int32, weight_BP float32) with P = ``width`` (at least ``pick_width``; hosts agree
    on one) from ``trained_predictions``: each row's predicting positions in order, then pads
    (index 0, weight 0)."""
    if width < int(pred_BT.sum(1).max(initial=0)) or width > pred_BT.shape[1]:
        raise ValueError(
            f"width {width} must lie between the largest row count of trained predictions "
            f"and the sequence length {pred_BT.shape[1]}"
        )
    order_BT = np.argsort(~pred_BT, axis=1, kind="stable")[:, :width]  # trained first, in order
    weight_BP = np.take_along_axis(pred_BT, order_BT, axis=1)
    pick_BP = np.where(weight_BP, order_BT, 0).astype(np.int32)
    return pick_BP, weight_BP.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """``tokens``, ``segments`` (0 = pad), ``mask`` (trained tokens): int32/int32/bool
    ``[sequences, length]``."""

    tokens: np.ndarray
    segments: np.ndarray
    mask: np.ndarray

    @functools.cached_property
    def predictions(self) -> np.ndarray:
        """``trained_predictions`` of this microbatch (computed once)."""
        return trained_predictions(self.segments, self.mask)

    @property
    def trained_tokens(self) -> int:
        """Trained tokens that something predicts: masked in and not the first of a segment (the
        loss's count)."""
        return int(self.predictions.sum())

    def pick_width(self, buckets: int = 4) -> int:
        return pick_width(self.predictions, buckets)

    def picks(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The loss's predicting positions per sequence (``pick_predictions``)."""
        return pick_predictions(self.predictions, width)

    @property
    def real_tokens(self) -> int:
        return int((self.segments > 0).sum())

    @property
    def positions(self) -> int:
        return int(self.tokens.size)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _shrink(n: int, full: int, multiple: int) -> int:
    """Sequences in a microbatch of ``n`` real ones: ``full`` when it is full, else the next
    power-of-two multiple of ``multiple`` (a few shapes, not one per count; little padding)."""
    size = multiple
    while size < n:
        size *= 2
    return min(size, full)


def _fill(sequences: list[list[Row]], length: int) -> Microbatch:
    S = len(sequences)
    tokens = np.zeros((S, length), np.int32)
    segments = np.zeros((S, length), np.int32)
    mask = np.zeros((S, length), bool)
    for s, rows in enumerate(sequences):
        at = 0
        for i, row in enumerate(rows):
            n = len(row.ids)
            tokens[s, at : at + n] = row.ids
            segments[s, at : at + n] = i + 1
            mask[s, at : at + n] = row.mask
            at += n
    return Microbatch(tokens, segments, mask)


def pack_sequences(rows: Sequence[Row], seq_len: int) -> list[list[Row]]:
    """First-fit decreasing: longest rows first, each into the first sequence with room. Rows must
    be at most ``seq_len`` long (``rows_from_records`` cuts them)."""
    bins: list[list[Row]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -len(r.ids)):
        n = len(row.ids)
        if n > seq_len:
            raise ValueError(f"row of {n} tokens is longer than seq_len {seq_len}")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(row)
                room[b] -= n
                break
        else:
            bins.append([row])
            room.append(seq_len - n)
    return bins


def microbatches(
    rows: Sequence[Row],
    *,
    seq_len: int,
    micro_tokens: int,
    pack: bool = True,
    batch_multiple: int = 1,
    min_bucket: int = 64,
    min_microbatches: int = 0,
) -> list[Microbatch]:
    """The microbatches of one optimizer step over ``rows``. ``batch_multiple``: the number of
    batch shards (sequence counts are padded to a multiple of it with empty sequences);
    ``min_microbatches``: pad with empty microbatches up to this count (hosts with fewer rows
    than others run the same number of steps)."""
    if micro_tokens < seq_len and pack:
        raise ValueError(f"micro_tokens ({micro_tokens}) must hold one sequence of {seq_len}")
    out: list[Microbatch] = []
    if pack:
        per_micro = _round_up(max(micro_tokens // seq_len, 1), batch_multiple)
        bins = pack_sequences(rows, seq_len)
        for start in range(0, len(bins), per_micro):
            chunk = bins[start : start + per_micro]
            size = _shrink(len(chunk), per_micro, batch_multiple)
            out.append(_fill(chunk + [[]] * (size - len(chunk)), seq_len))
        empty = _fill([[]] * batch_multiple, seq_len)
    else:
        by_bucket: dict[int, list[Row]] = {}
        for row in sorted(rows, key=lambda r: len(r.ids)):
            bucket = min_bucket
            while bucket < len(row.ids):
                bucket *= 2
            if len(row.ids) > seq_len:
                raise ValueError(f"row of {len(row.ids)} tokens is longer than seq_len {seq_len}")
            by_bucket.setdefault(min(bucket, seq_len), []).append(row)
        for bucket, group in sorted(by_bucket.items()):
            per_micro = _round_up(max(micro_tokens // bucket, 1), batch_multiple)
            for start in range(0, len(group), per_micro):
                chunk = [[r] for r in group[start : start + per_micro]]
                size = _shrink(len(chunk), per_micro, batch_multiple)
                out.append(_fill(chunk + [[]] * (size - len(chunk)), bucket))
        empty = _fill([[]] * batch_multiple, min(min_bucket, seq_len))
    out += [empty] * max(0, min_microbatches - len(out))
    return out


def pad_fraction(batches: Sequence[Microbatch]) -> float:
    """Share of token positions that hold no row (the work a step spends on padding)."""
    positions = sum(b.positions for b in batches)
    return 0.0 if positions == 0 else 1.0 - sum(b.real_tokens for b in batches) / positions
