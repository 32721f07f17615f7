"""The offline proposer's recipes for arith: its code variants, its prompt-only edits, the renderer
of a recipe (the empty recipe is h0's behaviour, in the shape the variants extend).
"""

from __future__ import annotations

from typing import Any

from harness.search.proposers.kit import (
    Variant,
    assign,
    attempt_text,
    code_ids,
    cut,
    fmt,
    long,
    prompt_edit,
    scaled,
    short,
    text_catalogue,
    text_module,
    unparsed,
    wrong,
)

ARITH_PROMPT_EXAMPLES = (
    "\n\nExamples of questions and replies:\nWhat is 1 + 8? -> 9\nWhat is 9 - 1? -> 8\n"
    "What is 1 * 7 + 0? -> 7\n"
)


def catalogue() -> list[Variant]:
    """Every code variant, in prior order within each mechanism."""
    return text_catalogue((2, 4), (5, 3, 7)) + [
        Variant("reason", "reason", True, lambda e: 0.8 * short(e) + 0.3 * long(e), 0.45,
                "a few lines of working, then a final line 'Answer: <integer>'; the "
                "submission starts at that integer",
                "Bare-number replies are wrong when the sum needs carrying; a little working "
                "before the answer line makes the arithmetic explicit."),
    ]  # fmt: skip


def prompt_catalogue() -> list[Variant]:
    """The prompt-only edits (the Fast-Slow control)."""
    return [
        prompt_edit("prompt-format-strict", " Write the result as an integer in digits, with a "
                    "leading minus sign if it is negative, and no words, units or commas.", fmt, 0.8,
                    "An explicit answer shape makes more replies parsable."),
        prompt_edit("prompt-fewshot-3", ARITH_PROMPT_EXAMPLES, lambda e: 0.8 * fmt(e), 0.6,
                    "Examples of the reply format anchor it better than the instruction alone."),
        prompt_edit("prompt-careful", " Add carefully, digit by digit, before you reply.", wrong, 0.5,
                    "Wrong answers suggest slips; an explicit call for care costs nothing."),
        prompt_edit("prompt-no-words", " Do not start with words such as 'The answer is': the "
                    "first thing you write is the number.", lambda e: unparsed(e) + 0.3 * cut(e),
                    0.45, "Replies that open with words get cut or carry a stray number first; "
                    "a bare number first is what the verifier reads."),
        prompt_edit("prompt-precedence", " Multiply before you add or subtract; otherwise work "
                    "from left to right.", lambda e: 0.7 * e.frac(e.wrong), 0.35,
                    "Mixed expressions go wrong when the operations are done in reading order."),
        prompt_edit("prompt-sign", " When the result is below zero, write it with a leading minus "
                    "sign.", lambda e: 0.4 * e.frac(e.wrong), 0.2,
                    "Negative results lose their sign in bare-number replies."),
    ]  # fmt: skip


# ---- rendering ----------------------------------------------------------------------------------

ARITH_EXAMPLES = (("What is 9 + 1?", "10"), ("What is 0 - 7?", "-7"),
                  ("What is 1 * 8 + 1?", "9"), ("What is 1 + 0 + 6?", "7"))  # fmt: skip
ARITH_WORKED = (("What is 9 + 1?", "9 + 1 = 10\nAnswer: 10"),
                ("What is 0 - 7?", "0 - 7 = -7\nAnswer: -7"),
                ("What is 1 * 8 + 1?", "1 * 8 = 8, then 8 + 1 = 9\nAnswer: 9"),
                ("What is 1 + 0 + 6?", "1 + 0 = 1, then 1 + 6 = 7\nAnswer: 7"))  # fmt: skip

ARITH_LOCATE_FIRST = r'''
def locate(reply):
    """The reply's first integer: what the verifier reads."""
    return NUMBER.search(reply)
'''

ARITH_LOCATE_LAST = r'''
def locate(reply):
    """The integer of the reply's last "Answer:" line; the numbers before it are working."""
    found = list(ANSWER.finditer(reply))
    return found[-1] if found else None
'''

ARITH_KEY = r'''
def key(reply):
    """The answer as a canonical integer string, or None when the reply has none."""
    found = locate(reply)
    return None if found is None else str(int(found.group(1)))


def submission(reply):
    """The reply from its answer on: the verifier reads the first integer of the submission."""
    found = locate(reply)
    return reply if found is None else reply[found.start(1) :]
'''


def render(recipe: dict[str, Any]) -> str:
    """The harness module of a recipe's code variants."""
    reason = bool(recipe.get("reason"))
    strict = recipe.get("format") == "strict"
    if reason:
        prompt = ("Work the calculation out in a few short lines, then end with a final line of "
                  "the form Answer: <integer>.")  # fmt: skip
        if strict:
            prompt += (" The final line holds the integer alone, in digits, with a leading minus "
                       "sign if it is negative.")  # fmt: skip
        repair_text = "Your reply has no final line Answer: <integer>. Give that line now."
        verify_text = ("Check each step once more and correct any mistake. End with a final line "
                       "Answer: <integer>.")  # fmt: skip
        pattern = r'ANSWER = re.compile(r"Answer:\s*(-?\d+)")'
        locate = ARITH_LOCATE_LAST
    else:
        prompt = "Answer with only the number."
        if strict:
            prompt = ("Answer with only the final result as an integer: digits, with a leading "
                      "minus sign if it is negative; no words, units, commas or spaces.")  # fmt: skip
        repair_text = (
            "Your reply did not contain the result as a number. Reply with only the number."
        )
        verify_text = ("Check the calculation once more and correct it if it is wrong. Reply with "
                       "only the final number.")  # fmt: skip
        pattern = r'NUMBER = re.compile(r"(-?\d+)")'
        locate = ARITH_LOCATE_FIRST
    constants = [assign("SYSTEM_PROMPT", prompt)]
    if recipe.get("fewshot"):
        constants.append(assign("EXAMPLES", (ARITH_WORKED if reason else ARITH_EXAMPLES)[
            : recipe["fewshot"]]))  # fmt: skip
    if recipe.get("repair"):
        constants.append(assign("REPAIR_PROMPT", repair_text))
    if recipe.get("verify"):
        constants.append(assign("VERIFY_PROMPT", verify_text))
    constants += [assign("MAX_NEW_TOKENS", scaled(96 if reason else 12, recipe)), pattern]
    attempt = attempt_text(
        "One conversation: the question, then a repair or check turn where the recipe has one.",
        "",
        '    messages.append({"role": "user", "content": task.question})',
        "    reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)",
        recipe, bool(recipe.get("repair")),
    )  # fmt: skip
    return text_module("arith", code_ids(catalogue(), recipe), recipe, ["import re"], constants, [locate, ARITH_KEY], attempt,
                       "submission(reply)")  # fmt: skip
