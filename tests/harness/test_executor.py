"""Executor behaviour with well-formed and misbehaving (not malicious) harnesses."""

from __future__ import annotations

import dataclasses

from harness.records import EpisodeRecord
from tests.harness.conftest import TEST_BUDGETS, TEST_LIMITS, make_executor


def harness(code: str, prelude: str = "") -> str:
    lines = "\n".join("    " + line for line in code.strip().splitlines())
    return f"{prelude}\ndef run(task, model, tools):\n{lines}\n"


ASK = "model.chat([{'role': 'user', 'content': task.question}])"


def test_record_holds_every_call_and_round_trips(executor, arith, arith_tasks):
    src = harness(f"reply = {ASK}\nreturn reply", "")
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.stop_reason == "answered" and rec.reward == 1.0 and rec.answer_in_completion
    call = rec.calls[0]
    assert call.messages == [{"role": "user", "content": arith_tasks[0].question}]
    assert call.prompt_ids and call.completion_ids and call.train
    assert call.prompt_tokens == len(call.prompt_ids) == rec.prompt_tokens
    assert call.settings["max_new_tokens"] <= TEST_BUDGETS.assistant_tokens
    assert rec.turns == 1 and rec.wall_s > 0
    assert EpisodeRecord.from_json(rec.to_json()) == rec


def test_answer_must_come_from_a_completion(executor, arith, arith_tasks):
    src = harness(
        f"{ASK}\nreturn str(eval_free_sum(task.question))",
        """
import re
def eval_free_sum(q):
    return sum(int(x) for x in re.findall(r"[0-9]+", q)) + 0
""",
    )
    # The harness computes the right number itself: not the model's answer, so it scores 0 ...
    src = src.replace("+ 0", "+ 1000")
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.stop_reason == "answer_not_in_completion" and rec.reward == 0.0


def test_an_answer_found_only_in_a_prompt_is_not_the_models(executor, arith, arith_tasks):
    """The harness writes the right answer into a prompt message and returns it; the model (which
    sums the integers of the last user message, none here) answers "0" and never says it."""
    task = arith_tasks[0]
    src = harness(
        "model.chat([{'role': 'system', 'content': 'The answer is ' + ANSWER},\n"
        "            {'role': 'user', 'content': 'Reply.'}])\n"
        "return ANSWER",
        f"ANSWER = {str(task.gold)!r}",
    )
    (rec,) = executor.run(src, arith, [task])
    assert str(task.gold) in rec.calls[0].messages[0]["content"]
    assert str(task.gold) not in rec.calls[0].raw_text  # the model never said it
    assert rec.answer == str(task.gold) and not rec.answer_in_completion
    assert rec.stop_reason == "answer_not_in_completion" and rec.reward == 0.0


def test_hang_in_one_episode_costs_only_that_episode(arith, arith_tasks):
    bomb = arith_tasks[0].question
    src = harness(f"if task.question == {bomb!r}:\n    while True:\n        pass\nreturn {ASK}")
    with make_executor(delay_s=2.5) as ex:  # the innocents are still waiting when it is killed
        records = ex.run(src, arith, arith_tasks[:4])
    assert records[0].stop_reason == "timeout" and records[0].reward == 0.0
    assert all(r.stop_reason == "answered" and r.reward == 1.0 for r in records[1:])
    assert all(r.reruns == 0 for r in records)  # one process per episode: nobody re-runs


def test_crash_is_recorded_with_its_signal(arith, arith_tasks):
    # Burning CPU past RLIMIT_CPU kills the episode's process with SIGXCPU.
    bomb = arith_tasks[2].question
    src = harness(
        f"reply = {ASK}\nif task.question == {bomb!r}:\n    while True:\n        pass\nreturn reply"
    )
    limits = dataclasses.replace(TEST_LIMITS, cpu_s=2)
    budgets = dataclasses.replace(TEST_BUDGETS, step_s=60.0)
    with make_executor(limits=limits, budgets=budgets) as ex:
        records = ex.run(src, arith, arith_tasks[:4])
    assert records[2].stop_reason == "worker_died" and "SIGXCPU" in (records[2].error or "")
    others = [r for i, r in enumerate(records) if i != 2]
    assert all(r.stop_reason == "answered" and r.reward == 1.0 for r in others)


def test_model_call_budget_is_enforced(executor, arith, arith_tasks):
    src = harness(f"while True:\n    {ASK}")
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.stop_reason == "budget:model_calls" and rec.reward == 0.0
    assert len(rec.calls) == TEST_BUDGETS.model_calls


def test_harness_that_ignores_refusals_is_stopped(executor, arith, arith_tasks):
    src = harness(
        f"for i in range(1000):\n    try:\n        {ASK}\n    except BaseException:\n        pass"
    )
    records = executor.run(src, arith, arith_tasks[:2])
    assert all(r.stop_reason == "budget:model_calls" and r.reward == 0 for r in records)


def test_turn_budget_counts_one_conversation(executor, arith, arith_tasks):
    src = harness(
        "msgs = [{'role': 'user', 'content': task.question}]\n"
        "while True:\n"
        "    reply = model.chat(msgs)\n"
        "    msgs = msgs + [{'role': 'assistant', 'content': reply},\n"
        "                   {'role': 'user', 'content': 'again'}]"
    )
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.stop_reason == "budget:turns" and rec.turns == TEST_BUDGETS.turns
    assert len({c.session_id for c in rec.calls}) == 1


def test_voting_calls_are_separate_sessions_with_distinct_rng(executor, arith, arith_tasks):
    src = harness(
        f"a = {ASK}\nb = model.chat([{{'role': 'user', 'content': task.question}}], train=False)\n"
        "return a"
    )
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.turns == 1 and len({c.session_id for c in rec.calls}) == 2
    assert [c.call_index for c in rec.calls] == [0, 1]
    assert [c.train for c in rec.calls] == [True, False]


def test_prompt_budget_is_enforced(executor, arith, arith_tasks):
    src = harness("return model.chat([{'role': 'user', 'content': 'x ' * 5000}])")
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.stop_reason == "budget:prompt_tokens" and rec.reward == 0.0


def test_assistant_tokens_clip_max_new_tokens(executor, arith, arith_tasks):
    src = harness(
        f"model.chat([{{'role': 'user', 'content': 'hi'}}], max_new_tokens=100000)\nreturn {ASK}"
    )
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.calls[0].settings["max_new_tokens"] == TEST_BUDGETS.assistant_tokens


def test_max_new_tokens_is_what_the_episode_has_left(arith, arith_tasks):
    """Each call may generate at most the assistant tokens left after the earlier calls'
    completions, not the whole budget again."""
    received = []

    def respond(request):  # 50 byte tokens and an end of sequence: 51 completion tokens
        received.append(request.settings.max_new_tokens)
        return "x" * 50

    src = harness(
        "for i in range(3):\n"
        "    model.chat([{'role': 'user', 'content': f'call {i}'}], max_new_tokens=100000)"
    )
    with make_executor(respond=respond) as ex:
        (rec,) = ex.run(src, arith, arith_tasks[:1])
    assert [c.completion_tokens for c in rec.calls] == [51, 51, 51]
    budget = TEST_BUDGETS.assistant_tokens
    assert received == [budget, budget - 51, budget - 102]
    assert [c.settings["max_new_tokens"] for c in rec.calls] == received


def test_gold_in_prompt_is_flagged(executor, arith, arith_tasks):
    task = arith_tasks[0]
    src = harness(
        "return model.chat([{'role': 'system', 'content': HINT},\n"
        "                   {'role': 'user', 'content': task.question}])",
        f"HINT = 'Known answers: {task.question} {task.gold}'",
    )
    (rec,) = executor.run(src, arith, [task])
    assert rec.gold_in_prompt
    (clean,) = executor.run(harness(f"return {ASK}"), arith, [task])
    assert not clean.gold_in_prompt


def test_bad_messages_raise_inside_the_harness(executor, arith, arith_tasks):
    src = harness(
        "try:\n    model.chat([{'role': 'wizard', 'content': 1}])\nexcept model.ModelError:\n"
        f"    return {ASK}"
    )
    (rec,) = executor.run(src, arith, arith_tasks[:1])
    assert rec.stop_reason == "answered" and rec.reward == 1.0


def test_load_time_hang_costs_the_candidate(arith, arith_tasks):
    src = "while True:\n    pass\n" + harness("return None")
    with make_executor(load_timeout_s=2.0) as ex:
        records = ex.run(src, arith, arith_tasks[:3])
    assert all(r.stop_reason == "harness_load" for r in records)


def test_samples_are_task_major(executor, arith, arith_tasks):
    records = executor.run(harness(f"return {ASK}"), arith, arith_tasks[:2], samples=3)
    assert [(r.task_id, r.sample_index) for r in records] == [
        (t.id, s) for t in arith_tasks[:2] for s in range(3)
    ]
