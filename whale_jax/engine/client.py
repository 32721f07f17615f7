"""``EngineClient``: the harness's ``ChatBackend`` on top of the rollout engine.

``chat(request)`` turns chat messages into token ids (``whale_jax.engine.chat``), runs them through the
engine, and returns the visible text (thinking removed), the raw completion, the exact prompt and
completion ids and the parsed tool calls. It is called from many threads at once; each call blocks
on its own result while the engine batches them.

A session (``request.session_id``) is one token sequence: when the request continues it
(``request.continues``, decided by the executor's ledger, which the client trusts), only the new
messages are rendered (the template's delta) and appended to the sequence so far, and the engine
continues from the parked decode state of the previous call instead of re-prefilling. Any other
call (or a continuing one whose session is no longer kept) starts the session's sequence anew,
with the ends of its system message and of the messages before the last one marked as snapshot
points: the engine keeps the state there, so prompts that share them (a harness's system prompt
and few-shot turns, votes over one conversation) are not prefilled again. The ids of a rendered
conversation (and of the heads its boundaries come from) are remembered for the next calls with
the same messages (an LRU bounded in bytes): n samples and k votes of one prompt render and tokenize it
once, not once per call.
Every result carries its exact prompt and completion ids; training rows and their loss masks are
built from the records alone (``whale_jax.train.rows``), not from state kept here.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import json
import threading
from collections.abc import Sequence
from typing import Any

from harness.api import ChatRequest, ChatResult
from whale_jax.engine.chat import ChatFormat, Session, Tokenizer, format_for
from whale_jax.engine.engine import Engine, EngineConfig
from whale_jax.engine.pool import EnginePool
from whale_jax.engine.requests import Request, Sampling
from whale_jax.models.transformer import Transformer

_PROBE = "\x00probe\x00"  # stands for "the turn after these messages" when finding boundaries
# Rendered prompts remembered per client: the format's template sees only the messages and the
# options (no date, no randomness), so the same messages always give the same ids. Bounded at
# about this many bytes (a character of a key or text counted as one, a token of ids as four),
# least recently used first out: long prompts (search passages, long sessions) must not grow it
# without bound.
_RENDERED_BYTES = 64 << 20


def _messages_key(messages, *options) -> str | None:
    """An exact key for messages and render options; None for values JSON cannot show exactly."""
    try:
        return json.dumps([messages, options], sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return None


class EngineClient:
    """Engine-backed chat backend.

    ``EngineClient(model, tokenizer, slots=.., max_len=..)`` builds its own ``Engine`` (with
    ``devices``, more than one: an ``EnginePool`` of one engine per device, the slots split over
    them); pass ``engine=`` to share one. ``chat_format`` defaults to the model family's format with the
    tokenizer's chat template (Qwen3.5 for ``qwen3_5`` models, ChatML otherwise).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        slots: int = 8,
        max_len: int = 2048,
        chat_format: ChatFormat | None = None,
        seed: int = 0,
        engine: Engine | EnginePool | None = None,
        devices: Sequence[Any] | None = None,
        max_sessions: int = 100_000,
        **engine_options: Any,
    ):
        self.tokenizer = tokenizer
        self.format = chat_format or format_for(model.cfg.family, tokenizer)
        eot = self._token_id(self.format.end_of_turn)
        eos = tuple(dict.fromkeys([*model.cfg.eos_token_ids, *([eot] if eot is not None else [])]))
        self._owns_engine = engine is None
        if engine is None:
            config = EngineConfig(slots=slots, max_len=max_len, seed=seed, **engine_options)
            several = devices is not None and len(devices) > 1
            engine = (EnginePool(model, config, devices, eos_ids=eos, detokenize=self.decode)
                      if several else Engine(model, config, eos_ids=eos, detokenize=self.decode))  # fmt: skip
        self.engine = engine
        self._stop_ids = frozenset(self.engine.eos_ids)
        self._end_of_turn_id = eot
        self._lock = threading.Lock()
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._max_sessions = max_sessions
        self._rendered: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._rendered_bytes = 0
        self.render_stats = collections.Counter()  # rendered prompts: "hits" / "misses"

    # -- tokenizer helpers -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _token_id(self, token: str) -> int | None:
        ids = self.encode(token)
        return ids[0] if len(ids) == 1 else None

    # -- the backend protocol ----------------------------------------------------------------------
    def chat(self, request: ChatRequest) -> ChatResult:
        s = request.settings
        messages = [dict(m) for m in request.messages]
        with self._lock:
            session = self._sessions.get(request.session_id) if request.continues else None
        tools = list(request.tools)
        continuing = session is not None
        snapshots: tuple[int, ...] = ()
        try:
            if continuing:
                assert session is not None
                delta = self.format.delta(
                    messages[len(session.messages) :],
                    ended_with_end_of_turn=session.ended_with_end_of_turn,
                    enable_thinking=s.enable_thinking,
                )
                prompt = session.ids + self.encode(delta)
            else:
                if not messages:
                    raise ValueError("no messages")
                prompt, snapshots = self._render(messages, s.enable_thinking, tools)
        except Exception as e:  # a template that cannot render these messages fails this call only
            return ChatResult(text="", raw_text="", finish_reason="error", error=f"render: {e}")
        if request.max_prompt_tokens is not None and len(prompt) > request.max_prompt_tokens:
            return ChatResult(
                text="",
                raw_text="",
                prompt_ids=tuple(prompt),
                prompt_tokens=len(prompt),
                finish_reason="prompt_too_long",
                error=f"prompt of {len(prompt)} tokens is over the budget of "
                f"{request.max_prompt_tokens}",
            )
        sampling = Sampling.from_settings(s)
        done = self.engine.submit(
            Request(
                prompt_ids=tuple(prompt),
                sampling=sampling,
                identity=request.rng.as_tuple(),
                snapshots=snapshots,
                park=request.session_id,
            )
        ).result()
        if done.error is not None:
            return ChatResult(
                text="",
                raw_text="",
                prompt_ids=tuple(prompt),
                prompt_tokens=len(prompt),
                finish_reason=done.finish_reason,
                error=done.error,
            )
        ids = list(done.token_ids)
        stopped = bool(ids) and ids[-1] in self._stop_ids and done.stop_text_at is None
        raw = self.decode(ids[:-1] if stopped else ids)
        if done.stop_text_at is not None:
            raw = raw[: done.stop_text_at]
        reply = self.format.parse(
            raw, thinking_open=self.format.prompt_opens_thinking(s.enable_thinking)
        )
        new_session = Session(
            ids=prompt + ids,
            messages=[*messages, {"role": "assistant", "content": reply.text}],
            ended_with_end_of_turn=stopped and ids[-1] == self._end_of_turn_id,
        )
        with self._lock:
            self._sessions[request.session_id] = new_session
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > self._max_sessions:
                old, _ = self._sessions.popitem(last=False)
                self.engine.forget(old)
        return ChatResult(
            text=reply.text,
            raw_text=raw,
            prompt_ids=tuple(prompt),
            completion_ids=tuple(ids),
            finish_reason=done.finish_reason,
            prompt_tokens=len(prompt),
            completion_tokens=len(ids),
            tool_calls=reply.tool_calls,
            weights_version=done.weights_version,
        )

    def _remembered(self, key: str | None, make):
        """``make()``, remembered under ``key`` (None: not remembered). A value is None or a
        tuple of strings, tuples of ints and ``array`` ids; its size counts towards the bound."""
        if key is not None:
            with self._lock:
                if key in self._rendered:  # (a remembered None: no boundary there)
                    self._rendered.move_to_end(key)
                    self.render_stats["hits"] += 1
                    return self._rendered[key][0]
        value = make()
        if key is not None:
            size = len(key) + sum(
                4 * len(x) if isinstance(x, array.array | tuple) else len(x)
                for x in (value or ())
            )  # fmt: skip
            with self._lock:
                self.render_stats["misses"] += 1
                if key not in self._rendered and size <= _RENDERED_BYTES:
                    self._rendered[key] = (value, size)
                    self._rendered_bytes += size
                while self._rendered_bytes > _RENDERED_BYTES:
                    _, (_, dropped) = self._rendered.popitem(last=False)
                    self._rendered_bytes -= dropped
        return value

    def _render(self, messages, enable_thinking, tools=()) -> tuple[list[int], tuple[int, ...]]:
        """A new sequence's prompt ids and snapshot points (remembered: see the module doc)."""
        cache = self.engine.config.prefix_cache  # off: the engine keeps no snapshots

        def make():
            text = self.format.render(messages, enable_thinking=enable_thinking, tools=tools)
            prompt = self.encode(text)
            points = (self._boundaries(messages, text, prompt, enable_thinking, tools)
                      if cache else ())  # fmt: skip
            return array.array("i", prompt), points

        key = _messages_key(messages, enable_thinking, cache, tools)
        prompt, points = self._remembered(key, make)
        return prompt.tolist(), points

    def _head(self, messages, enable_thinking, tools=()) -> tuple[str, array.array] | None:
        """The text and ids of ``messages`` up to the end of their last turn, as the template
        renders them with another turn after them; None where there is no such cut."""
        try:
            probed = self.format.render(
                [*messages, {"role": "user", "content": _PROBE}],
                add_generation_prompt=False,
                enable_thinking=enable_thinking,
                tools=tools,
            )
        except Exception:  # a template may refuse a partial conversation: no boundary there
            return None
        head = probed[: max(probed.find(_PROBE), 0)]
        eot = self.format.end_of_turn
        cut = head.rfind(eot)
        if cut < 0:
            return None
        cut += len(eot)
        while cut < len(head) and head[cut] == "\n":
            cut += 1
        return head[:cut], array.array("i", self.encode(head[:cut]))

    def _boundaries(
        self, messages, text: str, prompt: list[int], enable_thinking, tools=()
    ) -> tuple[int, ...]:
        """Token counts of the prompt that end the system message and the messages before the
        last one: where the engine may keep a state that other prompts of this harness start with
        (the system prompt, few-shot turns, a conversation's history).

        A template may render a turn differently depending on what follows it (Qwen3.5 keeps an
        empty think block in an assistant turn only after the last user query), so the head is
        rendered with a probe user turn after it and cut at the last end-of-turn before the probe.
        A boundary counts only where that text and its tokens are exactly a prefix of the
        prompt's."""
        cuts = {len(messages) - 1}
        if messages and messages[0].get("role") == "system":
            cuts.add(1)
        points = []
        for k in sorted(c for c in cuts if 0 < c < len(messages)):
            head = messages[:k]
            found = self._remembered(
                _messages_key(head, enable_thinking, "head", tools),
                lambda head=head: self._head(head, enable_thinking, tools),
            )
            if found is None:
                continue
            head_text, ids = found
            if (
                text.startswith(head_text)
                and 0 < len(ids) < len(prompt)
                and prompt[: len(ids)] == ids.tolist()
            ):
                points.append(len(ids))
        return tuple(points)

    # -- sessions ----------------------------------------------------------------------------------
    def session(self, session_id: str) -> Session | None:
        with self._lock:
            s = self._sessions.get(session_id)
            return None if s is None else dataclasses.replace(s)

    def stats(self) -> dict[str, float]:
        """Monotone counters of the engine behind this client (the executor reports their change
        over each run): prompt tokens requested / computed / served from kept states, requests,
        cache hits, full hits, evictions, sampled tokens, decode slot-steps, generate calls."""
        c, st = self.engine.cache_stats(), self.engine.stats
        keys = ("prompt_tokens", "computed_tokens", "cached_tokens", "requests", "hits",
                "full_hits", "evictions")  # fmt: skip
        return {**{k: c[k] for k in keys}, "sampled_tokens": st["generated_tokens"],
                "decode_slot_steps": st["decode_slot_steps"],
                "generate_calls": st["generate_calls"]}  # fmt: skip

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()


def make_test_backend(
    spec: str = "smollm2", *, slots: int = 8, max_len: int = 1024
) -> EngineClient:
    """A real small model behind the engine as a ``ChatBackend`` (tests, demos; offline for the
    bundled SmolLM2-135M-Instruct)."""
    from whale_jax.io.load import load_model

    model, _, tokenizer = load_model(spec)
    if tokenizer is None:
        raise ValueError(f"{spec}: the checkpoint has no tokenizer")
    return EngineClient(model, tokenizer, slots=slots, max_len=max_len)
