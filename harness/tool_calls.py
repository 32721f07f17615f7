"""Tool calls in model output: the one parser of ``<tool_call>`` blocks, for every backend.

Two forms are read: Qwen3.5's XML (``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
</function></tool_call>``) and the JSON form (``<tool_call>{"name": .., "arguments": ..}
</tool_call>``) that ChatML models are asked for. A block that does not parse is kept as
``ToolCall(name=MALFORMED_TOOL_CALL, arguments={"error": why, "raw": the block})`` so the harness
can react to it; the parser never raises.
"""

from __future__ import annotations

import json
import re
from typing import Any

from harness.api import ToolCall

MALFORMED_TOOL_CALL = "malformed_tool_call"

_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _value(text: str) -> Any:
    text = text.strip("\n")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def _malformed(why: str, raw: str) -> ToolCall:
    return ToolCall(name=MALFORMED_TOOL_CALL, arguments={"error": why, "raw": raw})


def parse_tool_calls(text: str) -> tuple[ToolCall, ...]:
    """Every ``<tool_call>`` block in ``text``, XML or JSON form; never raises."""
    calls = []
    for match in _TOOL_BLOCK.finditer(text):
        body, raw = match.group(1), match.group(0)
        if not raw.endswith("</tool_call>"):
            calls.append(_malformed("unterminated <tool_call> block", raw))
            continue
        stripped = body.strip()
        if stripped.startswith("<function="):
            fn = _FUNCTION.match(stripped)
            if fn is None or "</function>" not in stripped:
                calls.append(_malformed("unterminated <function=...> block", raw))
                continue
            name = fn.group(1).strip()
            if not name:
                calls.append(_malformed("empty function name", raw))
                continue
            args = {}
            for p in _PARAMETER.finditer(fn.group(2)):
                key = p.group(1).strip()
                if not key:
                    break
                args[key] = _value(p.group(2))
            else:
                calls.append(ToolCall(name=name, arguments=args))
                continue
            calls.append(_malformed("empty parameter name", raw))
            continue
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as e:
            calls.append(_malformed(f"neither <function=...> XML nor JSON ({e.msg})", raw))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(_malformed("JSON tool call without a string 'name'", raw))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                calls.append(_malformed("'arguments' is a string that is not JSON", raw))
                continue
        if not isinstance(args, dict):
            calls.append(_malformed("'arguments' is not an object", raw))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return tuple(calls)
