"""h0 for math: the problem and a boxed-answer instruction; one optional Python tool turn."""

import re

SYSTEM_PROMPT = (
    "You are a careful mathematician. Solve the problem step by step. You may run Python once by "
    "writing a block fenced as ```python ... ``` and nothing after it; you will see its output. "
    "Put the final answer in \\boxed{}."
)
MAX_TURNS = 2
CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def run(task, model, tools):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.question + "\n\nPut the final answer in \\boxed{}."},
    ]
    reply = ""
    for turn in range(MAX_TURNS):
        reply = model.chat(messages)
        found = CODE.search(reply)
        if found is None or "\\boxed" in reply or turn == MAX_TURNS - 1:
            return reply
        result = tools.python(found.group(1))
        shown = (result["stdout"] + result["stderr"])[-2000:] or "(no output)"
        messages += [
            {"role": "assistant", "content": reply},
            {
                "role": "user",
                "content": "Output:\n" + shown + "\n\nNow give the final answer in \\boxed{}.",
            },
        ]
    return reply
