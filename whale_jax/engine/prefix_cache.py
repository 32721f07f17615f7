"""The host-side index of the engine's prefix cache: which token prefixes have a decode state in
which row of the device store, least recently used first.

One store serves every reuse of a computed state: a session's parked state (prompt + completion,
all but the last sampled token), the state at a snapshot point of a prompt (a message boundary the
client marked, a prefix that several prompts share) and a whole prompt (its last-token logits kept
too, so n samples or k votes of one prompt need no prefill at all). An entry is keyed by its exact
token ids: a request may continue from any entry whose tokens start its prompt, whoever made it.

With ``partial`` (a model whose layers are all attention), an entry also serves any prefix of
its key: a row's first d positions are the KV of its first d tokens. A recurrent state cannot be
cut back, so on hybrid models only exact keys serve.

Rows are pinned while an admission reads them (``pin``/``unpin``). Eviction is LRU in two tiers:
an entry kept on speculation (a whole prompt another sample or vote of it may repeat, a parked
session whose next turn may come) is *cold* until a request continues from it; a snapshot point
(a message boundary, a branch point) and any entry that has been hit are *hot*. A row is taken
from the least recently used cold entry first; a speculative entry may only displace cold ones,
so unique prompts passing through never push out the shared prefixes that will be read again. A
parked state is dropped once its session asks for a prompt that does not continue it
(``supersede``). ``shared_depth`` says how deep, in whole ``block``-token steps, a prompt shares
a prefix with any entry: where a prompt runs along a cached prompt and then departs, the engine
snapshots it at that depth so the next such prompt hits (a radix tree's branch points, rounded
down to blocks so that near-identical points do not each cost a prefill call).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

Tokens = tuple[int, ...]


@dataclasses.dataclass
class Entry:
    key: Tokens
    row: int
    logits: bool  # the store row holds the logits after the last key token (a whole prompt)
    hot: bool = False  # a snapshot point, or hit since it was kept
    owner: str | None = None  # the session that parked it (dropped by ``forget``)
    pins: int = 0


class PrefixIndex:
    """LRU index of ``rows`` store rows (0 rows: nothing is ever kept)."""

    def __init__(
        self, rows: int, *, block: int = 16, hot_fraction: float = 0.5, partial: bool = False
    ):
        if rows < 0 or block < 1 or not 0.0 <= hot_fraction <= 1.0:
            raise ValueError(
                f"need rows >= 0, block >= 1, 0 <= hot_fraction <= 1; got {rows}, {block}, "
                f"{hot_fraction}"
            )
        self.rows, self.block, self.partial = rows, block, partial
        self.hot_limit = int(rows * hot_fraction)
        self._hot = 0
        self._entries: collections.OrderedDict[Tokens, Entry] = collections.OrderedDict()
        self._by_len: dict[int, set[Tokens]] = collections.defaultdict(set)
        self._owners: dict[str, Tokens] = {}
        # Each whole-block prefix of a key -> the keys that start with it.
        self._under: dict[Tokens, set[Tokens]] = {}
        self._free = list(range(rows - 1, -1, -1))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Tokens) -> bool:
        return key in self._entries

    def get(self, key: Tokens) -> Entry | None:
        return self._entries.get(key)

    # -- lookup ----------------------------------------------------------------------------------
    def lookup(self, prompt: Tokens) -> tuple[Entry | None, int]:
        """The entry a request for ``prompt`` continues from and how many prompt tokens it serves
        ((None, 0): none). An entry serves its whole key when the key is a proper prefix of the
        prompt, or the whole prompt with its logits kept; with ``partial``, also any prefix of
        its key the prompt starts with, short of the prompt's last token (whose logits are
        needed). The deepest wins. Marks it recently used."""
        best, depth = self._deepest(prompt, len(prompt) - 1)
        if best is not None:
            self.touch(best)
        return best, depth

    def served(self, tokens: Tokens) -> int:
        """How many of ``tokens`` a prompt that goes on past them could continue from (what a
        state kept for exactly these tokens would add to the cache is the rest). Touches
        nothing."""
        return self._deepest(tokens, len(tokens))[1]

    def _deepest(self, prompt: Tokens, limit: int) -> tuple[Entry | None, int]:
        """The deepest entry serving ``prompt`` and its depth: an exact key of at most ``limit``
        tokens, or the whole prompt if its entry kept logits; with ``partial``, a prefix of any
        key, at most ``limit`` tokens deep."""
        n = len(prompt)
        best, depth = None, 0
        for length in sorted((k for k in self._by_len if k <= n), reverse=True):
            key = prompt if length == n else prompt[:length]
            entry = self._entries.get(key)
            if entry is not None and (length <= limit or entry.logits):
                best, depth = entry, length
                break
        if self.partial and depth < limit:
            shared = self.shared_depth(prompt)
            # Keys under the deepest shared block run along the prompt for less than a block
            # more: worth a look only if that can beat ``depth``.
            if shared and min(shared + self.block - 1, limit) > depth:
                for key in self._under[prompt[:shared]]:
                    # To beat ``depth`` a key must match the prompt up to ``lo`` (checked in
                    # one slice comparison: most keys fail it), then it is followed token by token.
                    end = min(len(key), limit)
                    lo = max(depth + 1, min(shared, end))
                    if end < lo or key[shared:lo] != prompt[shared:lo]:
                        continue
                    d = lo
                    while d < end and key[d] == prompt[d]:
                        d += 1
                    best, depth = self._entries[key], d
        return best, depth

    def touch(self, entry: Entry) -> None:
        """A request continues from ``entry``: most recently used, and hot."""
        self._entries.move_to_end(entry.key)
        self._heat(entry)

    def _heat(self, entry: Entry) -> None:
        if entry.hot:
            return
        entry.hot = True
        self._hot += 1
        if self._hot > self.hot_limit:  # demote the least recently used other hot entry
            for other in self._entries.values():
                if other.hot and other is not entry:
                    other.hot = False
                    self._hot -= 1
                    break
            else:
                entry.hot = False
                self._hot -= 1

    def shared_depth(self, prompt: Tokens) -> int:
        """The longest whole number of blocks that ``prompt`` shares with some entry's key."""
        b, lo, hi = self.block, 0, len(prompt) // self.block
        while lo < hi:  # block prefixes of the keys are prefix-closed: binary search the depth
            mid = (lo + hi + 1) // 2
            if prompt[: mid * b] in self._under:
                lo = mid
            else:
                hi = mid - 1
        return lo * b

    # -- rows ------------------------------------------------------------------------------------
    def alloc(self, *, evict_hot: bool = True) -> int | None:
        """A free row, else the row of the least recently used unpinned cold entry, else (with
        ``evict_hot``) of the least recently used unpinned entry; None when there is none."""
        if self._free:
            return self._free.pop()
        victim = next((k for k, e in self._entries.items() if not e.pins and not e.hot), None)
        if victim is None and evict_hot:
            victim = next((k for k, e in self._entries.items() if not e.pins), None)
        if victim is None:
            return None
        self._remove(victim)
        self.evictions += 1
        return self._free.pop()

    def release(self, row: int) -> None:
        """Gives back a row from ``alloc`` that never became an entry."""
        self._free.append(row)

    def add(
        self, key: Tokens, row: int, *, logits: bool, hot: bool = False, owner: str | None = None
    ) -> Entry | None:
        """Makes ``row`` (from ``alloc``) the entry for ``key``. An existing entry for the key is
        replaced, unless it is pinned or has logits where the new one has none: then the row is
        released and None returned (the state is there already). ``owner`` (a session) replaces
        that owner's previous entry."""
        old = self._entries.get(key)
        if old is not None:
            if old.pins or (old.logits and not logits):
                self.release(row)
                return None
            self._remove(key)
        entry = Entry(key=key, row=row, logits=logits)
        self._entries[key] = entry
        if hot:
            self._heat(entry)
        self._by_len[len(key)].add(key)
        b = self.block
        for depth in range(b, len(key) + 1, b):
            self._under.setdefault(key[:depth], set()).add(key)
        if owner is not None:
            self.forget(owner)
            entry.owner = owner
            self._owners[owner] = key
        return entry

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, entry

    # -- dropping --------------------------------------------------------------------------------
    def _remove(self, key: Tokens) -> None:
        entry = self._entries.pop(key)
        self._hot -= entry.hot
        same_length = self._by_len[len(key)]
        same_length.discard(key)
        if not same_length:
            del self._by_len[len(key)]
        b = self.block
        for depth in range(b, len(key) + 1, b):
            prefix = key[:depth]
            keys = self._under[prefix]
            keys.discard(key)
            if not keys:
                del self._under[prefix]
        if entry.owner is not None and self._owners.get(entry.owner) == key:
            del self._owners[entry.owner]
        self._free.append(entry.row)

    def forget(self, owner: str) -> None:
        """Drops the entry a session parked (if it is still there and nobody reads it now)."""
        key = self._owners.pop(owner, None)
        entry = None if key is None else self._entries.get(key)
        if entry is not None:
            entry.owner = None
            if entry.pins == 0:
                self._remove(key)

    def supersede(self, owner: str, prompt: Tokens) -> None:
        """The session ``owner`` asked for ``prompt``: drops its parked entry unless the prompt
        continues it (its key starts the prompt)."""
        key = self._owners.get(owner)
        if key is not None and prompt[: len(key)] != key:
            self.forget(owner)

    def clear(self) -> int:
        """Drops every entry (new weights); returns how many. Nothing may be pinned."""
        n = len(self._entries)
        assert not any(e.pins for e in self._entries.values())
        for key in list(self._entries):
            self._remove(key)
        return n

    def rows_in_use(self) -> int:
        return self.rows - len(self._free)


def branch_points(prompts: Sequence[Tokens], block: int) -> dict[Tokens, list[int]]:
    """For prompts admitted together: the depths (whole blocks) where each prompt's group of
    prompts sharing its prefix shrinks, i.e. the branch points of their radix tree, rounded down
    to blocks. A prompt that shares nothing with the others gets none."""
    distinct = list(dict.fromkeys(prompts))
    counts: collections.Counter[Tokens] = collections.Counter()
    for p in distinct:
        for depth in range(block, len(p) + 1, block):
            counts[p[:depth]] += 1
    points: dict[Tokens, list[int]] = {}
    for p in distinct:
        mine, prev = [], None
        for depth in range(block, len(p) + 1, block):
            c = counts[p[:depth]]
            if prev is not None and c < prev and prev >= 2:
                mine.append(depth - block)
            prev = c
            if c < 2:
                break
        else:
            if prev is not None and prev >= 2:
                mine.append((len(p) // block) * block)
        points[p] = mine
    return points
