"""h0 for arith: the question and a request for the bare number."""

SYSTEM_PROMPT = "Answer with only the number."
USER_PROMPT_TEMPLATE = "{question}"


def run(task, model, tools):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT_TEMPLATE.format(question=task.question)},
    ]
    return model.chat(messages, max_new_tokens=12)
