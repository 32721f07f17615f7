"""Chat formats: rendering, deltas, thinking, tool calls."""

import pytest

from whale_jax.engine.chat import (
    MALFORMED_TOOL_CALL,
    ToolCall,
    chatml_format,
    qwen3_5_format,
)

QWEN = qwen3_5_format()
CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_qwen3_5_thinking_is_on_by_default():
    assert QWEN.render(CONVO).endswith("<|im_start|>assistant\n<think>\n")
    off = QWEN.render(CONVO, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_5_rerendering_drops_earlier_thinking():
    # Why sessions never re-render: the template rewrites the past turn once a new query follows.
    turn = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
    asked_again = QWEN.render([*CONVO, turn, {"role": "user", "content": "3+3?"}])
    assert "add them" not in asked_again


def test_delta_is_what_follows_the_assistant_turn():
    tool = {"role": "tool", "content": "result: 4"}
    delta = QWEN.delta([tool])
    assert delta == (
        "\n<|im_start|>user\n<tool_response>\nresult: 4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    # Rendering the whole conversation at once gives the same text after the assistant turn.
    turn = {"role": "assistant", "content": "<think>\nx\n</think>\n\ncall"}
    full = QWEN.render([*CONVO, turn, tool])
    assert full.endswith("<|im_end|>" + delta)
    assert QWEN.delta([tool], ended_with_end_of_turn=False) == "<|im_end|>" + delta


def test_delta_of_a_new_user_turn_with_thinking_off():
    delta = QWEN.delta([{"role": "user", "content": "again"}], enable_thinking=False)
    assert delta == (
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_visible_text_excludes_thinking():
    reply = QWEN.parse("I should add.\n</think>\n\nThe answer is 4.", thinking_open=True)
    assert reply.text == "The answer is 4." and reply.thinking == "I should add."
    unfinished = QWEN.parse("still thinking", thinking_open=True)
    assert unfinished.text == "" and unfinished.thinking == "still thinking"
    assert QWEN.parse("<think>\nhm\n</think>\n\nok").text == "ok"
    assert QWEN.parse("plain answer").text == "plain answer"


def test_qwen3_5_xml_tool_calls_are_parsed():
    raw = (
        "need a search\n</think>\n\nLet me look.\n<tool_call>\n<function=search>\n"
        "<parameter=query>\ncapital of France\n</parameter>\n<parameter=k>\n3\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=python>\n<parameter=code>\n"
        "print(1 < 2)\n</parameter>\n</function>\n</tool_call>"
    )
    reply = QWEN.parse(raw, thinking_open=True)
    assert reply.tool_calls == (
        ToolCall(name="search", arguments={"query": "capital of France", "k": 3}),
        ToolCall(name="python", arguments={"code": "print(1 < 2)"}),
    )
    assert reply.text.startswith("Let me look.")


def test_tool_calls_inside_thinking_are_not_calls():
    raw = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n</think>\n\nno call"
    assert QWEN.parse(raw, thinking_open=True).tool_calls == ()


@pytest.mark.parametrize(
    "block, why",
    [
        ("<tool_call>\n<function=search>\n<parameter=q>\nx", "unterminated <tool_call>"),
        ("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</tool_call>",
         "unterminated <function"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "empty function name"),
        ("<tool_call>{not json}</tool_call>", "neither"),
        ('<tool_call>{"arguments": {}}</tool_call>', "without a string 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not an object"),
    ],
)  # fmt: skip
def test_malformed_tool_calls_are_reported_not_raised(block, why):
    (call,) = QWEN.parse("ok " + block).tool_calls
    assert call.name == MALFORMED_TOOL_CALL
    assert why in call.arguments["error"] and call.arguments["raw"].startswith("<tool_call>")


def test_chatml_tools_as_text_tags():
    fmt = chatml_format()
    assert fmt.render(CONVO) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert fmt.delta([{"role": "tool", "content": "4"}]) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    reply = fmt.parse('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    assert reply.tool_calls == (ToolCall(name="add", arguments={"a": 2}),)
    assert fmt.parse("no </think> handling needed").thinking == ""


SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query_list": {"type": "array"}}}}}  # fmt: skip


def test_a_template_without_tools_shows_them_as_text_in_the_system_turn():
    """SmolLM2's plain ChatML never mentions tools: the schemas and the JSON call form go into
    the system message (or a system message of their own), which any template can show."""
    fmt = chatml_format()
    assert not fmt.renders_tools
    with_system = fmt.render(CONVO, tools=[SEARCH])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "search"' in with_system
    assert '<tool_call>\n{"name": NAME, "arguments":' in with_system
    alone = fmt.render(CONVO[1:], tools=[SEARCH])
    assert alone.startswith("<|im_start|>system\n# Tools\n") and "2+2?" in alone
    assert fmt.render(CONVO, tools=[]) == fmt.render(CONVO)


def test_qwen3_5_renders_tools_itself():
    assert QWEN.renders_tools
    text = QWEN.render(CONVO, tools=[SEARCH])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access")
    assert '"name": "search"' in text and "<function=NAME>" in text
