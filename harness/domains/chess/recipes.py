"""The offline proposer's recipes for chess: its code variants, its prompt-only edits, the renderer
of a recipe (a fresh prompt per move unless ``session``; not the reference's h0 layout), and the
evidence hooks for illegal and malformed moves.
"""

from __future__ import annotations

from typing import Any

from harness.records import EpisodeRecord
from harness.search.proposers.kit import (
    ROOM,
    Evidence,
    Variant,
    assign,
    code_ids,
    cut,
    missing,
    module,
    prompt_edit,
    scaled,
    spent,
    wrong,
)


def catalogue() -> list[Variant]:
    """Every code variant, in prior order within each mechanism."""
    return [
        Variant("format-strict", "format", "strict",
                lambda e: e.frac(e.count("malformed")) + 0.4 * missing(e), 0.7,
                "instruction: copy exactly one move from the legal-move list",
                "Malformed or rejected attempts come from replies that are not one bare "
                "move; asking for a copied list entry removes the guesswork."),
        Variant("obs-coords", "obs", "coords", lambda e: e.frac(e.count("illegal")), 0.65,
                "board shown with rank numbers and file letters",
                "Illegal attempts mean the model misreads squares; coordinates on the board "
                "make each piece's square explicit."),
        Variant("obs-pieces", "obs", "pieces",
                lambda e: 0.9 * e.frac(e.count("illegal")) + 0.3 * wrong(e), 0.6,
                "a piece list per side (piece and square) read from the FEN, with the board",
                "A piece list names every piece's square, which a grid of letters leaves the "
                "model to count."),
        Variant("obs-compact", "obs", "compact", lambda e: 0.8 * spent(e), 0.1,
                "FEN and legal moves only, without the board",
                "Budget stops call for shorter prompts; the board repeats the FEN."),
        Variant("retries-5", "retries", 5,
                lambda e: 0.9 * missing(e) + 0.4 * e.frac(e.count("illegal")), 0.45,
                "6 tries per move (h0: 3), within the episode's retry budget",
                "Episodes that end without a verdict ran out of tries on rejected moves; more "
                "tries let a legal move through."),
        Variant("retries-0", "retries", 0, spent, 0.05,
                "one try per move, no retries",
                "Budget stops mean retries eat the episode's budget."),
        Variant("feedback-reason", "feedback", "reason",
                lambda e: 0.9 * e.frac(e.count("illegal")) + 0.6 * missing(e), 0.55,
                "a refused move is answered with the tool's reason and the legal moves again",
                "'Try again' alone does not say what was wrong; the tool's reason and the "
                "list of legal moves do."),
        Variant("vote-k3", "vote", 3, wrong, 0.5,
                "3 samples per move, the most common legal move is played (extras "
                "train=False)",
                "Wrong moves that are legal look like sampling noise; a majority over "
                "samples of the same position removes some of it."),
        Variant("vote-k5", "vote", 5, lambda e: 0.97 * wrong(e), 0.4,
                "5 samples per move, the most common legal move is played (extras "
                "train=False)",
                "A larger vote separates a consistent best move from noise."),
        Variant("think", "think", True, lambda e: 0.8 * wrong(e), 0.45,
                "brief reasoning (checks, captures, threats) before a final 'Move:' line",
                "Puzzle moves are forcing; naming checks, captures and threats before "
                "answering finds them more often than a bare move."),
        Variant("verify", "verify", True, lambda e: 0.6 * wrong(e), 0.35,
                "a verification turn: the model re-checks its move against the opponent's "
                "best reply before it is played",
                "A re-check against the best reply catches moves that lose to a refutation."),
        Variant("session", "session", True, lambda e: 0.4 * wrong(e), 0.3,
                "one conversation for the whole puzzle instead of a fresh prompt per move",
                "Later moves of a combination follow from the first; keeping the earlier "
                "moves in the conversation keeps the plan."),
        Variant("tokens-x2", "tokens", "x2", cut, 0.15,
                "twice the completion-token limit per call",
                "Completions cut at the limit lose the move."),
        Variant("tokens-half", "tokens", "half", spent, 0.05,
                "half the completion-token limit per call",
                "Budget stops call for shorter completions."),
    ]  # fmt: skip


def prompt_catalogue() -> list[Variant]:
    """The prompt-only edits (the Fast-Slow control)."""
    return [
        prompt_edit("prompt-format-strict", " Write the move exactly as it appears in the list of "
                    "legal moves.", lambda e: e.frac(e.count("malformed")) + 0.4 * missing(e), 0.8,
                    "Malformed and rejected attempts drop when the reply is a copied list entry."),
        prompt_edit("prompt-notation", " UCI notation names the square the piece leaves and the "
                    "square it lands on, joined without spaces or dashes (files a to h, ranks 1 to "
                    "8), plus q, r, b or n when a pawn promotes.",
                    lambda e: e.frac(e.count("malformed") + e.count("illegal")), 0.6,
                    "Illegal and malformed attempts suggest the notation is misread."),
        prompt_edit("prompt-tactics", " Puzzles reward forcing moves: look at checks first, then "
                    "captures, then threats, and prefer the move that leaves the opponent the fewest "
                    "replies.", wrong, 0.5,
                    "Wrong moves in puzzles are usually quiet moves where a forcing one wins."),
        prompt_edit("prompt-mate", " Look for a checkmate first: many puzzles end with one.",
                    lambda e: 0.8 * wrong(e), 0.45,
                    "Mating puzzles are lost by moves that win material instead of mating."),
        prompt_edit("prompt-reply", " Before you answer, consider the opponent's best reply to "
                    "your move.", lambda e: 0.7 * wrong(e), 0.35,
                    "Wrong moves are often refuted by one reply the model did not consider."),
        prompt_edit("prompt-own-pieces", " Move only your own pieces: upper-case letters on the "
                    "board are White, lower-case are Black.", lambda e: e.frac(e.count("illegal")), 0.3,
                    "Illegal attempts include moves of the opponent's pieces."),
    ]  # fmt: skip


# ---- rendering ----------------------------------------------------------------------------------

CHESS_SHOW = {
    None: r"""
def show(obs):
    return (
        "You play " + obs["side_to_move"] + ".\nFEN: " + obs["fen"] + "\nBoard:\n" + obs["board"]
        + "\nOpponent's last move: " + str(obs["last_move"])
        + "\nLegal moves: " + " ".join(obs["legal_moves"]) + "\nYour move:"
    )
""",
    "coords": r'''
def show(obs):
    """The board with rank numbers and file letters; the legal moves as one whole list."""
    rows = obs["board"].split("\n")
    board = "\n".join(str(8 - i) + " | " + row for i, row in enumerate(rows))
    return (
        "You play " + obs["side_to_move"] + ".\nFEN: " + obs["fen"]
        + "\nBoard (White upper case, Black lower case):\n" + board + "\n    a b c d e f g h"
        + "\nOpponent's last move: " + str(obs["last_move"])
        + "\nLegal moves: " + " ".join(obs["legal_moves"]) + "\nYour move:"
    )
''',
    "pieces": r'''
def pieces(fen):
    """Each side's pieces with their squares, read from the FEN's placement field."""
    found = {"White": [], "Black": []}
    for rank, row in zip("87654321", fen.split()[0].split("/")):
        column = 0
        for ch in row:
            if ch.isdigit():
                column += int(ch)
                continue
            side = "White" if ch.isupper() else "Black"
            found[side].append(NAMES[ch.lower()] + " " + "abcdefgh"[column] + rank)
            column += 1
    return "\n".join(side + ": " + ", ".join(items) for side, items in found.items())


def show(obs):
    """FEN, board and a piece list; the legal moves as one whole list."""
    return (
        "You play " + obs["side_to_move"] + ".\nFEN: " + obs["fen"] + "\nBoard:\n" + obs["board"]
        + "\nPieces:\n" + pieces(obs["fen"])
        + "\nOpponent's last move: " + str(obs["last_move"])
        + "\nLegal moves: " + " ".join(obs["legal_moves"]) + "\nYour move:"
    )
''',
    "compact": r'''
def show(obs):
    """FEN and legal moves only (the board repeats the FEN)."""
    return (
        "You play " + obs["side_to_move"] + ".\nFEN: " + obs["fen"]
        + "\nOpponent's last move: " + str(obs["last_move"])
        + "\nLegal moves: " + " ".join(obs["legal_moves"]) + "\nYour move:"
    )
''',
}

CHESS_PICK = r'''
def pick(reply):
    """The reply's first UCI-shaped word, else its start (the tool then says it is malformed)."""
    found = UCI.search(reply)
    return found.group(0) if found else reply.strip()[:10]
'''

CHESS_PICK_THINK = r'''
def pick(reply):
    """The move of the reply's last "Move:" line, else its last UCI-shaped word, else its start."""
    moves = MOVE.findall(reply) or UCI.findall(reply)
    return moves[-1] if moves else reply.strip()[:10]
'''

CHESS_FEEDBACK = {
    None: r"""
def feedback(result, obs):
    return "That move was " + result["status"] + ". Try again."
""",
    "reason": r'''
def feedback(result, obs):
    """The tool's own reason and the legal moves again (the list whole, as the tool gave it)."""
    return (
        "That move was " + result["status"] + ": " + str(result.get("reason", ""))
        + ".\nLegal moves: " + " ".join(obs["legal_moves"]) + "\nYour move:"
    )
''',
}

CHESS_CHOOSE = r'''
def choose(model, messages, obs):
    """VOTES samples of one prompt (the first trained, the rest train=False: only the sessions of
    played moves train, so extras would add nothing): the earliest reply whose move is the most
    common legal one."""
    replies = [model.chat(messages, max_new_tokens=MAX_NEW_TOKENS)]
    while len(replies) < VOTES and room(model):
        try:
            replies.append(model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=False))
        except (model.BudgetExceeded, model.ModelError):
            break
    moves = [pick(reply) for reply in replies]
    counts = Counter(move for move in moves if move in obs["legal_moves"])
    if not counts:
        return replies[0]
    top = max(counts.values())
    return next(reply for reply, move in zip(replies, moves) if counts.get(move) == top)
'''

CHESS_VERIFY = r"""
        if room(model, True):
            checking = messages + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": VERIFY_PROMPT},
            ]
            checked = model.chat(checking, max_new_tokens=MAX_NEW_TOKENS)
            if pick(checked) in obs["legal_moves"]:
                messages, reply = checking, checked
"""

CHESS_RUN_TAIL = r"""
        result = tools.move(pick(reply))
        for _ in range(MAX_TRIES - 1):
            if result["status"] not in ("malformed", "illegal", "rejected"):
                break
            rejected += 1
            if rejected >= RETRY_BUDGET or not room(model, True):
                break
            messages = messages + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": feedback(result, obs)},
            ]
            reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS)
            result = tools.move(pick(reply))
        if result["status"] != "continue":
            return None
"""

CHESS_PLY_FRESH = r"""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": show(obs)},
        ]
"""

CHESS_PLY_SESSION = r"""
        if sum(m["role"] == "assistant" for m in messages) + MAX_TRIES + 2 > TURNS:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        messages = messages + [{"role": "user", "content": show(obs)}]
"""


def render(recipe: dict[str, Any]) -> str:
    """The harness module of a recipe's code variants."""
    think, strict = bool(recipe.get("think")), recipe.get("format") == "strict"
    notation = ("UCI notation (the square the piece leaves and the square it lands on, plus q, r, "
                "b or n for a promotion)")  # fmt: skip
    if think:
        prompt = ("You are a chess tactician solving a puzzle. Think briefly: list the checks, "
                  "captures and threats for both sides and what each forces. Then end with a final "
                  f"line Move: followed by one move in {notation}.")  # fmt: skip
        if strict:
            prompt += " The move must be copied exactly from the list of legal moves."
        verify_text = ("Check that move against the opponent's best reply. End with a final line "
                       "Move: followed by your final move.")  # fmt: skip
    else:
        prompt = ("You are a chess tactician solving a puzzle. Reply with your move in UCI "
                  "notation (for example e2e4, or e7e8q for a promotion) and nothing else.")  # fmt: skip
        if strict:
            prompt = ("You are a chess tactician solving a puzzle. Reply with exactly one move "
                      f"copied from the list of legal moves, in {notation}, and nothing else.")  # fmt: skip
        verify_text = ("Check that move: is it in the list of legal moves, and what is the "
                       "opponent's best reply to it? Reply with your final move only.")  # fmt: skip
    constants = [assign("SYSTEM_PROMPT", prompt)]
    if recipe.get("verify"):
        constants.append(assign("VERIFY_PROMPT", verify_text))
    constants += [
        assign("MAX_TRIES", recipe.get("retries", 2) + 1),
        assign("RETRY_BUDGET", 10),
        assign("MAX_NEW_TOKENS", scaled(256 if think else 16, recipe)),
    ]
    if recipe.get("vote"):
        constants.append(assign("VOTES", recipe["vote"]))
    if recipe.get("session"):
        constants.append(assign("TURNS", 16))
    constants.append(r'UCI = re.compile(r"\b[a-h][1-8][a-h][1-8][qrbn]?\b")')
    if think:
        constants.append(r'MOVE = re.compile(r"Move:\s*([a-h][1-8][a-h][1-8][qrbn]?)\b")')
    obs = recipe.get("obs")
    if obs == "pieces":
        constants.append('NAMES = {"k": "king", "q": "queen", "r": "rook", "b": "bishop", '
                         '"n": "knight", "p": "pawn"}')  # fmt: skip
    run = "\ndef run(task, model, tools):\n    obs = tools.observe()\n    rejected = 0\n"
    if recipe.get("session"):
        run += '    messages = [{"role": "system", "content": SYSTEM_PROMPT}]\n'
    run += "    while True:"
    run += (CHESS_PLY_SESSION if recipe.get("session") else CHESS_PLY_FRESH).rstrip("\n")
    run += ("\n        reply = choose(model, messages, obs)" if recipe.get("vote") else
            "\n        reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS)")  # fmt: skip
    if recipe.get("verify"):
        run += CHESS_VERIFY.rstrip("\n")
    run += CHESS_RUN_TAIL.rstrip("\n")
    if recipe.get("session"):
        run += '\n        messages = messages + [{"role": "assistant", "content": reply}]'
    run += '\n        obs = result["observation"]\n'
    imports = ["import re"]
    helpers = [CHESS_SHOW[obs], CHESS_PICK_THINK if think else CHESS_PICK, ROOM,
               CHESS_FEEDBACK[recipe.get("feedback")]]  # fmt: skip
    if recipe.get("vote"):
        imports.append("from collections import Counter")
        helpers.append(CHESS_CHOOSE)
    return module("chess", code_ids(catalogue(), recipe), imports, constants, [*helpers, run])


# ---- evidence hooks ---------------------------------------------------------------------------


def classify(ev: Evidence, r: EpisodeRecord) -> bool:
    """An unrewarded puzzle: a wrong move played, or no verdict; illegal and malformed or
    rejected attempts are tallied."""
    statuses = {str(t.result.get("status")) for t in r.tool_calls if isinstance(t.result, dict)}
    ev.add("illegal", "illegal" in statuses)
    ev.add("malformed", bool(statuses & {"malformed", "rejected"}))
    if r.stop_reason == "failed":
        ev.wrong += 1
    else:
        ev.no_answer += 1
    return True


def describe(ev: Evidence) -> str:
    return (
        f", {ev.wrong} played a wrong move, {ev.no_answer} ended without a verdict (retries "
        f"spent), {ev.count('illegal')} tried an illegal move and {ev.count('malformed')} a "
        f"malformed or rejected one, {ev.budget} budget stops, {ev.truncated} with a completion "
        "cut at the token limit."
    )
