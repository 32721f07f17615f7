"""Training rows from episode records: one sequence per session, the mask over sampled tokens,
and only sessions whose verdict passes the threshold."""

from harness.records import EpisodeRecord, ModelCallRecord, SessionVerdict
from whale_jax.train.rows import kept_episodes, rows_from_records, session_outcomes


def passed(*sessions, reward=1.0, origin="answer"):
    return [SessionVerdict(session_id=s, reward=reward, origin=origin) for s in sessions]


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
        sessions=passed("s"),
    )
    rows, counts = rows_from_records([record], max_len=100, threshold=0.5)
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
        sessions=passed("s", "other"),
    )
    rows, counts = rows_from_records([record], max_len=100, threshold=0.5)
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
        sessions=passed("a", "c"),
    )
    rows, counts = rows_from_records([record], max_len=6, threshold=0.5)
    assert counts["empty_calls"] == 1
    assert counts["cut_rows"] == 2 and counts["cut_tokens"] == 2 + 4
    assert counts["untrained_rows"] == 2
    assert [list(r.ids) for r in rows] == [[1, 2, 3, 4, 5, 6]]
    assert list(rows[0].mask) == [False] * 3 + [True] * 3


def test_rows_keep_episode_order_and_rejection_keeps_verdicts_above_threshold():
    records = [
        EpisodeRecord(task_id=f"t{i}", domain="d", calls=[call(0, f"s{i}", [1], [2])],
                      sessions=passed(f"s{i}", reward=r))
        for i, r in enumerate([1.0, 0.5, 0.0, 0.75])
    ]  # fmt: skip
    kept = kept_episodes(records, 0.5)
    assert [r.task_id for r in kept] == ["t0", "t3"]
    rows, _ = rows_from_records(kept, max_len=8, threshold=0.5)
    assert [(r.episode, r.task_id) for r in rows] == [(0, "t0"), (1, "t3")]


def test_only_sessions_whose_verdict_passes_are_trained():
    """The episode's reward does not train anything by itself: each session's own verdict does;
    a session without a verdict, or with one that did not score it, never trains."""
    record = EpisodeRecord(
        task_id="t",
        domain="d",
        reward=1.0,
        calls=[
            call(0, "a", [1], [2]),  # the answer's session
            call(1, "b", [1], [3]),  # an extra sample, verified wrong
            call(2, "c", [1], [4]),  # an extra sample, verified right
            call(3, "d", [1], [5]),  # unscored
            call(4, "e", [1], [6]),  # no verdict at all
            call(5, "f", [1], [7], train=False),  # context only: needs no verdict
        ],
        sessions=[
            SessionVerdict(session_id="a", reward=1.0, origin="answer"),
            SessionVerdict(session_id="b", reward=0.0, origin="verified"),
            SessionVerdict(session_id="c", reward=1.0, origin="verified"),
            SessionVerdict(session_id="d", reward=None, origin="unscored"),
        ],
    )
    rows, counts = rows_from_records([record], max_len=8, threshold=0.5)
    assert [r.session_id for r in rows] == ["a", "c"]
    assert counts["rows_answer"] == counts["rows_verified"] == 1
    assert counts["unpassed_rows"] == 3 and counts["untrained_rows"] == 1
    assert session_outcomes([record], 0.5) == {
        "sessions_answer": 1, "sessions_verified": 1, "dropped_rejected": 1,
        "dropped_unscored": 1, "dropped_unverified": 1,
    }  # fmt: skip
