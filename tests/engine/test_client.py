"""EngineClient: the harness's ChatBackend over the engine, with token-level sessions."""

import collections
import concurrent.futures

import pytest

from harness.api import ChatBackend, ChatRequest, RngKey, SamplingSettings
from harness.records import ANSWER, EpisodeRecord, ModelCallRecord, SessionVerdict
from whale_jax.engine import Request, Sampling
from whale_jax.engine.chat import qwen3_5_format
from whale_jax.engine.client import EngineClient
from whale_jax.train.rows import rows_from_records

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is 6 times 7? Use the calculator."}


@pytest.fixture(scope="module")
def client(qwen_chat_model, qwen_tokenizer):
    c = EngineClient(qwen_chat_model, qwen_tokenizer, slots=4, max_len=256, steps=4)
    yield c
    c.close()


def ask(messages, *, session="s", call=0, sample=0, max_prompt_tokens=None, tools=(),
        continues=None, **settings):  # fmt: skip
    """A request as the executor's ledger makes it: a later call of a session continues it."""
    settings.setdefault("max_new_tokens", 6)
    return ChatRequest(
        episode_id="e",
        session_id=session,
        messages=tuple(messages),
        settings=SamplingSettings(**settings),
        train=True,
        rng=RngKey(run_seed=1, step=0, task_id="t", sample_index=sample, call_index=call),
        max_prompt_tokens=max_prompt_tokens,
        tools=tuple(tools),
        continues=call > 0 if continues is None else continues,
    )


def record_of(*pairs):
    """The episode record the executor would keep for these (request, result) calls, each session
    verified correct."""
    calls = [
        ModelCallRecord(
            call_index=i,
            session_id=req.session_id,
            messages=list(req.messages),
            settings=req.settings.to_dict(),
            train=req.train,
            prompt_ids=list(res.prompt_ids),
            completion_ids=list(res.completion_ids),
        )
        for i, (req, res) in enumerate(pairs)
    ]
    verdicts = [SessionVerdict(session_id=s, reward=1.0, origin=ANSWER)
                for s in dict.fromkeys(c.session_id for c in calls)]  # fmt: skip
    return EpisodeRecord(task_id="t", domain="test", calls=calls, sessions=verdicts)


def test_is_a_chat_backend(client):
    assert isinstance(client, ChatBackend)


def test_three_turn_session_is_one_row(client, qwen_tokenizer):
    fmt = qwen3_5_format()
    first_request = ask([SYSTEM, USER], session="three")
    first = client.chat(first_request)
    assert first.error is None and len(first.completion_ids) == 6
    rendered = qwen_tokenizer.encode(fmt.render([SYSTEM, USER]))
    assert list(first.prompt_ids) == rendered

    tool = {"role": "tool", "content": "42"}
    history = [SYSTEM, USER, {"role": "assistant", "content": first.text}, tool]
    resumes = client.engine.stats["resumes"]
    second_request = ask(history, session="three", call=1)
    second = client.chat(second_request)
    ended = first.completion_ids[-1] == qwen_tokenizer.encode("<|im_end|>")[0]
    delta = qwen_tokenizer.encode(fmt.delta([tool], ended_with_end_of_turn=ended))
    assert list(second.prompt_ids) == rendered + list(first.completion_ids) + delta
    assert client.engine.stats["resumes"] == resumes + 1  # continued from the kept state

    # The records of the two calls make one training row; the loss mask is the sampled tokens.
    rows, counts = rows_from_records(
        [record_of((first_request, first), (second_request, second))], max_len=1024, threshold=0.5
    )
    assert len(rows) == 1 and counts["new_rows"] == 0
    c1, c2 = list(first.completion_ids), list(second.completion_ids)
    assert list(rows[0].ids) == rendered + c1 + delta + c2
    expected = [False] * len(rendered) + [True] * len(c1) + [False] * len(delta) + [True] * len(c2)
    assert list(rows[0].mask) == expected

    # The kept decode state continues exactly as a prefill of the whole sequence would.
    settings = SamplingSettings(max_new_tokens=6)
    again = client.engine.generate([Request(
        prompt_ids=second.prompt_ids,
        sampling=Sampling.from_settings(settings),
        identity=ask([], call=1).rng.as_tuple(),
        cache=False,
    )])[0]  # fmt: skip
    assert again.reused_tokens == 0
    assert again.token_ids == second.completion_ids


CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip


def test_tools_render_into_the_first_prompt_and_the_session_keeps_them(client, qwen_tokenizer):
    fmt = qwen3_5_format()
    first = client.chat(ask([SYSTEM, USER], session="tools", tools=[CALCULATOR]))
    assert first.error is None
    assert list(first.prompt_ids) == qwen_tokenizer.encode(
        fmt.render([SYSTEM, USER], tools=[CALCULATOR])
    )
    tool = {"role": "tool", "content": "42"}
    history = [SYSTEM, USER, {"role": "assistant", "content": first.text}, tool]
    second = client.chat(ask(history, session="tools", call=1, tools=[CALCULATOR]))
    assert list(second.prompt_ids[: len(first.prompt_ids)]) == list(first.prompt_ids)
    # The same messages with other tools are not that conversation (the ledger starts a new one):
    # rendered anew.
    other = client.chat(ask(history, session="tools", call=2, continues=False))
    assert list(other.prompt_ids) == qwen_tokenizer.encode(fmt.render(history))


def test_changed_history_starts_a_new_row(client, qwen_tokenizer):
    first_request = ask([SYSTEM, USER], session="edit")
    first = client.chat(first_request)
    edited = [
        SYSTEM,
        {"role": "user", "content": "Something else."},
        {"role": "assistant", "content": first.text},
        {"role": "tool", "content": "1"},
    ]
    # The ledger would start a new session; under the old id the rows see tokens that do not
    # extend the session's and start a new row.
    second_request = ask(edited, session="edit", call=1, continues=False)
    second = client.chat(second_request)
    assert list(second.prompt_ids) == qwen_tokenizer.encode(qwen3_5_format().render(edited))
    rows, counts = rows_from_records(
        [record_of((first_request, first), (second_request, second))], max_len=1024, threshold=0.5
    )
    assert counts["new_rows"] == 1 and len(rows) == 2
    assert list(rows[1].ids) == list(second.prompt_ids + second.completion_ids)
    assert sum(rows[1].mask) == len(second.completion_ids)


def test_concurrent_callers_get_their_own_samples(client):
    requests = [ask([SYSTEM, USER], session=f"c{i}", sample=i, max_new_tokens=5) for i in range(10)]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        together = list(pool.map(client.chat, requests))
    alone = [client.chat(requests[i]) for i in (0, 7)]
    assert [r.completion_ids for r in alone] == [
        together[0].completion_ids,
        together[7].completion_ids,
    ]
    assert len({r.completion_ids for r in together}) == 10


def test_bad_requests_come_back_as_results(client):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long, zero, good = pool.map(client.chat, [
            ask([SYSTEM, USER], session="b1", max_prompt_tokens=5),
            ask([SYSTEM, USER], session="b2", max_new_tokens=0),
            ask([SYSTEM, USER], session="b3"),
        ])  # fmt: skip
    assert long.finish_reason == "prompt_too_long" and "budget" in long.error
    assert long.prompt_tokens > 5
    assert zero.finish_reason == "error" and "max_new_tokens" in zero.error
    assert good.error is None and len(good.completion_ids) == 6


def test_stop_string_cuts_the_text(client):
    base = client.chat(ask([USER], session="st", enable_thinking=False, max_new_tokens=8))
    stop = base.raw_text[3:6]
    assert stop
    cut = client.chat(ask([USER], session="st2", enable_thinking=False, max_new_tokens=8,
                          stop=(stop,)))  # fmt: skip
    assert cut.finish_reason == "stop"
    assert cut.raw_text == base.raw_text[: base.raw_text.find(stop)]
    assert list(cut.completion_ids) == list(base.completion_ids[: len(cut.completion_ids)])


def test_system_prompt_and_earlier_turns_are_kept_for_other_prompts(client, qwen_tokenizer):
    """A fresh call marks the end of its system message and of the messages before the last one;
    a later call with the same system prompt and few-shot turns continues from the kept state."""
    fmt = qwen3_5_format()
    shots = [SYSTEM, {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    first = client.chat(ask([*shots, {"role": "user", "content": "3 + 5?"}], session="fa"))
    assert first.error is None
    system_end = len(qwen_tokenizer.encode(fmt.render([SYSTEM], add_generation_prompt=False)))
    full = fmt.render([*shots, USER])  # the assistant turn renders without a think block here
    shots_end = len(qwen_tokenizer.encode(full[: full.rindex("<|im_start|>user")]))
    assert client._boundaries(shots + [USER], fmt.render(shots + [USER]),
                              qwen_tokenizer.encode(fmt.render(shots + [USER])),
                              None) == (system_end, shots_end)  # fmt: skip
    before = client.engine.cache_stats()
    second = client.chat(ask([*shots, {"role": "user", "content": "9 x 9?"}], session="fb"))
    after = client.engine.cache_stats()
    assert second.error is None
    assert after["cached_tokens"] - before["cached_tokens"] == shots_end
    assert (
        after["computed_tokens"] - before["computed_tokens"] == len(second.prompt_ids) - shots_end
    )


def test_the_same_messages_are_rendered_once(client, qwen_tokenizer):
    """n samples or k votes of one conversation render and tokenize it once: the ids (and the
    boundaries) are remembered per messages and options, and equal a fresh rendering."""
    fmt = qwen3_5_format()
    system = {"role": "system", "content": "Only this test's system prompt."}  # nothing kept yet
    msgs = [system, {"role": "user", "content": "7 + 6?"}]
    before = collections.Counter(client.render_stats)
    first = client.chat(ask(msgs, session="r1"))
    again = client.chat(ask(msgs, session="r2", sample=1))
    plain = client.chat(ask(msgs, session="r3", enable_thinking=False))
    assert first.prompt_ids == again.prompt_ids == tuple(qwen_tokenizer.encode(fmt.render(msgs)))
    assert plain.prompt_ids == tuple(qwen_tokenizer.encode(fmt.render(msgs, enable_thinking=False)))
    assert plain.prompt_ids != first.prompt_ids  # the options are part of the key
    # first: the prompt and the system head rendered; again: remembered; plain: both anew.
    delta = collections.Counter(client.render_stats)
    delta.subtract(before)
    assert (delta["misses"], delta["hits"]) == (4, 1)
    system_end = len(qwen_tokenizer.encode(fmt.render([system], add_generation_prompt=False)))
    assert again.prompt_ids[:system_end] == first.prompt_ids[:system_end]
    assert client._render(msgs, None)[1] == (system_end,)


def test_remembered_renders_stay_within_their_byte_bound(client, qwen_tokenizer, monkeypatch):
    """Long prompts must not grow the memo without bound: least recently used entries go first
    once keys, texts and ids (4 bytes a token) pass the bound, and a dropped entry renders anew
    to the same ids."""
    import whale_jax.engine.client as client_module

    fmt = qwen3_5_format()
    bound = 4000
    monkeypatch.setattr(client_module, "_RENDERED_BYTES", bound)
    conversations = [
        [{"role": "system", "content": f"Bound test {i}. " + "word " * 40},
         {"role": "user", "content": f"{i} + {i}?"}]
        for i in range(6)
    ]  # fmt: skip
    for msgs in conversations:
        ids, _ = client._render(msgs, None)
        assert ids == qwen_tokenizer.encode(fmt.render(msgs))
        assert 0 < client._rendered_bytes <= bound
        assert client._rendered_bytes == sum(size for _, size in client._rendered.values())
    before = client.render_stats["misses"]
    ids, _ = client._render(conversations[0], None)  # long since dropped: rendered again
    assert client.render_stats["misses"] > before
    assert ids == qwen_tokenizer.encode(fmt.render(conversations[0]))
