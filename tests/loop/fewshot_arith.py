"""A few-shot arith harness with worked examples (the e2e test's starting point: SmolLM2 solves
enough tasks with it that RSFT keeps episodes). Example numbers are invented with operands the
generator never uses (0, 1, 9 + 1), as the offline proposer's are, so the audits see no gold."""

import re

SYSTEM_PROMPT = (
    "Work the calculation out in one short line, then end with a final line "
    "of the form Answer: <integer>."
)
EXAMPLES = [
    ("What is 9 + 1?", "9 + 1 = 10\nAnswer: 10"),
    ("What is 0 - 7?", "0 - 7 = -7\nAnswer: -7"),
]
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def run(task, model, tools):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for question, answer in EXAMPLES:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    messages.append({"role": "user", "content": task.question})
    reply = model.chat(messages, max_new_tokens=24)
    found = list(ANSWER.finditer(reply))
    return reply[found[-1].start(1) :] if found else reply
