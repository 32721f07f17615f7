"""Prompt audits: what did the harness itself write into the model's prompts?

Text a harness sends is the task's question, the model's own earlier completions, tool results,
and whatever the harness wrote (function schemas included). Only the last is audited. A tool
result is excused only as the tool returned it: a string field whole (also as escaped inside a JSON
string), a list only where all of its elements appear together (joined by punctuation or spaces, in
any order). A single legal move copied out of the legal-move list, or a
sentence cut out of a passage, is harness-written text.

Two flags per episode (``EpisodeRecord``):
- ``gold_in_prompt``: harness-written text contains a gold answer;
- ``answer_from_harness``: harness-written text contains the episode's submitted answer (the
  extracted answer, or for chess each move played): the model was told what to answer.
Strings shorter than 2 characters are skipped (they occur in any text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from harness.records import EpisodeRecord

_SEP = r"[\W_]{1,12}"


def _excusals(value: Any, strings: list[str], lists: list[list[str]]) -> None:
    """Collect a tool result's whole strings (dict values, the value itself) and its lists of
    scalars (excused only together)."""
    if isinstance(value, str):
        strings.append(value)
        escaped = json.dumps(value, ensure_ascii=False)[1:-1]
        if escaped != value:  # the same text inside a JSON string the harness built
            strings.append(escaped)
    elif isinstance(value, dict):
        for v in value.values():
            _excusals(v, strings, lists)
    elif isinstance(value, (list, tuple)):
        scalars = [
            str(v) for v in value if isinstance(v, (str, int, float)) and not isinstance(v, bool)
        ]
        if scalars:
            lists.append(scalars)
        for v in value:
            if isinstance(v, (dict, list, tuple)):
                _excusals(v, strings, lists)


def _remove_lists(text: str, lists: list[list[str]]) -> str:
    for items in lists:
        wanted = {s for s in items if s}
        if not wanted:
            continue
        alt = "|".join(re.escape(s) for s in sorted(wanted, key=len, reverse=True))
        run = re.compile(rf"(?<!\w)(?:{alt})(?:{_SEP}(?:{alt}))*(?!\w)")
        pieces, last = [], 0
        for m in run.finditer(text):
            if set(re.findall(alt, m.group(0))) >= wanted:
                pieces += [text[last : m.start()], " "]
                last = m.end()
        if last:
            text = "".join(pieces) + text[last:]
    return text


def harness_written(record: EpisodeRecord, question: str) -> list[str]:
    """Per call, per non-assistant message: the text left after removing what the harness did
    not write (the question, earlier completions, tool results as returned)."""
    strings: list[str] = [question]
    lists: list[list[str]] = []
    for t in record.tool_calls:
        _excusals(t.result, strings, lists)
    out = []
    for i, call in enumerate(record.calls):
        earlier = [c.text for c in record.calls[:i]] + [c.raw_text for c in record.calls[:i]]
        removable = sorted({r for r in strings + earlier if r}, key=len, reverse=True)
        for m in call.messages:
            if m.get("role") == "assistant":
                continue
            text = m.get("content", "")
            for r in removable:
                if r in text:
                    text = text.replace(r, " ")
            out.append(_remove_lists(text, lists))
        if call.tools:  # function schemas are the harness's words too
            out.append(json.dumps(call.tools, ensure_ascii=False))
    return out


def _patterns(values: Iterable[str]) -> list[re.Pattern[str]]:
    return [
        re.compile(r"(?<![\w.])" + re.escape(v.strip()) + r"(?!\w)")
        for v in values
        if len(v.strip()) >= 2
    ]


def contains_any(texts: list[str], values: Iterable[str]) -> bool:
    patterns = _patterns(values)
    return bool(patterns) and any(p.search(t) for t in texts for p in patterns)


def gold_in_prompts(record: EpisodeRecord, question: str, golds: list[str]) -> bool:
    """Does harness-written prompt text contain a gold answer?"""
    return contains_any(harness_written(record, question), golds)


def audit(record: EpisodeRecord, question: str, golds: list[str], answers: list[str]) -> None:
    """Set ``gold_in_prompt`` and ``answer_from_harness`` on the record."""
    texts = harness_written(record, question)
    record.gold_in_prompt = contains_any(texts, golds)
    record.answer_from_harness = contains_any(texts, answers)
