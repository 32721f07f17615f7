"""The offline proposer's recipes for searchqa: its code variants, its prompt-only edits and the
renderer of a recipe. The recipes render a harness-side design (the harness searches the question
and shows the passages), not the reference's h0 where the model calls search itself: a recipe is
an alternative to h0, and the empty recipe is that design's baseline.
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
    fmt,
    missing,
    prompt_edit,
    scaled,
    text_catalogue,
    text_module,
    unparsed,
    wrong,
)

SEARCHQA_PROMPT_EXAMPLES = (
    "\n\nExamples:\nPassage: Corvel Bay: The lighthouse of Corvel Bay was designed by the engineer "
    "Ada Morrin.\nQuestion: Who designed the lighthouse of Corvel Bay?\n<answer>Ada Morrin</answer>"
    "\n\nPassage: Lake Tessaly: Lake Tessaly is fed by the river Olwen and drains into the Varn."
    "\nQuestion: Which river feeds Lake Tessaly?\n<answer>Olwen</answer>\n"
)


def catalogue() -> list[Variant]:
    """Every code variant, in prior order within each mechanism."""
    return text_catalogue((2, 1), (3, 5), repair=False) + [
        Variant("depth-3", "depth", 3, lambda e: 1.1 * e.frac(e.count("shallow")), 0.75,
                "retrieval depth 3: the top 3 passages of each search (h0: 1)",
                "Wrong answers given after reading one passage often mean the passage lacked "
                "the answer; the next passages frequently hold it."),
        Variant("depth-5", "depth", 5, lambda e: 1.0 * e.frac(e.count("shallow")), 0.5,
                "retrieval depth 5: the top 5 passages of each search",
                "A deeper list covers questions whose answer sits below the top hits."),
        Variant("rewrite", "rewrite", True, lambda e: 0.95 * e.frac(e.count("shallow")), 0.45,
                "query rewriting: the model first writes a keyword query; its passages come "
                "first, the question's own top passages after them",
                "Questions phrased as sentences retrieve poorly; a keyword query written by "
                "the model finds the passage the question's wording misses."),
        Variant("hops-2", "hops", 2, lambda e: 0.9 * e.frac(e.count("shallow")), 0.4,
                "up to 2 follow-up searches the model asks for with <search>query</search>",
                "Multi-hop questions need a second search for the bridging entity."),
        Variant("hops-3", "hops", 3, lambda e: 0.85 * e.frac(e.count("shallow")), 0.3,
                "up to 3 follow-up searches the model asks for with <search>query</search>",
                "Questions with several hops need more than one follow-up search."),
        Variant("obs-numbered", "obs", "numbered", lambda e: 0.3 * e.frac(e.wrong), 0.25,
                "passages numbered, with the title on its own line",
                "Numbered passages with separate titles are easier to tell apart and read."),
    ]  # fmt: skip


def prompt_catalogue() -> list[Variant]:
    """The prompt-only edits (the Fast-Slow control)."""
    return [
        prompt_edit("prompt-format-strict", " The answer inside the tags must be as short as "
                    "possible: a name, a date, a number or a short phrase, never a sentence.", fmt,
                    0.8, "Exact match rewards the bare entity; sentences inside the tags fail it."),
        prompt_edit("prompt-fewshot-2", SEARCHQA_PROMPT_EXAMPLES, lambda e: 0.8 * fmt(e), 0.6,
                    "Examples show the bare-entity answer the verifier matches."),
        prompt_edit("prompt-grounded", " Take the answer from the passage when it is there; if it "
                    "is not, give your best short answer rather than saying it is unknown.",
                    lambda e: wrong(e) + 0.5 * missing(e), 0.5,
                    "Refusals and off-passage answers score zero; a best guess sometimes scores."),
        prompt_edit("prompt-concise", " Reply briefly.", brief, 0.2,
                    "Budget stops and cut completions call for shorter replies."),
        prompt_edit("prompt-answer-type", " First decide what kind of answer the question wants (a "
                    "person, a place, a date, a number or a thing) and answer with exactly that.",
                    lambda e: 0.8 * e.frac(e.wrong), 0.45,
                    "Wrong answers often name the right passage's other entity, not the kind of "
                    "thing asked."),
        prompt_edit("prompt-names", " Write names as the passage writes them, without titles or "
                    "extra words.", lambda e: 0.5 * e.frac(e.wrong) + 0.3 * unparsed(e), 0.3,
                    "Exact match fails on added titles and words around the name."),
        prompt_edit("prompt-bridge", " When the question links two things, find the first in the "
                    "passages, then answer about the second.", lambda e: 0.6 * e.frac(e.wrong), 0.25,
                    "Two-hop questions are answered about the bridge entity instead of the target."),
    ]  # fmt: skip


# ---- rendering ----------------------------------------------------------------------------------

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


def render(recipe: dict[str, Any]) -> str:
    """The harness module of a recipe's code variants."""
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
    return text_module("searchqa", code_ids(catalogue(), recipe), recipe, ["import re"], constants,
                       [SEARCHQA_KEY, show, SEARCHQA_RETRIEVE], attempt)  # fmt: skip


# ---- evidence hooks ---------------------------------------------------------------------------


def tally_wrong(ev: Evidence, r: EpisodeRecord) -> None:
    ev.add("shallow", sum(t.name == "search" for t in r.tool_calls) <= 1)


def describe_wrong(ev: Evidence) -> str:
    return f", {ev.count('shallow')} of the wrong answers after at most one search"
