"""A proposer on any OpenAI-compatible chat-completions endpoint with tool calling.

The official API, a provider that speaks the same protocol, or a local vLLM / SGLang server
(``base_url="http://127.0.0.1:8000/v1"``). The session loop, retries and usage accounting are
``llm.ToolLoopProposer``'s; this module only speaks the wire format.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai

from harness.endpoints import KEY_ENVS, OPENAI_BASE_URL, api_key_from_env
from harness.search.proposers.base import TOOL_SPECS, ProposeRequest
from harness.search.proposers.llm import (
    Reply,
    ReplyError,
    ToolCall,
    ToolLoopProposer,
    Verdict,
    parse_arguments,
    parse_retry_after,
    result_text,
    retryable_status,
)

# The archive tools in the chat-completions ``tools`` format.
OPENAI_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": spec} for spec in TOOL_SPECS]


class OpenAIProposer(ToolLoopProposer):
    """Meta-Harness proposer on an OpenAI-compatible chat-completions API.

    Args:
        model: the model name the endpoint serves.
        base_url: the API root (ending in ``/v1`` for most servers); None: the official OpenAI API.
        api_key_env: the environment variable holding the API key. Unset is an error unless
            ``base_url`` is a loopback address (a local server), which then gets a placeholder.
        max_turns: model replies per proposal at most.
        timeout_s: wall-clock budget of the whole proposal (every request and retry wait).
        temperature: sampling temperature; None: the server's default.
        max_retries: retries of one request after HTTP 408/429/5xx or a connection error.
        sleep: the wait between retries (tests pass a recorder).
        seed: seeds the retry jitter (None: unseeded).
    """

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key_env: str = KEY_ENVS["openai"],
        max_turns: int = 40,
        timeout_s: float = 600,
        temperature: float | None = None,
        max_retries: int = 5,
        *,
        sleep: Callable[[float], None] = time.sleep,
        seed: int | None = None,
    ):
        super().__init__(max_turns=max_turns, timeout_s=timeout_s, max_retries=max_retries,
                         sleep=sleep, seed=seed)  # fmt: skip
        self.model = model
        self.base_url = base_url or OPENAI_BASE_URL
        self.temperature = temperature
        self.name = f"openai:{model}"
        self._secret = api_key_from_env(api_key_env, self.base_url, self.name)
        # Retries are ours (counted, bounded by the deadline), so the library makes none.
        self._client = openai.OpenAI(api_key=self._secret, base_url=self.base_url,
                                     timeout=timeout_s, max_retries=0)  # fmt: skip
        self._api_errors = (openai.APIError,)

    def __repr__(self) -> str:
        return f"OpenAIProposer(model={self.model!r}, base_url={self.base_url!r})"

    def _conversation(self, request: ProposeRequest) -> _Conversation:
        return _Conversation(self, request)

    def _classify(self, exc: BaseException) -> Verdict:
        if isinstance(exc, openai.APIStatusError):
            code = exc.status_code
            what = f"HTTP {code} from {self.base_url}: {exc.message}"
            return Verdict(
                retryable=retryable_status(code),
                what=what[:400],
                retry_after_s=parse_retry_after(exc.response.headers.get("retry-after")),
            )
        if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
            return Verdict(retryable=True, what=f"{type(exc).__name__} to {self.base_url}: {exc}")
        return Verdict(retryable=False, what=f"{type(exc).__name__}: {exc}"[:400])


class _Conversation:
    """A chat-completions message list: system, user, then assistant / tool messages."""

    def __init__(self, proposer: OpenAIProposer, request: ProposeRequest):
        self.proposer = proposer
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": request.skill},
            {"role": "user", "content": request.task_text()},
        ]

    def send(self, timeout_s: float) -> Reply:
        p = self.proposer
        extra = {} if p.temperature is None else {"temperature": p.temperature}
        response = p._client.chat.completions.create(
            model=p.model, messages=self.messages, tools=OPENAI_TOOLS, timeout=timeout_s, **extra
        )
        if not response.choices:
            raise ReplyError(f"a chat completion without choices from {p.base_url}")
        choice = response.choices[0]
        message = choice.message
        calls: list[ToolCall] = []
        wire_calls: list[dict[str, Any]] = []
        for i, tc in enumerate(message.tool_calls or []):
            function = getattr(tc, "function", None)
            if function is None:
                raise ReplyError(f"a tool call of type {tc.type!r}; only functions are offered")
            call_id = tc.id or f"call-{len(self.messages)}-{i}"
            args, error = parse_arguments(function.arguments)
            calls.append(ToolCall(id=call_id, name=function.name, args=args, error=error))
            wire_calls.append({"id": call_id, "type": "function",
                               "function": {"name": function.name,
                                            "arguments": function.arguments}})  # fmt: skip
        turn: dict[str, Any] = {"role": "assistant", "content": message.content}
        if wire_calls:
            turn["tool_calls"] = wire_calls
        self.messages.append(turn)
        usage = response.usage
        return Reply(
            calls=calls,
            prompt_tokens=(usage.prompt_tokens or 0) if usage else 0,
            completion_tokens=(usage.completion_tokens or 0) if usage else 0,
            stop=str(choice.finish_reason),
        )

    def add_results(self, calls: list[ToolCall], results: list[Any]) -> None:
        for call, result in zip(calls, results, strict=True):
            self.messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": result_text(result)}
            )
