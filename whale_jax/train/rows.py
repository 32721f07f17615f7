"""Training rows from episode records: the one place that decides what a row is and what it trains.

Records are the trainer's only input. The calls of one ``session_id``, in call order, form one
token sequence: each call's ``prompt_ids`` must start with the sequence so far (the earlier prompt
plus its sampled completion); only the new part is appended, then the call's ``completion_ids``.
The loss mask is true exactly on tokens the model sampled in ``train=True`` calls; prompts, tool
results, user turns, template tokens and ``train=False`` calls (a verifier, a vote the harness
marked) are context only.

A session is trained only when its verdict (``EpisodeRecord.sessions``, decided by the trusted
``harness.verdicts``) has a reward above the threshold: the trained tokens always belong to a
conversation the verifier scored. Emitted rows are counted by the verdict's origin
(``rows_answer``, ``rows_verified``, ``rows_played``). ``session_outcomes`` counts every session
with trained completions, passed or dropped, and why (``dropped_rejected``: scored at or below
the threshold; ``dropped_unscored``, ``dropped_flagged``: see ``harness.verdicts``;
``dropped_unverified``: the record carries no verdict for it).

Irregular input is counted, never raised and never silently dropped:
- a call whose prompt does not extend its session's tokens starts a new row (``new_rows``);
- a call with no completion ids (an error, a refusal) adds nothing (``empty_calls``); the next call
  of the session still has to extend the tokens so far;
- a row longer than ``max_len`` is cut there (``cut_rows``, ``cut_tokens``);
- a row with no trained token left (only ``train=False`` calls, or cut before its first sampled
  token) is not emitted (``untrained_rows``);
- a row of a session whose verdict does not pass is not emitted (``unpassed_rows``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

from harness.records import ORIGINS, EpisodeRecord


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One training sequence: ``ids`` and ``mask`` (model-sampled tokens of trained calls) of equal
    length; where it came from; the weights versions that sampled its trained tokens."""

    ids: tuple[int, ...]
    mask: tuple[bool, ...]
    episode: int  # index of the episode in the list given to ``rows_from_records``
    task_id: str
    session_id: str
    weights_versions: tuple[int, ...] = ()

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)


def _session_rows(record: EpisodeRecord):
    """The episode's rows as (session_id, ids, mask, weights versions), uncut, in the order they
    were started, and the counts of irregular calls."""
    counts: Counter[str] = Counter()
    current: dict[str, tuple[list[int], list[bool], set[int]]] = {}
    rows: list[tuple[str, list[int], list[bool], set[int]]] = []
    for call in sorted(record.calls, key=lambda c: c.call_index):
        prompt, completion = list(call.prompt_ids), list(call.completion_ids)
        if not completion:
            counts["empty_calls"] += 1
            continue
        row = current.get(call.session_id)
        if row is not None and prompt[: len(row[0])] != row[0]:
            counts["new_rows"] += 1
            row = None
        if row is None:
            row = current[call.session_id] = ([], [], set())
            rows.append((call.session_id, *row))  # filled in place below and by later calls
        ids, mask, versions = row
        mask += [False] * (len(prompt) - len(ids)) + [bool(call.train)] * len(completion)
        ids[:] = prompt + completion
        if call.train:
            versions.add(call.weights_version)
    return rows, counts


ROW_ORIGINS = tuple(f"rows_{o}" for o in ORIGINS[:3])
SESSION_OUTCOMES = (*(f"sessions_{o}" for o in ORIGINS[:3]), "dropped_rejected",
                    "dropped_unscored", "dropped_flagged", "dropped_unverified")  # fmt: skip


def trained_sessions(record: EpisodeRecord, threshold: float) -> dict[str, str]:
    """The sessions of ``record`` whose verdict is above ``threshold``, with their origin."""
    return {
        v.session_id: v.origin
        for v in record.sessions
        if v.reward is not None and v.reward > threshold
    }


def session_outcomes(records: Iterable[EpisodeRecord], threshold: float) -> Counter[str]:
    """Every session that has trained completions, by outcome: ``sessions_<origin>`` when its
    verdict passes ``threshold``, else ``dropped_<why>`` (see the module docstring)."""
    counts: Counter[str] = Counter()
    for record in records:
        verdicts = {v.session_id: v for v in record.sessions}
        trained = {c.session_id for c in record.calls if c.train and c.completion_ids}
        for sid in sorted(trained):
            v = verdicts.get(sid)
            if v is None:
                counts["dropped_unverified"] += 1
            elif v.reward is None:
                counts[f"dropped_{v.origin}"] += 1
            else:
                counts[f"sessions_{v.origin}" if v.reward > threshold else "dropped_rejected"] += 1
    return counts


def rows_from_records(
    records: Sequence[EpisodeRecord], *, max_len: int, threshold: float
) -> tuple[list[Row], Counter[str]]:
    """Rows of every session above ``threshold`` in ``records`` (in episode order, then session
    order) and the counts of irregular input (see the module docstring) plus ``rows``,
    ``trained_tokens`` and the rows by origin."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    counts: Counter[str] = Counter()
    rows: list[Row] = []
    for e, record in enumerate(records):
        built, c = _session_rows(record)
        counts.update(c)
        passed = trained_sessions(record, threshold)
        for session_id, ids, mask, versions in built:
            if session_id not in passed:
                counts["untrained_rows" if not any(mask) else "unpassed_rows"] += 1
                continue
            if len(ids) > max_len:
                counts["cut_rows"] += 1
                counts["cut_tokens"] += len(ids) - max_len
                ids, mask = ids[:max_len], mask[:max_len]
            if not any(mask):
                counts["untrained_rows"] += 1
                continue
            rows.append(
                Row(
                    ids=tuple(ids),
                    mask=tuple(mask),
                    episode=e,
                    task_id=record.task_id,
                    session_id=session_id,
                    weights_versions=tuple(sorted(versions)),
                )
            )
            counts["rows"] += 1
            counts[f"rows_{passed[session_id]}"] += 1
            counts["trained_tokens"] += sum(mask)
    return rows, counts


def kept_episodes(records: Iterable[EpisodeRecord], threshold: float) -> list[EpisodeRecord]:
    """Rejection sampling: the episodes with at least one session whose verdict is above
    ``threshold`` (the reference keeps rollouts with reward > 0.5; a session is ours)."""
    return [r for r in records if trained_sessions(r, threshold)]
