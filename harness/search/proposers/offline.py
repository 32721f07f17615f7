"""The offline proposer: harness candidates from a catalogue of real transformations, no LLM.

It is the default proposer where no network is reachable. Each domain has a catalogue of
*variants*: one mechanism at one setting, with a stable id (``repair``, ``vote-k5``,
``obs-pieces``, ...). A variant is a change to a *recipe*, a dict from mechanism to setting, and
a recipe renders (``render``) to a complete harness module that contains the code of exactly the
mechanisms it names: the empty recipe is h0's behaviour, written in the same shape.

Lineage: candidates compose along the proposer's own line. Every proposal records its variant id
and its full recipe in ``changes``; a later call reads them back from every ``proposal.json`` of
every phase. The *base* is the best candidate of the current phase whose recipe is known (one of
this proposer's candidates, a harness with the same source, or h0 itself, whose recipe is empty);
each proposal is the base's recipe plus one variant, so the winner of one iteration carries its
mechanisms into the next. A best harness the proposer did not write (an LLM proposer's) cannot be
decomposed into mechanisms, so code variants build on the best *known* recipe instead; prompt-only
edits work on any source and apply to the best candidate itself.

Evidence: the traces of the base (``traces.jsonl``; else of the best evaluated candidate, else of
the previous phase's accepted one), counted by outcome (``Evidence``): episodes
that ended without an answer or with no parsable answer, answered but wrong (with short or long
completions), budget stops, completions cut at the token limit, and per domain: shallow retrieval
(searchqa), wrong answers after a tool turn (math), illegal / malformed / rejected moves and
give-ups (chess). Each variant weighs the evidence that its mechanism addresses (format repair and
instruction for missing answers, voting and verification for wrong ones, fewer or shorter calls
for budget stops, observation formatting and retries for illegal moves, ...); the highest weights
win, one variant per mechanism per call while the catalogue allows. Without traces the
catalogue's priors order the variants. The seed only breaks exact ties, so proposals are a
function of (seed, archive contents).

A variant id is never proposed twice in one archive (across phases): when the catalogue is spent
the proposer says so in its problems instead of repeating itself.

Prompt-only mode (the Fast-Slow control): only the values of module-level string constants
change. The edit appends a sentence or block to the harness's main prompt constant (an UPPER_CASE
module-level string, as the phase's prompt-only audit defines them: the one named like
``SYSTEM_PROMPT``, else the longest prose one) and splices the new literal into the
source, so the code is untouched byte for byte; braces are doubled when the constant is a
``.format`` template.

Every generated source passes ``harness.static_check.check_source`` for the domain before it is
returned. Few-shot examples are invented from each domain's public format and written so the
prompt audits cannot mistake them for answers: arithmetic examples use the operands 0 and 1 (the
generator never does), harness-written example text holds no number of two or more digits
(``harness.audits`` ignores shorter strings), question-answering examples name invented places
and people, and no chess prompt spells out a move.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import random
import re
import textwrap
from collections.abc import Callable
from typing import Any

from harness.domains import get_domain
from harness.domains.base import Domain
from harness.records import EpisodeRecord
from harness.search.archive import Archive, Candidate, Phase, Proposal
from harness.search.proposers.base import ProposeRequest
from harness.search.validate import PROMPT_CONSTANTS
from harness.static_check import check_source

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
    shallow: int = 0  # searchqa: wrong answers after at most one search
    tool_wrong: int = 0  # math: wrong answers after a Python tool turn
    illegal: int = 0  # chess: episodes with an illegal move attempt
    malformed: int = 0  # chess: episodes with a malformed or rejected move attempt

    def frac(self, count: int) -> float:
        return count / self.n if self.n else 0.0

    def describe(self) -> str:
        if not self.n:
            return "No traces to read yet, so the catalogue's default order applies."
        head = f"Traces of {self.source} ({self.n} episodes): {self.correct} rewarded"
        if self.domain == "chess":
            body = (
                f", {self.wrong} played a wrong move, {self.no_answer} ended without a verdict "
                f"(retries spent), {self.illegal} tried an illegal move and {self.malformed} a "
                f"malformed or rejected one, {self.budget} budget stops, {self.truncated} with a "
                f"completion cut at the token limit."
            )
        else:
            body = (
                f", {self.wrong} answered wrong ({self.short_wrong} with final completions of at "
                f"most {SHORT_TOKENS} tokens), {self.no_answer} without an answer, "
                f"{self.unparsable} with no parsable answer, {self.not_in_completion} not in a "
                f"completion, {self.budget} budget stops, {self.truncated} cut at the token limit"
            )
            if self.domain == "searchqa":
                body += f", {self.shallow} of the wrong answers after at most one search"
            if self.domain == "math":
                body += f", {self.tool_wrong} wrong after a Python turn"
            body += "."
        crash = f" {self.crashed} crashed." if self.crashed else ""
        return head + body + crash


def gather_evidence(domain: str, source: str, records: list[EpisodeRecord]) -> Evidence:
    ev = Evidence(domain=domain, source=source)
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
        elif domain == "chess":
            statuses = {str(t.result.get("status")) for t in r.tool_calls
                        if isinstance(t.result, dict)}  # fmt: skip
            ev.illegal += "illegal" in statuses
            ev.malformed += bool(statuses & {"malformed", "rejected"})
            if stop == "failed":
                ev.wrong += 1
            else:
                ev.no_answer += 1
        elif r.extracted is not None:
            ev.wrong += 1
            last = r.calls[-1] if r.calls else None
            size = (last.completion_tokens or len(last.text.split())) if last else 0
            ev.short_wrong += size <= SHORT_TOKENS
            ev.tool_wrong += domain == "math" and bool(r.tool_calls)
            searches = sum(t.name == "search" for t in r.tool_calls)
            ev.shallow += domain == "searchqa" and searches <= 1
        elif stop == "answer_not_in_completion":
            ev.not_in_completion += 1
        elif r.answer is None or not r.answer.strip():
            ev.no_answer += 1
        else:
            ev.unparsable += 1
    return ev


# ---- the catalogue -----------------------------------------------------------------------------


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


def text_catalogue(domain: str, fewshot: tuple[int, ...], votes: tuple[int, ...]) -> list[Variant]:
    """The mechanisms every answer-text domain shares (arith, math, searchqa)."""
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
    if domain != "searchqa":  # h0 for searchqa already re-asks once for the answer tag
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


def catalogue(domain: str) -> list[Variant]:
    """Every code variant of a domain, in prior order within each mechanism."""
    if domain == "arith":
        return text_catalogue("arith", (2, 4), (5, 3, 7)) + [
            Variant("reason", "reason", True, lambda e: 0.8 * short(e) + 0.3 * long(e), 0.45,
                    "a few lines of working, then a final line 'Answer: <integer>'; the "
                    "submission starts at that integer",
                    "Bare-number replies are wrong when the sum needs carrying; a little working "
                    "before the answer line makes the arithmetic explicit."),
        ]  # fmt: skip
    if domain == "math":
        return text_catalogue("math", (1, 2), (3, 5)) + [
            Variant("turns-3", "turns", 3,
                    lambda e: e.frac(e.tool_wrong) + 0.2 * long(e), 0.35,
                    "up to 2 Python tool turns before the final answer (h0: 1)",
                    "Wrong answers after a tool turn suggest the first program was not the last "
                    "word; a second run lets the model check or fix it."),
            Variant("turns-1", "turns", 1, lambda e: 0.8 * spent(e) + 0.3 * cut(e), 0.15,
                    "no tool turn: one reasoning call",
                    "Budget stops and cut completions leave no room for a tool round trip."),
        ]  # fmt: skip
    if domain == "searchqa":
        return text_catalogue("searchqa", (2, 1), (3, 5)) + [
            Variant("depth-3", "depth", 3, lambda e: 1.1 * e.frac(e.shallow), 0.75,
                    "retrieval depth 3: the top 3 passages of each search (h0: 1)",
                    "Wrong answers given after reading one passage often mean the passage lacked "
                    "the answer; the next passages frequently hold it."),
            Variant("depth-5", "depth", 5, lambda e: 1.0 * e.frac(e.shallow), 0.5,
                    "retrieval depth 5: the top 5 passages of each search",
                    "A deeper list covers questions whose answer sits below the top hits."),
            Variant("rewrite", "rewrite", True, lambda e: 0.95 * e.frac(e.shallow), 0.45,
                    "query rewriting: the model first writes a keyword query; its passages come "
                    "first, the question's own top passages after them",
                    "Questions phrased as sentences retrieve poorly; a keyword query written by "
                    "the model finds the passage the question's wording misses."),
            Variant("hops-2", "hops", 2, lambda e: 0.9 * e.frac(e.shallow), 0.4,
                    "up to 2 follow-up searches the model asks for with <search>query</search>",
                    "Multi-hop questions need a second search for the bridging entity."),
            Variant("hops-3", "hops", 3, lambda e: 0.85 * e.frac(e.shallow), 0.3,
                    "up to 3 follow-up searches the model asks for with <search>query</search>",
                    "Questions with several hops need more than one follow-up search."),
            Variant("obs-numbered", "obs", "numbered", lambda e: 0.3 * e.frac(e.wrong), 0.25,
                    "passages numbered, with the title on its own line",
                    "Numbered passages with separate titles are easier to tell apart and read."),
        ]  # fmt: skip
    if domain == "chess":
        wrong = lambda e: e.frac(e.wrong)  # noqa: E731
        return [
            Variant("format-strict", "format", "strict",
                    lambda e: e.frac(e.malformed) + 0.4 * missing(e), 0.7,
                    "instruction: copy exactly one move from the legal-move list",
                    "Malformed or rejected attempts come from replies that are not one bare "
                    "move; asking for a copied list entry removes the guesswork."),
            Variant("obs-coords", "obs", "coords", lambda e: e.frac(e.illegal), 0.65,
                    "board shown with rank numbers and file letters",
                    "Illegal attempts mean the model misreads squares; coordinates on the board "
                    "make each piece's square explicit."),
            Variant("obs-pieces", "obs", "pieces",
                    lambda e: 0.9 * e.frac(e.illegal) + 0.3 * wrong(e), 0.6,
                    "a piece list per side (piece and square) read from the FEN, with the board",
                    "A piece list names every piece's square, which a grid of letters leaves the "
                    "model to count."),
            Variant("obs-compact", "obs", "compact", lambda e: 0.8 * spent(e), 0.1,
                    "FEN and legal moves only, without the board",
                    "Budget stops call for shorter prompts; the board repeats the FEN."),
            Variant("retries-5", "retries", 5,
                    lambda e: 0.9 * missing(e) + 0.4 * e.frac(e.illegal), 0.45,
                    "6 tries per move (h0: 3), within the episode's retry budget",
                    "Episodes that end without a verdict ran out of tries on rejected moves; more "
                    "tries let a legal move through."),
            Variant("retries-0", "retries", 0, spent, 0.05,
                    "one try per move, no retries",
                    "Budget stops mean retries eat the episode's budget."),
            Variant("feedback-reason", "feedback", "reason",
                    lambda e: 0.9 * e.frac(e.illegal) + 0.6 * missing(e), 0.55,
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
    raise ValueError(f"the offline proposer has no catalogue for domain {domain!r}")


# Prompt-only edits: text appended to the harness's main prompt constant.
ARITH_PROMPT_EXAMPLES = (
    "\n\nExamples of questions and replies:\nWhat is 1 + 8? -> 9\nWhat is 9 - 1? -> 8\n"
    "What is 1 * 7 + 0? -> 7\n"
)
MATH_PROMPT_EXAMPLE = (
    "\n\nExample.\nProblem: The sum of two numbers is 9 and their difference is 3. What is the "
    "larger number?\nSolution: Adding the two equations gives twice the larger number equal to "
    "9 + 3, so the larger number is 6.\n\\boxed{6}\n"
)
SEARCHQA_PROMPT_EXAMPLES = (
    "\n\nExamples:\nPassage: Corvel Bay: The lighthouse of Corvel Bay was designed by the engineer "
    "Ada Morrin.\nQuestion: Who designed the lighthouse of Corvel Bay?\n<answer>Ada Morrin</answer>"
    "\n\nPassage: Lake Tessaly: Lake Tessaly is fed by the river Olwen and drains into the Varn."
    "\nQuestion: Which river feeds Lake Tessaly?\n<answer>Olwen</answer>\n"
)


def prompt_catalogue(domain: str) -> list[Variant]:
    def edit(vid, text, weigh, prior, why):
        return Variant(vid, vid, text, weigh, prior, f"append to the main prompt: {text.strip()!r}",
                       why, prompt=True)  # fmt: skip

    wrong = lambda e: e.frac(e.wrong)  # noqa: E731
    fmt = lambda e: unparsed(e) + 0.6 * missing(e)  # noqa: E731
    brief = lambda e: spent(e) + cut(e)  # noqa: E731
    if domain == "arith":
        return [
            edit("prompt-format-strict", " Write the result as an integer in digits, with a "
                 "leading minus sign if it is negative, and no words, units or commas.", fmt, 0.8,
                 "An explicit answer shape makes more replies parsable."),
            edit("prompt-fewshot-3", ARITH_PROMPT_EXAMPLES, lambda e: 0.8 * fmt(e), 0.6,
                 "Examples of the reply format anchor it better than the instruction alone."),
            edit("prompt-careful", " Add carefully, digit by digit, before you reply.", wrong, 0.5,
                 "Wrong answers suggest slips; an explicit call for care costs nothing."),
            edit("prompt-no-words", " Do not start with words such as 'The answer is': the "
                 "first thing you write is the number.", lambda e: unparsed(e) + 0.3 * cut(e),
                 0.45, "Replies that open with words get cut or carry a stray number first; "
                 "a bare number first is what the verifier reads."),
            edit("prompt-precedence", " Multiply before you add or subtract; otherwise work "
                 "from left to right.", lambda e: 0.7 * e.frac(e.wrong), 0.35,
                 "Mixed expressions go wrong when the operations are done in reading order."),
            edit("prompt-sign", " When the result is below zero, write it with a leading minus "
                 "sign.", lambda e: 0.4 * e.frac(e.wrong), 0.2,
                 "Negative results lose their sign in bare-number replies."),
        ]  # fmt: skip
    if domain == "math":
        return [
            edit("prompt-format-strict", " End with exactly one \\boxed{} holding only the final "
                 "answer, simplified (an integer, a reduced fraction or an exact expression), "
                 "with no units or words inside the box.", fmt, 0.8,
                 "An explicit answer shape makes more replies parsable."),
            edit("prompt-fewshot-1", MATH_PROMPT_EXAMPLE, lambda e: 0.8 * fmt(e), 0.6,
                 "A worked example shows where and how the boxed answer goes."),
            edit("prompt-check", " Before giving the answer, check it against the conditions of "
                 "the problem, substituting it back where you can.", wrong, 0.5,
                 "Wrong answers often fail a simple substitution check."),
            edit("prompt-concise", " Keep the solution short: do not restate the problem or "
                 "repeat steps.", brief, 0.2,
                 "Budget stops and cut completions call for shorter solutions."),
            edit("prompt-exact", " Give exact values (fractions, radicals, multiples of pi), not "
                 "decimal approximations, unless the problem asks for a decimal.",
                 lambda e: 0.6 * long(e) + 0.3 * short(e), 0.35,
                 "Strict matching rejects decimal approximations of exact answers."),
            edit("prompt-plan", " First state what is asked and which quantities are known, "
                 "then solve.", lambda e: 0.5 * e.frac(e.wrong), 0.3,
                 "Wrong answers often solve for a different quantity than the one asked."),
            edit("prompt-python", " For long or error-prone computation, prefer the Python block "
                 "over working it out by hand.", lambda e: 0.5 * e.frac(e.wrong - e.tool_wrong),
                 0.25, "Wrong answers without a tool turn include arithmetic slips that a short "
                 "program avoids."),
        ]  # fmt: skip
    if domain == "searchqa":
        return [
            edit("prompt-format-strict", " The answer inside the tags must be as short as "
                 "possible: a name, a date, a number or a short phrase, never a sentence.", fmt,
                 0.8, "Exact match rewards the bare entity; sentences inside the tags fail it."),
            edit("prompt-fewshot-2", SEARCHQA_PROMPT_EXAMPLES, lambda e: 0.8 * fmt(e), 0.6,
                 "Examples show the bare-entity answer the verifier matches."),
            edit("prompt-grounded", " Take the answer from the passage when it is there; if it "
                 "is not, give your best short answer rather than saying it is unknown.",
                 lambda e: wrong(e) + 0.5 * missing(e), 0.5,
                 "Refusals and off-passage answers score zero; a best guess sometimes scores."),
            edit("prompt-concise", " Reply briefly.", brief, 0.2,
                 "Budget stops and cut completions call for shorter replies."),
            edit("prompt-answer-type", " First decide what kind of answer the question wants (a "
                 "person, a place, a date, a number or a thing) and answer with exactly that.",
                 lambda e: 0.8 * e.frac(e.wrong), 0.45,
                 "Wrong answers often name the right passage's other entity, not the kind of "
                 "thing asked."),
            edit("prompt-names", " Write names as the passage writes them, without titles or "
                 "extra words.", lambda e: 0.5 * e.frac(e.wrong) + 0.3 * unparsed(e), 0.3,
                 "Exact match fails on added titles and words around the name."),
            edit("prompt-bridge", " When the question links two things, find the first in the "
                 "passages, then answer about the second.", lambda e: 0.6 * e.frac(e.wrong), 0.25,
                 "Two-hop questions are answered about the bridge entity instead of the target."),
        ]  # fmt: skip
    if domain == "chess":
        return [
            edit("prompt-format-strict", " Write the move exactly as it appears in the list of "
                 "legal moves.", lambda e: e.frac(e.malformed) + 0.4 * missing(e), 0.8,
                 "Malformed and rejected attempts drop when the reply is a copied list entry."),
            edit("prompt-notation", " UCI notation names the square the piece leaves and the "
                 "square it lands on, joined without spaces or dashes (files a to h, ranks 1 to "
                 "8), plus q, r, b or n when a pawn promotes.",
                 lambda e: e.frac(e.malformed + e.illegal), 0.6,
                 "Illegal and malformed attempts suggest the notation is misread."),
            edit("prompt-tactics", " Puzzles reward forcing moves: look at checks first, then "
                 "captures, then threats, and prefer the move that leaves the opponent the fewest "
                 "replies.", wrong, 0.5,
                 "Wrong moves in puzzles are usually quiet moves where a forcing one wins."),
            edit("prompt-mate", " Look for a checkmate first: many puzzles end with one.",
                 lambda e: 0.8 * wrong(e), 0.45,
                 "Mating puzzles are lost by moves that win material instead of mating."),
            edit("prompt-reply", " Before you answer, consider the opponent's best reply to "
                 "your move.", lambda e: 0.7 * wrong(e), 0.35,
                 "Wrong moves are often refuted by one reply the model did not consider."),
            edit("prompt-own-pieces", " Move only your own pieces: upper-case letters on the "
                 "board are White, lower-case are Black.", lambda e: e.frac(e.illegal), 0.3,
                 "Illegal attempts include moves of the opponent's pieces."),
        ]  # fmt: skip
    raise ValueError(f"the offline proposer has no catalogue for domain {domain!r}")


def recipe_ids(domain: str, recipe: dict[str, Any]) -> list[str]:
    """The variant ids a recipe is made of (code variants, then prompt edits in order)."""
    ids = [v.id for v in catalogue(domain) if recipe.get(v.mechanism) == v.value]
    return ids + list(recipe.get("prompts", []))


def valid_recipe(domain: str, recipe: Any) -> bool:
    """A recipe this version can render: known mechanisms at known settings."""
    if not isinstance(recipe, dict):
        return False
    settings = {(v.mechanism, json.dumps(v.value)) for v in catalogue(domain)}
    prompts = {v.id for v in prompt_catalogue(domain)}
    for mech, value in recipe.items():
        if mech == "prompts":
            if not isinstance(value, list) or not all(p in prompts for p in value):
                return False
        elif (mech, json.dumps(value)) not in settings:
            return False
    return True


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


def module(domain: str, recipe: dict[str, Any], imports: list[str], constants: list[str],
           functions: list[str]) -> str:  # fmt: skip
    ids = [i for i in recipe_ids(domain, recipe) if not i.startswith("prompt-")]
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


# ---- rendering: fragments shared by the answer-text domains (arith, math, searchqa) -------------

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


def text_module(domain: str, recipe: dict[str, Any], imports: list[str], constants: list[str],
                helpers: list[str], attempt: str, submit: str = "reply") -> str:  # fmt: skip
    """The shared shape of arith, math and searchqa: ``attempt`` is one conversation; ``run``
    adds fresh retries and a vote around it."""
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
    return module(domain, recipe, imports, constants, [*helpers, ROOM, attempt, run])


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


# ---- arith -------------------------------------------------------------------------------------

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


def render_arith(recipe: dict[str, Any]) -> str:
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
    return text_module("arith", recipe, ["import re"], constants, [locate, ARITH_KEY], attempt,
                       "submission(reply)")  # fmt: skip


# ---- math --------------------------------------------------------------------------------------

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


def render_math(recipe: dict[str, Any]) -> str:
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
    return text_module("math", recipe, ["import re"], constants, [MATH_KEY], attempt)


# ---- searchqa ----------------------------------------------------------------------------------

SEARCHQA_EXAMPLES = (
    ("Passage: Corvel Bay: The lighthouse of Corvel Bay was designed by the engineer Ada Morrin."
     "\n\nQuestion: Who designed the lighthouse of Corvel Bay?", "<answer>Ada Morrin</answer>"),
    ("Passage: Lake Tessaly: Lake Tessaly is fed by the river Olwen and drains into the Varn."
     "\n\nQuestion: Which river feeds Lake Tessaly?", "<answer>Olwen</answer>"),
)  # fmt: skip

SEARCHQA_KEY = r'''
def key(reply):
    """The reply's last <answer> content, normalised (lower case, no punctuation or articles),
    or None."""
    found = ANSWER.findall(reply)
    if not found:
        return None
    words = re.sub(r"[^\w\s]", " ", found[-1].lower()).split()
    return " ".join(w for w in words if w not in ("a", "an", "the")) or None
'''

SEARCHQA_SHOW = r'''
def show(hits):
    """Each passage whole, as the tool returned it (a cut passage would be harness-written)."""
    if not hits:
        return "(no passage found)"
    return "\n\n".join(hit["title"] + ": " + hit["text"] for hit in hits)
'''

SEARCHQA_SHOW_NUMBERED = r'''
def show(hits):
    """Each passage whole and numbered, its title on a line of its own."""
    if not hits:
        return "(no passage found)"
    return "\n\n".join(
        "[" + str(i) + "] " + hit["title"] + "\n" + hit["text"] for i, hit in enumerate(hits, 1)
    )
'''

SEARCHQA_RETRIEVE = r'''
def retrieve(tools, queries):
    """The passages of each query in turn, repeats dropped, at most MAX_PASSAGES in all."""
    hits = []
    for query in queries:
        for hit in tools.search(query, DEPTH):
            if len(hits) < MAX_PASSAGES and all(hit["text"] != old["text"] for old in hits):
                hits.append(hit)
    return hits
'''

SEARCHQA_REWRITE = r"""
    asked = [{"role": "user", "content": REWRITE_PROMPT + "\n\nQuestion: " + task.question}]
    written = model.chat(asked, max_new_tokens=QUERY_TOKENS, train=train).strip()
    hits = retrieve(tools, [written.split("\n")[0].strip() or task.question, task.question])
"""

SEARCHQA_OPEN = r"""
    messages.append(
        {"role": "user", "content": LABEL + show(hits) + "\n\nQuestion: " + task.question}
    )
"""

SEARCHQA_HOPS = r"""
    reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)
    seen = len(hits)
    for _ in range(HOPS):
        found = SEARCH.search(reply)
        if key(reply) is not None or found is None or seen >= MAX_PASSAGES:
            break
        if not room(model, True):
            break
        query = found.group(1).strip() or task.question
        more = tools.search(query, min(DEPTH, MAX_PASSAGES - seen))
        seen += len(more)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": LABEL + show(more) + "\n\n" + AFTER_SEARCH},
        ]
        reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)
"""


def render_searchqa(recipe: dict[str, Any]) -> str:
    depth, hops, rewrite = recipe.get("depth", 1), recipe.get("hops", 0), recipe.get("rewrite")
    many = depth > 1 or bool(rewrite)
    prompt = "Answer the question using the passages." if many or hops else (
        "Answer the question using the passage.")  # fmt: skip
    if hops:
        prompt += (" If they do not contain the answer, write <search>a search query</search> and "
                   "nothing else, and you will get more passages.")  # fmt: skip
    if recipe.get("format") == "strict":
        prompt += (" Put only the short answer (a name, a date, a number or a few words, never a "
                   "sentence) inside <answer> and </answer>, for example <answer>Ada Morrin"
                   "</answer>.")  # fmt: skip
    else:
        prompt += (" Put only the short answer inside <answer> and </answer>, for example "
                   "<answer>Paris</answer>.")  # fmt: skip
    constants = [assign("SYSTEM_PROMPT", prompt),
                 assign("LABEL", "Passages:\n" if many else "Passage: ")]  # fmt: skip
    if recipe.get("fewshot"):
        constants.append(assign("EXAMPLES", SEARCHQA_EXAMPLES[: recipe["fewshot"]]))
    if rewrite:
        constants += [assign("REWRITE_PROMPT", (
            "Write a short search query (a few keywords) that would find a passage answering the "
            "question. Reply with the query only.")), assign("QUERY_TOKENS", 32)]  # fmt: skip
    if hops:
        constants += [assign("HOPS", hops), assign("AFTER_SEARCH", (
            "Answer inside <answer> and </answer>, or search again with <search>query</search>.")),
            r'SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)']  # fmt: skip
    constants += [
        assign("REPAIR_PROMPT", "Give the final answer as <answer>...</answer>."),
        assign("DEPTH", depth),
        assign("MAX_PASSAGES", 5),
    ]
    if recipe.get("verify"):
        constants.append(assign("VERIFY_PROMPT", (
            "Check that your answer is supported by the passages and names exactly what the "
            "question asks for. Reply with the final short answer inside <answer> and </answer>.")))  # fmt: skip
    constants += [assign("MAX_NEW_TOKENS", scaled(1024, recipe)),
                  r'ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)']  # fmt: skip
    before = SEARCHQA_REWRITE if rewrite else "    hits = retrieve(tools, [task.question])"
    first = (SEARCHQA_HOPS if hops else
             "    reply = model.chat(messages, max_new_tokens=MAX_NEW_TOKENS, train=train)")  # fmt: skip
    attempt = attempt_text(
        "One conversation: retrieve, show the passages whole, answer; follow-up searches, a "
        "re-ask for the answer tag and a check turn where the recipe has them.",
        before, SEARCHQA_OPEN, first, recipe, True,
    )  # fmt: skip
    show = SEARCHQA_SHOW_NUMBERED if recipe.get("obs") == "numbered" else SEARCHQA_SHOW
    return text_module("searchqa", recipe, ["import re"], constants,
                       [SEARCHQA_KEY, show, SEARCHQA_RETRIEVE], attempt)  # fmt: skip


# ---- chess -------------------------------------------------------------------------------------

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


def render_chess(recipe: dict[str, Any]) -> str:
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
    return module("chess", recipe, imports, constants, [*helpers, run])


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "arith": render_arith, "math": render_math, "searchqa": render_searchqa, "chess": render_chess,
}  # fmt: skip


def render(domain: str, recipe: dict[str, Any]) -> str:
    """The complete harness of a recipe: its code variants, then its prompt edits in order."""
    source = RENDERERS[domain](recipe)
    edits = {v.id: v.value for v in prompt_catalogue(domain)}
    for vid in recipe.get("prompts", []):
        edited = edit_prompt(source, edits[vid])
        if edited is None:
            raise ValueError(f"{domain} recipe: no prompt constant for {vid}")
        source = edited
    return source


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


# ---- reading the archive -----------------------------------------------------------------------

VARIANT_LINE = re.compile(r"^variant:\s*(\S+)\s*$", re.MULTILINE)
RECIPE_LINE = re.compile(r"^recipe:\s*(\{.*\})\s*$", re.MULTILINE)


@dataclasses.dataclass
class Lineage:
    """What the archive says: every candidate, the variant ids tried, and the recipe of every
    source the proposer can rebuild."""

    current: list[Candidate]  # the current phase's candidates
    earlier: list[Phase]  # earlier phases, latest first
    tried: set[str]
    recipes: dict[str, dict[str, Any]]  # source -> recipe
    sources: set[str]


def read_lineage(request: ProposeRequest, domain: Domain) -> Lineage:
    current_phase = Phase(request.phase_dir)
    here = os.path.realpath(request.phase_dir)
    phases = [p for p in Archive(request.archive_dir).phases() if os.path.realpath(p.root) != here]
    tried: set[str] = set()
    recipes: dict[str, dict[str, Any]] = {domain.seed_harness(): {}}
    sources: set[str] = set()
    current = current_phase.candidates()
    for cand in [c for p in phases for c in p.candidates()] + current:
        changes = str(cand.proposal.get("changes", ""))
        tried.update(VARIANT_LINE.findall(changes))
        sources.add(cand.source)
        found = RECIPE_LINE.search(changes)
        if found and cand.proposal.get("proposer") == "offline":  # only its own recipes
            try:
                recipe = json.loads(found.group(1))
            except ValueError:
                continue
            if valid_recipe(domain.name, recipe):
                recipes.setdefault(cand.source, recipe)
    return Lineage(current=current, earlier=phases[::-1], tried=tried, recipes=recipes,
                   sources=sources)  # fmt: skip


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Valid candidates, best first: success up, turns down, then the earlier candidate."""

    def order(c: Candidate) -> tuple[float, float, str]:
        summary = c.summary or {}
        return (
            -float(summary.get("success_rate", 0.0)),
            float(summary.get("mean_turns", 0.0)),
            c.name,
        )

    return sorted((c for c in candidates if c.summary is not None), key=order)


def traces_of(phase: Phase, cand: Candidate) -> list[EpisodeRecord]:
    try:
        return list(phase.traces(cand.name))
    except (OSError, ValueError, TypeError):
        return []


# ---- the proposer ------------------------------------------------------------------------------


@dataclasses.dataclass
class Parent:
    label: str  # how hypotheses name it
    source: str
    recipe: dict[str, Any] | None  # None: not a recipe this proposer can rebuild


class OfflineProposer:
    """Catalogue proposer: evidence from the traces chooses which untried variants to add to the
    best known recipe (see the module docstring)."""

    name = "offline"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def propose(self, request: ProposeRequest) -> tuple[list[Proposal], list[str]]:
        try:
            domain = get_domain(request.domain)
            variants = (prompt_catalogue if request.prompt_only else catalogue)(domain.name)
        except ValueError as e:
            return [], [str(e)]
        if request.slots <= 0:
            return [], []
        lineage = read_lineage(request, domain)
        best = ranked(lineage.current)
        parent, evidence = self.parent(request, domain, lineage, best)
        rng = random.Random(f"{self.seed}/{domain.name}/{request.iteration}")
        order = sorted(
            (v for v in variants if v.id not in lineage.tried and self.changes_parent(v, parent)),
            key=lambda v: (-(round(v.weigh(evidence), 9) + 0.01 * v.prior), rng.random()),
        )
        # The best variant of each mechanism first, so the slots spread over mechanisms; the
        # runners-up only when there are more slots than mechanisms left.
        firsts = [v for i, v in enumerate(order)
                  if all(u.mechanism != v.mechanism for u in order[:i])]  # fmt: skip
        proposals: list[Proposal] = []
        problems: list[str] = []
        for v in firsts + [v for v in order if v not in firsts]:
            if len(proposals) == request.slots:
                break
            made = self.build(domain, v, parent, evidence, lineage)
            if isinstance(made, str):
                problems.append(made)
            else:
                proposals.append(made)
        proposals.sort(key=lambda p: next(i for i, v in enumerate(order) if v.id == p.name))
        if len(proposals) < request.slots:
            problems.append(
                f"{len(proposals)} of {request.slots} slots filled: the {domain.name} "
                f"{'prompt' if request.prompt_only else 'code'} catalogue has no other untried "
                f"variant ({len(lineage.tried)} variant ids tried in this archive)"
            )
        return proposals, problems

    def parent(
        self, request: ProposeRequest, domain: Domain, lineage: Lineage, best: list[Candidate]
    ) -> tuple[Parent, Evidence]:
        """Prompt-only: the best candidate itself (any source). Code variants: the best candidate
        with a known recipe, else the latest earlier phase's accepted one, else h0. Evidence: the
        parent's traces, else the current best candidate's, else (nothing evaluated in this phase
        yet) the traces of the latest accepted candidate of an earlier phase."""
        pool = best if request.prompt_only else [c for c in best if c.source in lineage.recipes]
        chosen = pool[0] if pool else None
        if chosen is not None:
            parent = Parent(chosen.name, chosen.source, lineage.recipes.get(chosen.source))
        else:
            usable = [a for p in lineage.earlier if (a := p.accepted()) is not None
                      and (request.prompt_only or a.source in lineage.recipes)]  # fmt: skip
            if usable:
                src = usable[0].source
                parent = Parent(f"{usable[0].name} (accepted earlier)", src,
                                lineage.recipes.get(src))  # fmt: skip
            else:
                parent = Parent("h0", domain.seed_harness(), {})
        here = Phase(request.phase_dir)
        sources = [(here, c) for c in ([chosen] if chosen is not None else []) + best]
        sources += [(p, a) for p in lineage.earlier if (a := p.accepted()) is not None]
        for phase, cand in sources:
            records = traces_of(phase, cand)
            if records:
                return parent, gather_evidence(domain.name, cand.name, records)
        return parent, Evidence(domain=domain.name)

    @staticmethod
    def changes_parent(v: Variant, parent: Parent) -> bool:
        if v.prompt or parent.recipe is None:
            return True
        return parent.recipe.get(v.mechanism) != v.value

    def build(self, domain: Domain, v: Variant, parent: Parent, evidence: Evidence,
              lineage: Lineage) -> Proposal | str:  # fmt: skip
        """The proposal of one variant on the parent, or the reason there is none."""
        recipe: dict[str, Any] | None = None
        if v.prompt:
            source = edit_prompt(parent.source, v.value)
            if source is None:
                return f"{v.id}: {parent.label} has no module-level prompt string to edit"
            if parent.recipe is not None:
                recipe = {**parent.recipe, "prompts": [*parent.recipe.get("prompts", []), v.id]}
        else:
            recipe = {**(parent.recipe or {}), v.mechanism: v.value}
            source = render(domain.name, recipe)
        violations = check_source(source, allowed_imports=domain.allowed_imports)
        if violations:
            return f"{v.id}: generated source fails the static check: {violations[0]}"
        if source in lineage.sources or source == parent.source:
            return f"{v.id}: the same source is already in the archive"
        lines = [f"variant: {v.id}", f"mechanism: {v.mechanism}: {v.what}",
                 f"base: {parent.label}"]  # fmt: skip
        if recipe is not None:
            lines.append("recipe: " + json.dumps(recipe, sort_keys=True))
        hypothesis = (
            f"{evidence.describe()} {v.why} Change from {parent.label}: {v.what}; nothing else."
        )
        return Proposal(name=v.id, source=source, hypothesis=hypothesis,
                        changes="\n".join(lines), proposer=self.name)  # fmt: skip
