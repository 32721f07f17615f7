"""Chat formats and sessions: messages -> token ids, completions -> visible text and tool calls.

A ``ChatFormat`` renders messages with a Jinja chat template (the checkpoint's, or one bundled here)
and knows its family's conventions: the end-of-turn token, whether the generation prompt opens a
``<think>`` block, and how tool calls are written.

Sessions are token-level. The first call of a conversation renders the template once; every later
turn appends only ``ChatFormat.delta(new_messages)`` — the template's rendering of the messages
that follow an assistant turn — to the exact token sequence so far. Earlier turns are never
re-rendered and sampled tokens are never re-tokenised: Qwen3.5's template drops the thinking of
earlier turns when it re-renders them, so a re-rendered conversation is not what the model saw.
``Session`` holds the sequence so far; training rows are built from the records
(``whale_jax.train.rows``).

Families:
- ``qwen3_5``: thinking on by default (the generation prompt ends inside ``<think>``;
  ``enable_thinking=False`` closes an empty block instead); the visible text is what follows the
  last ``</think>``; tool calls are ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  </function></tool_call>`` (the JSON form ``<tool_call>{"name": .., "arguments": ..}</tool_call>``
  is accepted too).
- ``chatml`` (SmolLM2 and other small dense models): plain ChatML; no thinking; tool calls as
  ``<tool_call>{json}</tool_call>`` text tags and tool results shown as a user turn wrapped in
  ``<tool_response>`` tags.

Tools (function schemas) are rendered by the template when it renders them (Qwen3.5's does);
for a template that never mentions tools (plain ChatML, SmolLM2's) the schemas and the JSON call
form are written into the system message as text (``tools_text``), which any template can show.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any, Protocol

from harness.api import ToolCall  # one tool-call type from the model to the harness
from harness.tool_calls import MALFORMED_TOOL_CALL, parse_tool_calls

__all__ = [
    "MALFORMED_TOOL_CALL",
    "ChatFormat",
    "Reply",
    "Session",
    "format_for",
    "parse_tool_calls",
]

# A Qwen3.5-style template, written for this project from the published format (ChatML turns,
# <think> blocks kept only after the last user query, <tool_call> XML, tool results grouped into
# one user turn of <tool_response> blocks, thinking on by default). Real runs use the checkpoint's.
QWEN3_5_TEMPLATE = """\
{%- set think_off = enable_thinking is defined and enable_thinking is false -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n'
    '<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' and not (m.content.startswith('<tool_response>')) %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content %}
{%- set reasoning = '' %}
{%- if m.reasoning_content is defined and m.reasoning_content %}
{%- set reasoning = m.reasoning_content %}
{%- endif %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query %}
{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content }}
{%- if m.tool_calls %}
{%- for call in m.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n<function=' + fn.name + '>\\n' }}
{%- for key, value in fn.arguments.items() %}
{{- '<parameter=' + key + '>\\n' }}
{{- value if value is string else (value | tojson) }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if think_off %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

# Plain ChatML, no default system prompt.
CHATML_TEMPLATE = """\
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_MARKER = "WHALEDELTAMARKER7319"


def tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """The text fallback for tools: the schemas, one JSON object a line, and the call form."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call these functions:\n<tools>\n" + lines + "\n</tools>\n\n"
        "To call one, reply with:\n"
        '<tool_call>\n{"name": NAME, "arguments": {ARGUMENTS AS JSON}}\n</tool_call>'
    )


class Tokenizer(Protocol):
    """What the chat layer needs: special tokens in text are recognised; no BOS/EOS is added."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply:
    """A parsed completion: visible ``text`` (no thinking), the ``thinking``, and tool calls.
    A tool call that does not parse is kept as ``ToolCall(name=MALFORMED_TOOL_CALL, arguments=
    {"error": why, "raw": the block})`` so the harness can react to it."""

    text: str
    thinking: str
    tool_calls: tuple[ToolCall, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatFormat:
    family: str  # "qwen3_5" | "chatml"
    template: str
    end_of_turn: str = "<|im_end|>"
    thinks: bool = False  # the generation prompt opens a <think> block unless thinking is off
    tool_role_as_user: bool = False  # show tool results as a user turn of <tool_response> tags

    @cached_property
    def _compiled(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template)

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template shows tool schemas itself (else ``tools_text`` does)."""
        return "tools" in self.template

    def _prepare(self, messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            m = dict(m)
            if self.tool_role_as_user and m.get("role") == "tool":
                m = {
                    "role": "user",
                    "content": f"<tool_response>\n{m['content']}\n</tool_response>",
                }
            out.append(m)
        return out

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        if tools and not self.renders_tools:
            messages = list(messages)
            text = tools_text(tools)
            if messages and messages[0].get("role") == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
            else:
                messages.insert(0, {"role": "system", "content": text})
            tools = None
        return self._compiled.render(
            messages=self._prepare(messages),
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
            bos_token="",
            eos_token=self.end_of_turn,
            **kwargs,
        )

    def delta(
        self,
        new_messages: Sequence[dict[str, Any]],
        *,
        ended_with_end_of_turn: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """Text that continues a conversation whose last turn was the assistant's: the rest of
        that turn after the sampled end-of-turn token (or the end-of-turn token itself when the
        completion stopped without one), the new messages, and the generation prompt.

        It is the template's own rendering of the new messages in context: a stand-in
        conversation (user, assistant, *new_messages) is rendered, and everything after the
        stand-in assistant's end-of-turn token is the delta."""
        base = [{"role": "user", "content": _MARKER}, {"role": "assistant", "content": _MARKER}]
        after = self.render(
            [*base, *new_messages], add_generation_prompt=True, enable_thinking=enable_thinking
        )
        # The assistant stand-in is the second marker; templates may render it differently once
        # a new user turn follows (Qwen3.5 drops its think block), so only what follows counts.
        first = after.find(_MARKER)
        second = after.find(_MARKER, first + len(_MARKER))
        end = after.find(self.end_of_turn, second) if second >= 0 else -1
        if end < 0:
            raise ValueError(
                f"the chat template does not end an assistant turn with {self.end_of_turn!r}"
            )
        text = after[end + len(self.end_of_turn) :]
        return text if ended_with_end_of_turn else self.end_of_turn + text

    def prompt_opens_thinking(self, enable_thinking: bool | None) -> bool:
        return self.thinks and enable_thinking is not False

    def parse(self, raw: str, *, thinking_open: bool = False) -> Reply:
        """Splits a completion into thinking and visible text, and parses its tool calls.
        ``thinking_open``: the prompt ended inside a ``<think>`` block."""
        thinking, text = "", raw
        if not self.thinks:
            pass
        elif "</think>" in raw:
            head, _, text = raw.rpartition("</think>")
            thinking = head.split("<think>", 1)[-1].strip("\n")
            text = text.lstrip("\n")
        elif thinking_open or raw.lstrip().startswith("<think>"):
            thinking, text = raw.split("<think>", 1)[-1].strip("\n"), ""
        return Reply(text=text, thinking=thinking, tool_calls=parse_tool_calls(text))


def qwen3_5_format(template: str | None = None) -> ChatFormat:
    return ChatFormat(family="qwen3_5", template=template or QWEN3_5_TEMPLATE, thinks=True)


def chatml_format(template: str | None = None) -> ChatFormat:
    return ChatFormat(family="chatml", template=template or CHATML_TEMPLATE, tool_role_as_user=True)


def format_for(family: str, tokenizer: Any = None) -> ChatFormat:
    """The chat format of a model family, with the tokenizer's own template when it has one."""
    template = getattr(tokenizer, "chat_template", None) or None
    if isinstance(template, dict):  # several named templates: take the default one
        template = template.get("default")
    if family == "qwen3_5":
        return qwen3_5_format(template)
    return chatml_format(template)


@dataclasses.dataclass
class Session:
    """One conversation as one token sequence (prompts, deltas and sampled completions)."""

    ids: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ended_with_end_of_turn: bool = True
