"""h0 for searchqa: search once with the question, show the top passage, ask for the answer."""

SYSTEM_PROMPT = (
    "Answer the question using the passage. Put only the short answer inside "
    "<answer> and </answer>, for example <answer>Paris</answer>."
)


def run(task, model, tools):
    hits = tools.search(task.question, 1)
    passage = hits[0]["title"] + ": " + hits[0]["text"] if hits else "(no passage found)"
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Passage: " + passage + "\n\nQuestion: " + task.question},
    ]
    reply = model.chat(messages)
    if "<answer>" in reply:
        return reply
    messages = messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Give the final answer as <answer>...</answer>."},
    ]
    return model.chat(messages)
