"""h0 for chess, as the reference's: one conversation per puzzle, one move per turn as
<move>uci</move>. Each turn shows the position (side to move, FEN, the board, the opponent's last
reply, the moves accepted so far, the move number and every legal move as ``- [uci] SAN=...``); the
verifier's word on the last reply comes first as its own user turn. A malformed or illegal reply
gets one retry each; a legal wrong move ends the puzzle; at most nine model turns."""

import re

SYSTEM_PROMPT = (
    "You solve chess tactics by choosing one legal move at a time.\n"
    "Use only the board position and legal moves shown in the prompt. Do not claim\n"
    "hidden engine analysis or external knowledge. Return exactly one move."
)
# A str.format template: {observation} is the position (doubled braces would be literal braces).
USER_PROMPT = (
    "Solve the current chess puzzle position.\n\n{observation}\n\n"
    "Return exactly one move as <move>uci</move>, for example <move>e2e4</move>.\n"
    "Do not include explanation."
)
FORMAT_RETRY_BUDGET = 1
ILLEGAL_MOVE_RETRY_BUDGET = 1
MAX_TURNS = 9
PATTERNS = (
    re.compile(r"<move>\s*([a-h][1-8][a-h][1-8][qrbn]?)\s*</move>", re.IGNORECASE),
    re.compile(r"\[\s*([a-h][1-8][a-h][1-8][qrbn]?)\s*\]", re.IGNORECASE),
    re.compile(r"\b([a-h][1-8][a-h][1-8][qrbn]?)\b", re.IGNORECASE),
)
# The reference's sentinels without their underscores (dunder-like strings are refused).
NO_MOVE, AMBIGUOUS = "no_move", "ambiguous_multiple_moves"


def parse_action(reply):
    """The one move in the reply: the first pattern that matches decides; several distinct moves
    are ambiguous."""
    for pattern in PATTERNS:
        moves = []
        for found in pattern.findall(reply):
            if found.lower() not in moves:
                moves.append(found.lower())
        if moves:
            return moves[0] if len(moves) == 1 else AMBIGUOUS
    return NO_MOVE


def show(obs, feedback=""):
    lines = [
        "Task: solve the chess puzzle one move at a time.",
        "Side to move: " + obs["side_to_move"].capitalize(),
        "FEN: " + obs["fen"],
        "Board:",
        obs["board_grid"],
    ]
    if obs["played"]:
        lines.append("Last opponent reply: " + obs["last_move"])
        lines.append("Your accepted moves so far: " + ", ".join(obs["played"]))
    lines += ["Puzzle move number: " + str(obs["move_number"]), "Legal moves:", obs["legal_list"]]
    text = "\n".join(lines)
    if feedback:
        text += "\n\nFeedback from verifier:\n" + feedback
    return USER_PROMPT.format(observation=text)


def run(task, model, tools):
    obs = tools.observe()
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": show(obs)},
    ]
    format_retries = illegal_retries = 0
    for _ in range(MAX_TURNS):
        reply = model.chat(messages)
        move = parse_action(reply)
        feedback = ""
        if move in (NO_MOVE, AMBIGUOUS):
            format_retries += 1
            if format_retries > FORMAT_RETRY_BUDGET:
                return None
            feedback = (
                'The verifier could not parse exactly one UCI move from "' + move + '". Reply '
                "with exactly one move, e.g. <move>e2e4</move>, and no explanation."
            )
        else:
            result = tools.move(move)
            if result["status"] in ("malformed", "illegal", "rejected"):
                illegal_retries += 1
                if illegal_retries > ILLEGAL_MOVE_RETRY_BUDGET:
                    return None
                feedback = (
                    'The parsed move "' + move + '" is not legal in the current board. Choose '
                    "one move from the visible legal moves and reply only as <move>uci</move>."
                )
            elif result["status"] != "continue":
                return None  # solved, or a legal wrong move: the puzzle is over
            else:
                obs = result["observation"]
                verdict = (
                    "Correct. Opponent replied " + result["opponent_move"] + " ("
                    + result["opponent_san"] + "). Continue with the next move."
                )  # fmt: skip
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": verdict},
                    {"role": "user", "content": show(obs)},
                ]
                continue
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": feedback},
            {"role": "user", "content": show(obs, feedback)},
        ]
    return None
