"""Training rows from episode records: one sequence per session, the mask over sampled tokens."""

from harness.records import EpisodeRecord, ModelCallRecord
from whale_jax.train.rows import kept_episodes, rows_from_records


def call(i, session, prompt, completion, train=True, version=0):
    return ModelCallRecord(
        call_index=i,
        session_id=session,
        messages=[],
        settings={},
        train=train,
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        weights_version=version,
    )


def test_three_turns_with_a_tool_result_and_an_untrained_verifier_call():
    system_user = [1, 2, 3, 4]
    c1 = [10, 11, 12]
    tool_turn = [5, 6]  # the template's delta: end of turn, tool result, generation prompt
    c2 = [13, 14]
    user_turn = [7]
    verifier = [15, 16]  # marked train=False by the harness: context for later turns only
    user_turn2 = [8, 9]
    c4 = [17]
    p2 = system_user + c1 + tool_turn
    p3 = p2 + c2 + user_turn
    p4 = p3 + verifier + user_turn2
    record = EpisodeRecord(
        task_id="t",
        domain="d",
        calls=[
            call(0, "s", system_user, c1, version=3),
            call(1, "s", p2, c2, version=3),
            call(2, "s", p3, verifier, train=False, version=3),
            call(3, "s", p4, c4, version=4),
        ],
    )
    rows, counts = rows_from_records([record], max_len=100)
    assert len(rows) == 1 and counts["new_rows"] == 0
    (row,) = rows
    assert list(row.ids) == p4 + c4
    expected = [False] * 4 + [True] * 3 + [False] * 2 + [True] * 2 + [False] * (1 + 2 + 2) + [True]
    assert list(row.mask) == expected
    assert row.trained_tokens == 3 + 2 + 1 == counts["trained_tokens"]
    assert row.weights_versions == (3, 4)


def test_a_call_that_does_not_extend_its_session_starts_a_new_row():
    record = EpisodeRecord(
        task_id="t",
        domain="d",
        calls=[
            call(0, "s", [1, 2], [3]),
            call(1, "s", [1, 9, 3, 4], [5, 6]),  # history edited: not an extension
            call(2, "other", [1], [2]),
        ],
    )
    rows, counts = rows_from_records([record], max_len=100)
    assert counts["new_rows"] == 1
    assert [list(r.ids) for r in rows] == [[1, 2, 3], [1, 9, 3, 4, 5, 6], [1, 2]]
    assert [r.session_id for r in rows] == ["s", "s", "other"]
    assert [list(r.mask) for r in rows][1] == [False] * 4 + [True] * 2


def test_empty_completions_cut_rows_and_untrained_rows_are_counted():
    record = EpisodeRecord(
        task_id="t",
        domain="d",
        calls=[
            call(0, "a", [1, 2, 3], []),  # an error: no completion, skipped
            call(1, "a", [1, 2, 3], [4, 5, 6, 7, 8]),
            call(2, "b", [1], [2], train=False),  # only untrained calls: no row
            call(3, "c", list(range(20, 28)), [30, 31]),  # cut before its sampled tokens
        ],
    )
    rows, counts = rows_from_records([record], max_len=6)
    assert counts["empty_calls"] == 1
    assert counts["cut_rows"] == 2 and counts["cut_tokens"] == 2 + 4
    assert counts["untrained_rows"] == 2
    assert [list(r.ids) for r in rows] == [[1, 2, 3, 4, 5, 6]]
    assert list(rows[0].mask) == [False] * 3 + [True] * 3


def test_rows_keep_episode_order_and_rejection_keeps_reward_above_threshold():
    records = [
        EpisodeRecord(task_id=f"t{i}", domain="d", reward=r, calls=[call(0, f"s{i}", [1], [2])])
        for i, r in enumerate([1.0, 0.5, 0.0, 0.75])
    ]
    kept = kept_episodes(records, 0.5)
    assert [r.task_id for r in kept] == ["t0", "t3"]
    rows, _ = rows_from_records(kept, max_len=8)
    assert [(r.episode, r.task_id) for r in rows] == [(0, "t0"), (1, "t3")]
