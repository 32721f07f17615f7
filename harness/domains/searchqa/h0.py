"""h0 for searchqa, as the reference's: the model decides whether and what to search through a
``search(query_list)`` tool it calls itself (a native tool call); the first query is kept, the top
passage comes back as JSON; at most two model turns, the episode ending at the first reply without
a tool call; the answer is that reply's ``<answer>``."""

import json

SYSTEM_PROMPT = "Answer factual questions using search when needed."
USER_PROMPT_TEMPLATE = (
    "Question: {question}\n"
    "Use the search tool if needed. Put the final answer only inside <answer>...</answer>."
)
MAX_TURNS = 2
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches for relevant information and returns exactly one passage.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "A list containing exactly one semantic query.",
                }
            },
            "required": ["query_list"],
        },
    },
}


def result(text):
    return json.dumps({"result": text}, ensure_ascii=False)


def execute(tools, call):
    """The tool message for one tool call of the model: the top passage for its first query."""
    if call["name"] != "search":
        return result("[unknown tool] " + call["name"])
    queries = call["arguments"].get("query_list")
    if isinstance(queries, str):
        queries = [queries]
    cleaned = (
        [str(q).strip() for q in queries if str(q).strip()] if isinstance(queries, list) else []
    )
    if not cleaned:
        return result("Error: 'query_list' is missing, empty, or not a list in parameters.")
    try:
        hits = tools.search(cleaned[0], 1)
    except tools.ToolError as e:
        return result("Search error: " + str(e))
    if not hits:
        return result("No search results found.")
    return result("Doc 1(Title: " + hits[0]["title"] + ") " + hits[0]["text"])


def run(task, model, tools):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT_TEMPLATE.format(question=task.question)},
    ]
    reply = ""
    for turn in range(MAX_TURNS):
        reply = model.chat(messages, tools=[SEARCH])
        calls = model.last["tool_calls"]
        if not calls or turn == MAX_TURNS - 1:
            break
        messages.append({"role": "assistant", "content": reply})
        for call in calls:
            messages.append({"role": "tool", "content": execute(tools, call)})
    return reply
