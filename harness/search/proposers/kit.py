"""The offline proposer's kit: what every domain's recipes (``harness/domains/<name>/recipes.py``)
are made of. Evidence counted from traces, the ``Variant`` record and the evidence weights, the
variants every answer-text domain shares, source-text helpers and the shared harness fragments, and
the prompt-only edit. Nothing here knows a domain: a domain's recipes module brings its own
variants, renderer and evidence hooks (``harness.search.proposers.offline`` has the contract).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import textwrap
from collections.abc import Callable
from typing import Any

from harness.records import EpisodeRecord
from harness.search.validate import PROMPT_CONSTANTS

SHORT_TOKENS = 64  # a wrong answer whose final completion is at most this long is "short"
CRASHES = frozenset(
    {"error", "timeout", "worker_died", "sandbox_violation", "output_limit", "memory_limit",
     "protocol_error", "harness_load", "static_check"}
)  # fmt: skip

# ---- evidence --------------------------------------------------------------------------------


@dataclasses.dataclass
class Evidence:
    """Outcome counts over one candidate's traced episodes (``n == 0``: no traces to go on)."""

    domain: str
    source: str = ""  # the candidate whose traces these are
    n: int = 0
    correct: int = 0
    no_answer: int = 0  # no submission, or (chess) the episode ended without a verdict
    unparsable: int = 0  # submitted, but the verifier found no answer in it
    not_in_completion: int = 0
    wrong: int = 0  # a parsed answer (chess: a played move) that was wrong
    short_wrong: int = 0  # ... whose final completion had at most SHORT_TOKENS tokens
    budget: int = 0  # stop_reason budget:*
    truncated: int = 0  # unrewarded episodes with a completion cut at the token limit
    crashed: int = 0
    extra: dict[str, int] = dataclasses.field(default_factory=dict)  # the domain's own tallies
    hooks: Any = None  # the domain's recipes module (its optional tally and describe hooks)

    def frac(self, count: int) -> float:
        return count / self.n if self.n else 0.0

    def count(self, name: str) -> int:
        """A domain tally (``recipes.tally``), 0 when never counted."""
        return self.extra.get(name, 0)

    def add(self, name: str, k: int = 1) -> None:
        self.extra[name] = self.extra.get(name, 0) + k

    def describe(self) -> str:
        if not self.n:
            return "No traces to read yet, so the catalogue's default order applies."
        head = f"Traces of {self.source} ({self.n} episodes): {self.correct} rewarded"
        own = getattr(self.hooks, "describe", None)
        body = own(self) if own is not None else None
        if body is None:
            body = (
                f", {self.wrong} answered wrong ({self.short_wrong} with final completions of at "
                f"most {SHORT_TOKENS} tokens), {self.no_answer} without an answer, "
                f"{self.unparsable} with no parsable answer, {self.not_in_completion} not in a "
                f"completion, {self.budget} budget stops, {self.truncated} cut at the token limit"
            )
            more = getattr(self.hooks, "describe_wrong", None)
            body += (more(self) if more is not None else "") + "."
        crash = f" {self.crashed} crashed." if self.crashed else ""
        return head + body + crash


def gather_evidence(domain: str, source: str, records: list[EpisodeRecord],
                    hooks: Any = None) -> Evidence:  # fmt: skip
    """Outcome counts of ``records``. ``hooks`` (a domain's recipes module) may define
    ``classify(ev, record) -> bool``, which takes an unrewarded episode whole when it returns
    True, and ``tally_wrong(ev, record)``, which adds its own counts for a wrong answer."""
    ev = Evidence(domain=domain, source=source, hooks=hooks)
    classify = getattr(hooks, "classify", None)
    tally_wrong = getattr(hooks, "tally_wrong", None)
    for r in records:
        ev.n += 1
        stop = r.stop_reason
        if stop.startswith("budget"):
            ev.budget += 1
        if r.reward <= 0 and any(c.finish_reason == "length" for c in r.calls):
            ev.truncated += 1
        if stop in CRASHES:
            ev.crashed += 1
        elif r.reward > 0:
            ev.correct += 1
        elif classify is not None and classify(ev, r):
            pass
        elif r.extracted is not None:
            ev.wrong += 1
            last = r.calls[-1] if r.calls else None
            size = (last.completion_tokens or len(last.text.split())) if last else 0
            ev.short_wrong += size <= SHORT_TOKENS
            if tally_wrong is not None:
                tally_wrong(ev, r)
        elif stop == "answer_not_in_completion":
            ev.not_in_completion += 1
        elif r.answer is None or not r.answer.strip():
            ev.no_answer += 1
        else:
            ev.unparsable += 1
    return ev


# ---- variants ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One mechanism at one setting. Code variants set ``recipe[mechanism] = value``; prompt
    variants (``prompt``) append ``value`` to the harness's main prompt constant."""

    id: str
    mechanism: str
    value: Any
    weigh: Callable[[Evidence], float]  # how strongly the evidence calls for it (0..~1)
    prior: float  # order without evidence (0..1)
    what: str  # the change, for ``changes``
    why: str  # the expected effect, for the hypothesis
    prompt: bool = False


def missing(e: Evidence) -> float:
    return e.frac(e.no_answer + e.not_in_completion)


def unparsed(e: Evidence) -> float:
    return e.frac(e.unparsable)


def short(e: Evidence) -> float:
    return e.frac(e.short_wrong)


def long(e: Evidence) -> float:
    return e.frac(e.wrong - e.short_wrong)


def cut(e: Evidence) -> float:
    return e.frac(e.truncated)


def spent(e: Evidence) -> float:
    return e.frac(e.budget)


def wrong(e: Evidence) -> float:
    return e.frac(e.wrong)


def fmt(e: Evidence) -> float:
    return unparsed(e) + 0.6 * missing(e)


def brief(e: Evidence) -> float:
    return spent(e) + cut(e)


def prompt_edit(vid: str, text: str, weigh: Callable[[Evidence], float], prior: float,
                why: str) -> Variant:  # fmt: skip
    """A prompt-only variant: ``text`` appended to the harness's main prompt constant."""
    return Variant(vid, vid, text, weigh, prior, f"append to the main prompt: {text.strip()!r}",
                   why, prompt=True)  # fmt: skip


def text_catalogue(fewshot: tuple[int, ...], votes: tuple[int, ...],
                   repair: bool = True) -> list[Variant]:  # fmt: skip
    """The mechanisms every answer-text domain shares (arith, math, searchqa); ``repair``: offer
    the same-conversation re-ask (off where the harness already re-asks)."""
    out = [
        Variant("format-strict", "format", "strict",
                lambda e: unparsed(e) + 0.6 * missing(e), 0.8,
                "a stricter answer-format instruction with the exact shape of the answer",
                "Stating the exact answer shape should turn replies the verifier cannot parse "
                "into parsable ones."),
        Variant("retries-2", "retries", 2,
                lambda e: 0.6 * missing(e) + 0.5 * unparsed(e), 0.4,
                "up to 2 fresh attempts (new conversations, trained) while no answer parses",
                "A fresh sample often parses where the first did not; retries cost calls only "
                "on the failing episodes."),
    ]  # fmt: skip
    if repair:
        out.append(Variant(
            "repair", "repair", True, lambda e: missing(e) + 0.8 * unparsed(e), 0.7,
            "re-ask once, in the same conversation, when the reply has no parsable answer",
            "The model usually knows the answer but did not state it in the verifier's format; "
            "one corrective turn recovers it at the cost of one call on those episodes only."))  # fmt: skip
    for i, n in enumerate(fewshot):
        out.append(Variant(
            f"fewshot-{n}", "fewshot", n,
            lambda e, p=1.0 - 0.05 * i: p * (0.7 * unparsed(e) + 0.5 * missing(e) + 0.2 * e.frac(e.wrong)),
            0.5 - 0.05 * i,
            f"{n} invented worked example(s) in the answer format as earlier conversation turns",
            "Examples in the exact reply format anchor both the format and the length of the "
            "reply better than an instruction alone."))  # fmt: skip
    for i, k in enumerate(votes):
        out.append(Variant(
            f"vote-k{k}", "vote", k,
            lambda e, p=1.0 - 0.03 * i: p * (short(e) + 0.6 * long(e)), 0.6 - 0.05 * i,
            f"self-consistency: {k} independent attempts, majority answer (every attempt is "
            "trained only when its own answer verifies)",
            "Answered-but-wrong episodes with short completions look like sampling noise; a "
            "majority over independent samples removes much of it."))  # fmt: skip
    out += [
        Variant("verify", "verify", True, lambda e: long(e) + 0.6 * short(e), 0.55,
                "a verification turn: the model re-checks its answer in the same conversation "
                "and the re-checked answer is submitted when it parses",
                "Wrong answers after long working often contain a slip that a re-check in the "
                "same conversation catches."),
        Variant("tokens-x2", "tokens", "x2", cut, 0.2,
                "twice the completion-token limit per call",
                "Completions cut at the token limit lose the answer; more room keeps it."),
        Variant("tokens-half", "tokens", "half", spent, 0.1,
                "half the completion-token limit per call",
                "Budget stops end episodes before they are scored; shorter calls leave room."),
    ]  # fmt: skip
    return out


# ---- rendering: source text helpers ------------------------------------------------------------


def literal(text: str, indent: int = 4) -> str:
    """Python source for a string constant: one literal when short, else implicitly concatenated
    pieces (broken after spaces and newlines) in parentheses, indented by ``indent``."""
    one = json.dumps(text, ensure_ascii=False)
    if len(one) <= 80 and "\n" not in text.rstrip("\n"):
        return one
    pieces: list[str] = []
    line = ""
    for token in re.split(r"(?<=[ \n])", text):
        if line and len(line) + len(token) > 76:
            pieces.append(line)
            line = ""
        line += token
        if line.endswith("\n"):
            pieces.append(line)
            line = ""
    if line:
        pieces.append(line)
    pad = " " * indent
    body = "".join(f"{pad}{json.dumps(p, ensure_ascii=False)}\n" for p in pieces)
    return "(\n" + body + " " * (indent - 4) + ")"


def assign(name: str, value: Any) -> str:
    """A module-level constant: strings as literals, ints, or (question, answer) pairs."""
    if isinstance(value, str):
        return f"{name} = {literal(value)}"
    if isinstance(value, bool | int):
        return f"{name} = {value!r}"
    rows = "".join(f"    ({literal(q, 8)}, {literal(a, 8)}),\n" for q, a in value)
    return f"{name} = (\n{rows})"


def code_ids(variants: list[Variant], recipe: dict[str, Any]) -> list[str]:
    """The ids of a recipe's code variants, in catalogue order."""
    return [v.id for v in variants if not v.prompt and recipe.get(v.mechanism) == v.value]


def module(domain: str, ids: list[str], imports: list[str], constants: list[str],
           functions: list[str]) -> str:  # fmt: skip
    """A harness module: a docstring naming ``ids`` (the recipe's mechanisms), the imports,
    constants and functions."""
    doc = (
        '"""'
        + textwrap.fill(
            f"{domain} harness from the offline proposer. Mechanisms on h0's structure: "
            f"{', '.join(ids) or 'none (h0 behaviour)'}.",
            96,
        )
        + '"""'
    )
    head = "\n".join([doc, "", *imports, *([""] if imports else []), *constants])
    return head + "\n\n\n" + "\n\n\n".join(f.strip("\n") for f in functions) + "\n"


def scaled(tokens: int, recipe: dict[str, Any]) -> int:
    factor = recipe.get("tokens")
    return tokens * 2 if factor == "x2" else max(4, tokens // 2) if factor == "half" else tokens


# ---- rendering: fragments shared by the answer-text domains --------------------------------------

ROOM = r'''
def room(model, continuing=False):
    """Whether one more call of MAX_NEW_TOKENS fits what the episode has left. model.remaining
    is empty before the first call; its "turns" counts the last call's conversation."""
    left = model.remaining
    if continuing and left.get("turns", 1) < 1:
        return False
    tokens = left.get("assistant_tokens", MAX_NEW_TOKENS)
    return left.get("model_calls", 1) > 0 and tokens >= MAX_NEW_TOKENS
'''

MAJORITY = r'''
def majority(replies):
    """The earliest reply carrying the most common answer; replies without one do not vote."""
    keys = [key(reply) for reply in replies]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return replies[0]
    top = max(counts.values())
    return next(reply for reply, k in zip(replies, keys) if k is not None and counts[k] == top)
'''

FEWSHOT_TURNS = r"""
    for question, answer in EXAMPLES:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
"""

REPAIR_TURN = r"""
    if key(reply) is None and room(model, True):
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": REPAIR_PROMPT},
        ]
        reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)
"""

VERIFY_TURN = r"""
    if key(reply) is not None and room(model, True):
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": VERIFY_PROMPT},
        ]
        checked = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)
        if key(checked) is not None:
            reply = checked
"""

RUN_HEAD = r"""
def run(task, model, tools):
    reply = attempt(task, model, tools, True)
"""

RUN_RETRIES = r"""
    for _ in range(RETRIES):
        if key(reply) is not None or not room(model):
            break
        reply = attempt(task, model, tools, True)
"""

RUN_VOTE = r"""
    replies = [reply]
    while len(replies) < VOTES and room(model):
        try:
            replies.append(attempt(task, model, tools, True))
        except (model.BudgetExceeded, model.ModelError):
            break
    reply = majority(replies)
"""


def text_module(domain: str, ids: list[str], recipe: dict[str, Any], imports: list[str],
                constants: list[str], helpers: list[str], attempt: str,
                submit: str = "reply") -> str:  # fmt: skip
    """The shared shape of the answer-text domains: ``attempt`` is one conversation; ``run`` adds
    fresh retries and a vote around it."""
    if recipe.get("retries"):
        constants.append(assign("RETRIES", recipe["retries"]))
    if recipe.get("vote"):
        constants.append(assign("VOTES", recipe["vote"]))
        imports = [*imports, "from collections import Counter"]
        helpers = [*helpers, MAJORITY]
    run = RUN_HEAD.rstrip("\n")
    if recipe.get("retries"):
        run += RUN_RETRIES.rstrip("\n")
    if recipe.get("vote"):
        run += RUN_VOTE.rstrip("\n")
    run += f"\n    return {submit}\n"
    return module(domain, ids, imports, constants, [*helpers, ROOM, attempt, run])


def attempt_text(doc: str, before: str, opening: str, first_call: str, recipe: dict[str, Any],
                 repair: bool) -> str:  # fmt: skip
    """``attempt``: [code before the prompt, e.g. retrieval], the system prompt, [few-shot turns],
    the opening user message, the first call (or a tool or search loop), [repair], [verify]."""
    doc = textwrap.fill(doc, 92, subsequent_indent="    ")
    out = f'\ndef attempt(task, model, tools, train):\n    """{doc}"""\n'
    if before:
        out += before.strip("\n") + "\n"
    out += '    messages = [{"role": "system", "content": SYSTEM_PROMPT}]'
    if recipe.get("fewshot"):
        out += FEWSHOT_TURNS.rstrip("\n")
    out += "\n" + opening.strip("\n") + "\n" + first_call.strip("\n")
    if repair:
        out += REPAIR_TURN.rstrip("\n")
    if recipe.get("verify"):
        out += VERIFY_TURN.rstrip("\n")
    return out + "\n    return reply\n"


# ---- prompt-only edits -------------------------------------------------------------------------


def prompt_target(tree: ast.Module) -> tuple[str, ast.Constant] | None:
    """The main prompt constant: a module-level ``NAME = "text"`` among the prompt constants the
    phase's prompt-only audit lets change (``harness.search.validate.PROMPT_CONSTANTS``),
    SYSTEM_PROMPT first, else the longest; None when there is none."""
    found = [
        (node.targets[0].id, node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in PROMPT_CONSTANTS
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    if not found:
        return None
    return min(found, key=lambda f: (f[0] != "SYSTEM_PROMPT", -len(f[1].value)))


def edit_prompt(source: str, addition: str) -> str | None:
    """``source`` with ``addition`` appended to its main prompt constant and nothing else
    changed (None when it has no such constant). Braces are doubled when the constant is the
    receiver of ``.format``, so the template keeps its fields."""
    tree = ast.parse(source)
    target = prompt_target(tree)
    if target is None:
        return None
    name, node = target
    formatted = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "format"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == name
        for n in ast.walk(tree)
    )
    if formatted:
        addition = addition.replace("{", "{{").replace("}", "}}")
    text = node.value
    # A sentence after a block that ends a line starts the next line, not " " + sentence.
    text += addition.lstrip(" ") if text.endswith("\n") else addition
    statement = next(
        n for n in tree.body if isinstance(n, ast.Assign) and n.value is node
    )  # the whole ``NAME = (...)``, parentheses included
    lines = source.splitlines(keepends=True)
    # AST columns count UTF-8 bytes.
    start = sum(len(x.encode()) for x in lines[: statement.lineno - 1]) + statement.col_offset
    end = sum(len(x.encode()) for x in lines[: statement.end_lineno - 1]) + (
        statement.end_col_offset or 0
    )
    data = source.encode()
    new = f"{name} = {literal(text)}".encode()
    return (data[:start] + new + data[end:]).decode()
