"""h0 for math, as the reference's: no system prompt, the problem and the boxed-answer format, and a
``code_interpreter`` tool the model calls itself (a native tool call). At most two model turns; the
episode ends at the first reply without a tool call, and that reply is the answer."""

import re

SYSTEM_PROMPT = ""  # none: the reference's h0 sends only the user turn
# A str.format template: {question} is the problem; doubled braces are literal braces.
USER_PROMPT_TEMPLATE = (
    "{question}\nThe answer format must be: \\boxed{{'The final answer goes here.'}}"
)
MAX_TURNS = 2
CODE_INTERPRETER = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and return what it prints (the last line is printed).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}
FENCE = re.compile(r"```python(.*?)```", re.DOTALL)


def program(code):
    """The code to run: a python fence's content when there is one, the last non-empty line
    wrapped in print() unless it prints already."""
    found = FENCE.search(code)
    if found:
        code = found.group(1).strip()
    lines = code.split("\n")
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] != "":
            if not lines[i].startswith("print"):
                lines[i] = "print(" + lines[i] + ")"
            break
    return "\n".join(lines)


def execute(tools, call):
    """The tool message for one tool call of the model."""
    if call["name"] != "code_interpreter":
        return "[unknown tool] " + call["name"]
    code = call["arguments"].get("code")
    if not isinstance(code, str):
        return "[tool error] code_interpreter needs a string argument 'code'"
    try:
        result = tools.python(program(code))
    except tools.ToolError as e:
        return "[tool error] " + str(e)
    output = result["stdout"] + result["stderr"]
    return output if output or result["status"] == "ok" else "no stdout here"


def run(task, model, tools):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
    messages.append(
        {"role": "user", "content": USER_PROMPT_TEMPLATE.format(question=task.question)}
    )
    reply = ""
    for turn in range(MAX_TURNS):
        reply = model.chat(messages, tools=[CODE_INTERPRETER])
        calls = model.last["tool_calls"]
        if not calls or turn == MAX_TURNS - 1:
            break
        messages.append({"role": "assistant", "content": reply})
        for call in calls:
            messages.append({"role": "tool", "content": execute(tools, call)})
    return reply
