"""h0 for arith: the question and a request for the bare number."""

SYSTEM_PROMPT = "Answer with only the number."


def run(task, model, tools):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.question},
    ]
    return model.chat(messages, max_new_tokens=12)
