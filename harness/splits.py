"""Disjoint splits fixed by a seed: every item is ranked by a keyed hash of its identity (a
problem's text, a puzzle's start position), and the ranked list is cut into named slices. Items
sharing a key always land in the same split, and adding a new item never moves an old one
between the fixed-size splits unless it ranks before them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def key_rank(key: str, seed: int) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest(), "big"
    )


def split_by_hash(
    items: Sequence[T],
    key: Callable[[T], str],
    *,
    seed: int,
    sizes: dict[str, int],
    rest: str = "train",
) -> dict[str, list[T]]:
    """``sizes`` are filled in order (counted in items, whole key groups at a time); everything left
    goes to ``rest``. A fixed-size split takes a group only if it fits: sizes are upper bounds."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    ranked = sorted(groups, key=lambda k: (key_rank(k, seed), k))
    out: dict[str, list[T]] = {name: [] for name in sizes}
    out.setdefault(rest, [])
    names = list(sizes)
    i = 0
    for k in ranked:
        group = groups[k]
        while i < len(names) and len(out[names[i]]) >= sizes[names[i]]:
            i += 1
        if i < len(names) and len(out[names[i]]) + len(group) <= sizes[names[i]]:
            out[names[i]].extend(group)
        else:
            out[rest].extend(group)
    return out
