"""A proposer on the Gemini API (``generateContent`` with function calling), via ``google-genai``.

Automatic function calling is off: the model's function calls come back to us and run through
``ArchiveTools``. The model's turns are kept exactly as returned (thought signatures included,
which Gemini's thinking models require with function calling). The session loop, retries and
usage accounting are ``llm.ToolLoopProposer``'s; this module only speaks the wire format.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

from google import genai
from google.genai import errors, types

from harness.endpoints import GEMINI_BASE_URL, KEY_ENVS, api_key_from_env
from harness.search.proposers.base import TOOL_SPECS, ProposeRequest
from harness.search.proposers.llm import (
    Reply,
    ReplyError,
    ToolCall,
    ToolLoopProposer,
    Verdict,
    parse_retry_after,
    retryable_status,
)


def function_declarations() -> list[types.FunctionDeclaration]:
    """The archive tools as Gemini function declarations (a tool without arguments gets no
    ``parameters``: the API refuses an object schema without properties)."""
    return [
        types.FunctionDeclaration(
            name=spec["name"],
            description=spec["description"],
            parameters=spec["parameters"] if spec["parameters"].get("properties") else None,
        )
        for spec in TOOL_SPECS
    ]


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exceptions of the HTTP libraries google-genai may use (httpx2, httpx)."""
    found = []
    for module in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except ImportError:
            continue
    return tuple(found)


def _retry_delay_s(details: Any) -> float | None:
    """The ``google.rpc.RetryInfo`` delay ("37s") of an error body, if it has one."""
    error = details.get("error", details) if isinstance(details, dict) else None
    items = error.get("details") if isinstance(error, dict) else None
    for item in items if isinstance(items, list) else []:
        delay = item.get("retryDelay") if isinstance(item, dict) else None
        if isinstance(delay, str) and delay.endswith("s"):
            return parse_retry_after(delay[:-1])
    return None


class GeminiProposer(ToolLoopProposer):
    """Meta-Harness proposer on the Gemini API.

    Args:
        model: the Gemini model name.
        api_key_env: the environment variable holding the API key. Unset is an error unless
            ``base_url`` is a loopback address, which then gets a placeholder.
        max_turns: model replies per proposal at most.
        timeout_s: wall-clock budget of the whole proposal (every request and retry wait).
        max_retries: retries of one request after HTTP 408/429/5xx or a connection error.
        base_url: the API root; None: Google's endpoint. The library appends
            ``<version>/models/<model>:generateContent`` (version "v1" in google-genai 3.x unless
            GOOGLE_GENAI_API_VERSION says otherwise).
        sleep: the wait between retries (tests pass a recorder).
        seed: seeds the retry jitter (None: unseeded).
    """

    def __init__(
        self,
        model: str = "gemini-2.5-pro",
        api_key_env: str = KEY_ENVS["gemini"],
        max_turns: int = 40,
        timeout_s: float = 600,
        max_retries: int = 5,
        base_url: str | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        seed: int | None = None,
    ):
        super().__init__(max_turns=max_turns, timeout_s=timeout_s, max_retries=max_retries,
                         sleep=sleep, seed=seed)  # fmt: skip
        self.model = model
        self.base_url = base_url or GEMINI_BASE_URL
        self.name = f"gemini:{model}"
        self._secret = api_key_from_env(api_key_env, self.base_url, self.name)
        # vertexai=False: a GOOGLE_GENAI_USE_VERTEXAI in the environment must not reroute us.
        # No retry_options: the library makes no retries (ours are counted and deadline-bound).
        self._client = genai.Client(
            vertexai=False,
            api_key=self._secret,
            http_options=types.HttpOptions(base_url=self.base_url, timeout=int(timeout_s * 1000)),
        )
        self._api_errors = (errors.APIError, errors.UnknownApiResponseError, *_transport_errors())
        self._config = types.GenerateContentConfig(
            tools=[types.Tool(function_declarations=function_declarations())],
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        )

    def __repr__(self) -> str:
        return f"GeminiProposer(model={self.model!r}, base_url={self.base_url!r})"

    def _conversation(self, request: ProposeRequest) -> _Conversation:
        return _Conversation(self, request)

    def _classify(self, exc: BaseException) -> Verdict:
        if isinstance(exc, errors.APIError):
            code = exc.code or 0
            headers = getattr(exc.response, "headers", None) or {}
            hint = parse_retry_after(headers.get("retry-after"))
            if hint is None:
                hint = _retry_delay_s(exc.details)
            return Verdict(
                retryable=retryable_status(code),
                what=f"HTTP {code} {exc.status or ''} from {self.base_url}: {exc.message}"[:400],
                retry_after_s=hint,
            )
        if isinstance(exc, errors.UnknownApiResponseError):
            return Verdict(retryable=False, what=f"unreadable response: {exc}"[:400])
        return Verdict(retryable=True, what=f"{type(exc).__name__} to {self.base_url}: {exc}")


class _Conversation:
    """A ``contents`` list: the user's task, then model turns and function-response turns."""

    def __init__(self, proposer: GeminiProposer, request: ProposeRequest):
        self.proposer = proposer
        self.config = proposer._config.model_copy(update={"system_instruction": request.skill})
        self.contents: list[types.Content] = [
            types.Content(role="user", parts=[types.Part.from_text(text=request.task_text())])
        ]

    def send(self, timeout_s: float) -> Reply:
        p = self.proposer
        config = self.config.model_copy(
            update={"http_options": types.HttpOptions(timeout=max(1, int(timeout_s * 1000)))}
        )
        response = p._client.models.generate_content(
            model=p.model, contents=self.contents, config=config
        )
        usage = response.usage_metadata
        prompt = (usage.prompt_token_count or 0) if usage else 0
        # Thinking tokens are output tokens (billed so), as reasoning tokens are in OpenAI's count.
        completion = ((usage.candidates_token_count or 0) + (usage.thoughts_token_count or 0)
                      if usage else 0)  # fmt: skip
        if not response.candidates:
            feedback = response.prompt_feedback
            reason = feedback.block_reason if feedback else None
            raise ReplyError(f"a response without candidates (block reason: {reason})")
        candidate = response.candidates[0]
        calls: list[ToolCall] = []
        content = candidate.content
        if content is not None and content.parts:
            if not content.role:
                content = content.model_copy(update={"role": "model"})
            self.contents.append(content)
            for part in content.parts:
                fc = part.function_call
                if fc is not None:
                    calls.append(ToolCall(id=fc.id, name=fc.name or "", args=dict(fc.args or {})))
        finish = candidate.finish_reason
        return Reply(
            calls=calls,
            prompt_tokens=prompt,
            completion_tokens=completion,
            stop=str(finish.value if finish is not None else None),
        )

    def add_results(self, calls: list[ToolCall], results: list[Any]) -> None:
        parts = []
        for call, result in zip(calls, results, strict=True):
            is_error = isinstance(result, dict) and set(result) == {"error"}
            response = result if is_error else {"output": result}
            parts.append(types.Part(function_response=types.FunctionResponse(
                id=call.id, name=call.name, response=response)))  # fmt: skip
        self.contents.append(types.Content(role="user", parts=parts))
