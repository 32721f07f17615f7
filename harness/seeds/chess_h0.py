"""h0 for chess: FEN, ASCII board and the legal moves; one UCI move per turn, bounded retries."""

import re

SYSTEM_PROMPT = (
    "You are a chess tactician solving a puzzle. Reply with your move in UCI notation "
    "(for example e2e4, or e7e8q for a promotion) and nothing else."
)
MAX_RETRIES = 3
UCI = re.compile(r"\b[a-h][1-8][a-h][1-8][qrbn]?\b")


def show(obs):
    return (
        "You play "
        + obs["side_to_move"]
        + ".\nFEN: "
        + obs["fen"]
        + "\nBoard:\n"
        + obs["board"]
        + "\nOpponent's last move: "
        + str(obs["last_move"])
        + "\nLegal moves: "
        + " ".join(obs["legal_moves"])
        + "\nYour move:"
    )


def run(task, model, tools):
    obs = tools.observe()
    while True:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": show(obs)},
        ]
        result = None
        for _ in range(MAX_RETRIES):
            reply = model.chat(messages, max_new_tokens=16)
            found = UCI.search(reply)
            result = tools.move(found.group(0) if found else reply.strip()[:10])
            if result["status"] not in ("malformed", "illegal", "rejected"):
                break
            messages = messages + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "That move was " + result["status"] + ". Try again."},
            ]
        if result is None or result["status"] != "continue":
            return None
        obs = result["observation"]
