"""Small real backends: the instant model of the executor benchmark and of sandbox tests.

``ScriptedBackend`` answers with a function of the request and tokenises with a byte tokenizer
(one id per UTF-8 byte, ChatML-style special ids above 255), so prompt and completion ids, token
counts, stop strings, ``max_new_tokens`` and the prompt budget all behave as an engine's would.
A completion that stops ends its turn with ``IM_END``, as a ChatML model does, so a conversation's
next prompt extends the previous prompt and completion token for token (one training row).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from harness.api import ChatRequest, ChatResult
from harness.tool_calls import parse_tool_calls

IM_START, IM_END = 256, 257
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def render_prompt(
    messages: tuple[dict[str, str], ...] | list[dict[str, str]], tools: Sequence[Any] = ()
) -> list[int]:
    ids: list[int] = []
    if tools:  # the schemas as a turn of their own before the conversation
        ids.append(IM_START)
        ids.extend(("tools\n" + json.dumps(list(tools), ensure_ascii=False)).encode())
        ids.append(IM_END)
        ids.extend(b"\n")
    for m in messages:
        ids.append(IM_START)
        ids.extend(f"{m['role']}\n{m['content']}".encode())
        ids.append(IM_END)
        ids.extend(b"\n")
    ids.append(IM_START)
    ids.extend(b"assistant\n")
    return ids


def strip_thinking(text: str) -> str:
    return _THINK.sub("", text)


class ScriptedBackend:
    """``respond(request) -> completion text``; ``delay_s`` simulates a model's latency."""

    def __init__(self, respond: Callable[[ChatRequest], str], delay_s: float = 0.0):
        self.respond = respond
        self.delay_s = delay_s

    def chat(self, request: ChatRequest) -> ChatResult:
        prompt_ids = render_prompt(request.messages, request.tools)
        if request.max_prompt_tokens is not None and len(prompt_ids) > request.max_prompt_tokens:
            return ChatResult(
                text="",
                raw_text="",
                prompt_ids=tuple(prompt_ids),
                finish_reason="prompt_too_long",
                prompt_tokens=len(prompt_ids),
                error="prompt_too_long",
            )
        if self.delay_s:
            time.sleep(self.delay_s)
        raw = self.respond(request)
        finish = "stop"
        for s in request.settings.stop:
            if s and s in raw:
                raw = raw[: raw.index(s) + len(s)]
        data = raw.encode()
        limit = request.settings.max_new_tokens
        if len(data) >= limit:
            data, finish = data[:limit], "length"
            raw = data.decode(errors="ignore")
        completion_ids = list(data) + ([IM_END] if finish == "stop" else [])
        return ChatResult(
            text=strip_thinking(raw),
            raw_text=raw,
            prompt_ids=tuple(prompt_ids),
            completion_ids=tuple(completion_ids),
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(completion_ids),
            tool_calls=parse_tool_calls(strip_thinking(raw)),
        )
