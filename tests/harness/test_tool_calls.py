"""Native tool calls through the harness contract: schemas travel with the request and are
recorded, the model's parsed calls come back in ``model.last``, a conversation keeps its tools."""

from __future__ import annotations

import json

from harness.backends import render_prompt
from harness.tool_calls import MALFORMED_TOOL_CALL, parse_tool_calls
from tests.harness.conftest import make_executor
from whale_jax.train.rows import rows_from_records

SCHEMA = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}  # fmt: skip


def calculator(request):
    """Calls ``add`` on the question's two numbers, then, once a tool result is back, answers
    (the sum, worked out by the model itself: the harness's tool only acknowledges)."""
    a, b = (int(x) for x in request.messages[0]["content"].removeprefix("What is ").rstrip("?")
            .split(" + "))  # fmt: skip
    if request.messages[-1]["role"] == "tool":
        return str(a + b)
    return (
        "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "</tool_call>"
    )


TOOL_LOOP = """
SCHEMA = SCHEMA_HERE

def run(task, model, tools):
    messages = [{"role": "user", "content": task.question}]
    reply = model.chat(messages, tools=[SCHEMA])
    (call,) = model.last["tool_calls"]
    result = "noted: " + call["name"]
    messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": result}]
    return model.chat(messages, tools=[SCHEMA])
""".replace("SCHEMA_HERE", repr(SCHEMA))


def test_a_tool_call_round_trip_is_one_conversation(arith, arith_tasks):
    with make_executor(respond=calculator) as ex:
        (rec,) = ex.run(TOOL_LOOP, arith, arith_tasks[:1])
    assert rec.reward == 1.0, (rec.stop_reason, rec.error)
    first, second = rec.calls
    assert first.tools == second.tools == [SCHEMA]
    assert first.session_id == second.session_id
    assert first.prompt_ids == render_prompt(first.messages, [SCHEMA])
    rows, counts = rows_from_records([rec], max_len=4096, threshold=0.5)
    assert len(rows) == 1 and counts["new_rows"] == 0


def test_other_tools_start_another_conversation(arith, arith_tasks):
    src = TOOL_LOOP.replace(
        "return model.chat(messages, tools=[SCHEMA])", "return model.chat(messages, tools=[])"
    )
    with make_executor(respond=calculator) as ex:
        (rec,) = ex.run(src, arith, arith_tasks[:1])
    first, second = rec.calls
    assert first.session_id != second.session_id and second.tools == []


def test_bad_tools_are_refused_with_the_reason(arith, arith_tasks):
    src = """
def run(task, model, tools):
    try:
        model.chat([{"role": "user", "content": task.question}], tools=["search"])
    except model.ModelError as e:
        return model.chat([{"role": "user", "content": str(e)}])
"""
    with make_executor(respond=lambda r: r.messages[-1]["content"]) as ex:
        (rec,) = ex.run(src, arith, arith_tasks[:1])
    assert "bad request: tools must be a list of at most 16 objects" in rec.calls[0].text


def test_a_gold_answer_in_a_tool_schema_is_flagged(arith, arith_tasks):
    task = arith_tasks[0]
    src = TOOL_LOOP.replace(repr(SCHEMA), repr({**SCHEMA, "description": f"{task.gold}"}))
    with make_executor(respond=calculator) as ex:
        (rec,) = ex.run(src, arith, [task])
    assert rec.gold_in_prompt
    assert rec.sessions[0].origin == "flagged"


def test_the_parser_reads_both_forms_and_never_raises():
    xml = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>"
    (call,) = parse_tool_calls(xml)
    assert (call.name, call.arguments) == ("add", {"a": 2})
    (bad,) = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert bad.name == MALFORMED_TOOL_CALL and "JSON" in bad.arguments["error"]
