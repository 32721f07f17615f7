"""The offline proposer's recipes for math: its code variants, its prompt-only edits and the renderer
of a recipe. The recipes render a harness-side design (a fenced Python turn the harness runs),
not the reference's h0 with its native code_interpreter tool: a recipe is an alternative to h0,
and the empty recipe is that design's baseline.
"""

from __future__ import annotations

from typing import Any

from harness.records import EpisodeRecord
from harness.search.proposers.kit import (
    Evidence,
    Variant,
    assign,
    attempt_text,
    brief,
    code_ids,
    cut,
    fmt,
    long,
    prompt_edit,
    scaled,
    short,
    spent,
    text_catalogue,
    text_module,
    wrong,
)

MATH_PROMPT_EXAMPLE = (
    "\n\nExample.\nProblem: The sum of two numbers is 9 and their difference is 3. What is the "
    "larger number?\nSolution: Adding the two equations gives twice the larger number equal to "
    "9 + 3, so the larger number is 6.\n\\boxed{6}\n"
)


def catalogue() -> list[Variant]:
    """Every code variant, in prior order within each mechanism."""
    return text_catalogue((1, 2), (3, 5)) + [
        Variant("turns-3", "turns", 3,
                lambda e: e.frac(e.count("tool_wrong")) + 0.2 * long(e), 0.35,
                "up to 2 Python tool turns before the final answer (h0: 1)",
                "Wrong answers after a tool turn suggest the first program was not the last "
                "word; a second run lets the model check or fix it."),
        Variant("turns-1", "turns", 1, lambda e: 0.8 * spent(e) + 0.3 * cut(e), 0.15,
                "no tool turn: one reasoning call",
                "Budget stops and cut completions leave no room for a tool round trip."),
    ]  # fmt: skip


def prompt_catalogue() -> list[Variant]:
    """The prompt-only edits (the Fast-Slow control)."""
    return [
        prompt_edit("prompt-format-strict", " End with exactly one \\boxed{} holding only the final "
                    "answer, simplified (an integer, a reduced fraction or an exact expression), "
                    "with no units or words inside the box.", fmt, 0.8,
                    "An explicit answer shape makes more replies parsable."),
        prompt_edit("prompt-fewshot-1", MATH_PROMPT_EXAMPLE, lambda e: 0.8 * fmt(e), 0.6,
                    "A worked example shows where and how the boxed answer goes."),
        prompt_edit("prompt-check", " Before giving the answer, check it against the conditions of "
                    "the problem, substituting it back where you can.", wrong, 0.5,
                    "Wrong answers often fail a simple substitution check."),
        prompt_edit("prompt-concise", " Keep the solution short: do not restate the problem or "
                    "repeat steps.", brief, 0.2,
                    "Budget stops and cut completions call for shorter solutions."),
        prompt_edit("prompt-exact", " Give exact values (fractions, radicals, multiples of pi), not "
                    "decimal approximations, unless the problem asks for a decimal.",
                    lambda e: 0.6 * long(e) + 0.3 * short(e), 0.35,
                    "Strict matching rejects decimal approximations of exact answers."),
        prompt_edit("prompt-plan", " First state what is asked and which quantities are known, "
                    "then solve.", lambda e: 0.5 * e.frac(e.wrong), 0.3,
                    "Wrong answers often solve for a different quantity than the one asked."),
        prompt_edit("prompt-python", " For long or error-prone computation, prefer the Python block "
                    "over working it out by hand.", lambda e: 0.5 * e.frac(e.wrong - e.count("tool_wrong")),
                    0.25, "Wrong answers without a tool turn include arithmetic slips that a short "
                    "program avoids."),
    ]  # fmt: skip


# ---- rendering ----------------------------------------------------------------------------------

MATH_EXAMPLES = (
    ("Solve for x: 2x + 3 = 9.\n\nPut the final answer in \\boxed{}.",
     "Subtract 3 from both sides: 2x = 6. Divide by 2: x = 3.\n\n\\boxed{3}"),
    ("The sum of two numbers is 9 and their difference is 3. What is the larger number?\n\nPut "
     "the final answer in \\boxed{}.",
     "Adding the two equations gives twice the larger number equal to 9 + 3, so the larger number "
     "is 6.\n\n\\boxed{6}"),
)  # fmt: skip

MATH_KEY = r'''
def key(reply):
    """The content of the reply's last \\boxed{} or \\fbox{} (braces balanced, spaces removed),
    or None: what the verifier reads."""
    starts = [found.end() for found in BOXED.finditer(reply)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(reply)):
        if reply[i] == "{":
            depth += 1
        elif reply[i] == "}":
            depth -= 1
            if depth == 0:
                return "".join(reply[starts[-1] : i].split()) or None
    return None
'''

MATH_TOOL_LOOP = r"""
    for turn in range(MAX_TURNS):
        reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)
        found = CODE.search(reply)
        if found is None or key(reply) is not None or turn == MAX_TURNS - 1:
            break
        if not room(model, True):
            break
        try:
            result = tools.python(found.group(1))
            shown = (result["stdout"] + result["stderr"])[-2000:] or "(no output)"
        except tools.ToolError as error:
            shown = "The code was refused: " + str(error)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Output:\n" + shown + "\n\n" + AFTER_TOOL},
        ]
"""


def render(recipe: dict[str, Any]) -> str:
    """The harness module of a recipe's code variants."""
    turns = recipe.get("turns", 2)
    prompt = "You are a careful mathematician. Solve the problem step by step."
    if turns == 2:
        prompt += (" You may run Python once by writing a block fenced as ```python ... ``` and "
                   "nothing after it; you will see its output.")  # fmt: skip
    elif turns > 2:
        prompt += (f" You may run Python up to {turns - 1} times, each time by writing a block "
                   "fenced as ```python ... ``` and nothing after it; you will see its output.")  # fmt: skip
    prompt += " Put the final answer in \\boxed{}."
    if recipe.get("format") == "strict":
        prompt += (" End with exactly one \\boxed{} holding only the final answer, simplified (an "
                   "integer, a reduced fraction or an exact expression), with no units or words "
                   "inside the box.")  # fmt: skip
    constants = [assign("SYSTEM_PROMPT", prompt),
                 assign("ANSWER_HINT", "Put the final answer in \\boxed{}.")]  # fmt: skip
    if recipe.get("fewshot"):
        constants.append(assign("EXAMPLES", MATH_EXAMPLES[: recipe["fewshot"]]))
    if turns > 1:
        after = ("Now give the final answer in \\boxed{}." if turns == 2 else
                 "Continue the solution; when it is complete, give the final answer in \\boxed{}.")  # fmt: skip
        constants += [assign("MAX_TURNS", turns), assign("AFTER_TOOL", after),
                      r'CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)']  # fmt: skip
    if recipe.get("repair"):
        constants.append(assign("REPAIR_PROMPT", "State the final answer as \\boxed{} now."))
    if recipe.get("verify"):
        constants.append(assign("VERIFY_PROMPT", (
            "Check the solution step by step for errors and fix any you find. End with the final "
            "answer in \\boxed{}.")))  # fmt: skip
    constants += [assign("MAX_NEW_TOKENS", scaled(1024, recipe)),
                  r'BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")']  # fmt: skip
    first = (MATH_TOOL_LOOP if turns > 1 else
             "    reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)")  # fmt: skip
    attempt = attempt_text(
        "One conversation: the problem, tool turns where the recipe allows them, then a repair or "
        "check turn where the recipe has one.",
        "",
        '    messages.append({"role": "user", "content": task.question + "\\n\\n" + ANSWER_HINT})',
        first, recipe, bool(recipe.get("repair")),
    )  # fmt: skip
    return text_module(
        "math", code_ids(catalogue(), recipe), recipe, ["import re"], constants, [MATH_KEY], attempt
    )


# ---- evidence hooks ---------------------------------------------------------------------------


def tally_wrong(ev: Evidence, r: EpisodeRecord) -> None:
    ev.add("tool_wrong", bool(r.tool_calls))


def describe_wrong(ev: Evidence) -> str:
    return f", {ev.count('tool_wrong')} wrong after a Python turn"
