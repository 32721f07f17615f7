"""The tool loop every chat-style LLM proposer shares: turns, tool execution, retries, usage, keys.

A backend supplies two things: a ``Conversation`` (one model call per ``send``, the history kept in
that API's own message format) and ``_classify`` (which of its library's exceptions are worth a
retry). ``ToolLoopProposer.propose`` does the rest:

    system prompt = request.skill, first user message = request.task_text()
    loop: call the model (retrying 408/429/5xx and connection errors with exponential backoff and
          jitter, honouring a server's retry hint), run every tool call through ``ArchiveTools``,
          send the results back; stop on ``submit``, on a reply without tool calls, at
          ``max_turns`` model replies or when ``timeout_s`` (wall clock, the whole proposal) runs
          out; then read the slot directory with ``collect``.

Why a proposal ended early is returned as a problem string, never raised: an API failure costs a
proposal, not the search. What a proposal spent is ``last_usage``, what the proposer has spent
since it was made ``usage`` (both ``Usage``, added to as replies arrive). The API key is read from the
named environment variable only, handed to the client library, and masked out of every problem
string; it is never logged, written or shown to a tool.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

from harness.search.archive import Proposal
from harness.search.proposers.base import ArchiveTools, ProposeRequest, Usage, collect

log = logging.getLogger(__name__)

# A tool result longer than this (characters of its text) is cut before it goes back to the model.
# read_file already pages at 60k characters; the margin covers the JSON quoting of other results.
MAX_RESULT_CHARS = 80_000
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0


# The placeholder key sent to a loopback server when the environment variable is unset (a local
# vLLM or SGLang server usually runs without authentication).
class ReplyError(ValueError):
    """A model response the loop cannot use (no choices, no candidates, an unknown call type)."""


@dataclasses.dataclass
class ToolCall:
    """One function call of a model reply; ``error`` set: the call is answered with that error."""

    id: str | None
    name: str
    args: dict[str, Any]
    error: str | None = None


@dataclasses.dataclass
class Reply:
    """One model reply, already appended to the conversation's history."""

    calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int
    stop: str  # the API's finish reason, as text


class Conversation(Protocol):
    """The history of one proposal's session in a backend's wire format."""

    def send(self, timeout_s: float) -> Reply:
        """One model call with the history so far (at most ``timeout_s`` seconds); on success the
        model's turn is appended to the history. Library exceptions propagate unchanged."""
        ...

    def add_results(self, calls: list[ToolCall], results: list[Any]) -> None:
        """Append the results (JSON-able, already clipped) of ``calls``, in the same order."""
        ...


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How the loop treats a library exception."""

    retryable: bool
    what: str  # a one-line description for logs and problem strings
    retry_after_s: float | None = None  # the server's hint, if it sent one


def clip(result: Any, limit: int = MAX_RESULT_CHARS) -> Any:
    """``result`` unchanged if its text fits in ``limit`` characters, else its text cut to
    ``limit`` with a note saying how much was dropped."""
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    if len(text) <= limit:
        return result
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut from this tool result]"


def result_text(result: Any) -> str:
    """The text a tool result is sent as: strings (file contents) as they are, the rest as JSON."""
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def parse_arguments(raw: str | None) -> tuple[dict[str, Any], str | None]:
    """A JSON-object argument string as a dict, or ({}, the reason it is unusable)."""
    try:
        args = json.loads(raw or "{}")
    except ValueError as e:
        return {}, f"the arguments are not valid JSON ({e}): {str(raw)[:200]!r}"
    if not isinstance(args, dict):
        return {}, f"the arguments must be a JSON object, got {type(args).__name__}"
    return args, None


def backoff_s(retry: int, rng: random.Random, retry_after_s: float | None = None) -> float:
    """The wait before retry ``retry`` (0-based): ``BACKOFF_BASE_S * 2**retry`` with +-50% jitter,
    capped at ``BACKOFF_MAX_S``, and never shorter than the server's ``retry_after_s``."""
    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**retry) * rng.uniform(0.5, 1.5)
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return delay


def retryable_status(code: int) -> bool:
    """Request timeout, rate limit and server errors are worth another try; other statuses not."""
    return code in (408, 429) or code >= 500


def parse_retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (the HTTP-date form is ignored)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class _Stop(Exception):
    """Ends the session early; the message becomes a problem string."""


class ToolLoopProposer(abc.ABC):
    """A ``Proposer`` that runs a tool-calling chat session against an LLM API.

    Subclasses set ``name``, ``_api_errors`` (the library exceptions ``_classify`` understands) and
    ``_secret`` (the key, masked out of problem strings), and implement ``_conversation`` and
    ``_classify``.
    """

    name: str
    _api_errors: tuple[type[BaseException], ...]
    _secret: str

    def __init__(
        self,
        *,
        max_turns: int,
        timeout_s: float,
        max_retries: int,
        sleep: Callable[[float], None],
        seed: int | None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be non-negative, got {max_retries}")
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._sleep = sleep
        self._rng = random.Random(seed)
        self.last_usage = Usage()  # the latest proposal's
        self.usage = Usage()  # every proposal's, this one's included as it goes

    @abc.abstractmethod
    def _conversation(self, request: ProposeRequest) -> Conversation:
        """A new session: system prompt ``request.skill``, user message ``request.task_text()``."""

    @abc.abstractmethod
    def _classify(self, exc: BaseException) -> Verdict:
        """Whether an exception of ``_api_errors`` is worth a retry, and how to describe it."""

    def propose(self, request: ProposeRequest) -> tuple[list[Proposal], list[str]]:
        """Run one session, then read the slot directory. ``last_usage`` is updated as it goes."""
        self.last_usage = Usage()
        tools = ArchiveTools(request)
        deadline = time.monotonic() + self.timeout_s
        conversation = self._conversation(request)
        problems: list[str] = []
        try:
            while not tools.submitted:
                if self.last_usage.turns >= self.max_turns:
                    raise _Stop(f"stopped after max_turns={self.max_turns} model replies")
                reply = self._send(conversation, deadline)
                self._spend(turns=1, prompt_tokens=reply.prompt_tokens,
                            completion_tokens=reply.completion_tokens)  # fmt: skip
                if not reply.calls:
                    raise _Stop(f"the model replied without a tool call (finish: {reply.stop})")
                results = []
                for call in reply.calls:
                    self._spend(tool_calls=1)
                    result = (
                        {"error": call.error} if call.error else tools.call(call.name, call.args)
                    )
                    results.append(clip(result))
                if not tools.submitted:
                    conversation.add_results(reply.calls, results)
        except _Stop as e:
            problems.append(self._problem(f"{e}; it did not call submit"))
        except ReplyError as e:
            problems.append(self._problem(f"unusable model response: {e}"))
        log.info("%s: %s", self.name, self.last_usage)
        proposals, more = collect(request, self.name)
        return proposals, problems + more

    def _spend(self, **counts: int) -> None:
        for usage in (self.last_usage, self.usage):
            for name, n in counts.items():
                setattr(usage, name, getattr(usage, name) + n)

    def _send(self, conversation: Conversation, deadline: float) -> Reply:
        """One model reply, retrying what ``_classify`` calls retryable, within the deadline."""
        retry = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Stop(f"timeout_s={self.timeout_s} ran out")
            try:
                return conversation.send(remaining)
            except self._api_errors as e:
                verdict = self._classify(e)
            if not verdict.retryable:
                raise _Stop(f"API error: {verdict.what}")
            if retry >= self.max_retries:
                raise _Stop(f"API error after {retry} retries: {verdict.what}")
            delay = backoff_s(retry, self._rng, verdict.retry_after_s)
            if time.monotonic() + delay >= deadline:
                raise _Stop(f"timeout_s={self.timeout_s} ran out while retrying ({verdict.what})")
            retry += 1
            self._spend(retries=1)
            log.info("%s: %s; retry %d/%d in %.1fs", self.name, self._mask(verdict.what), retry,
                     self.max_retries, delay)  # fmt: skip
            self._sleep(delay)

    def _mask(self, text: str) -> str:
        return text.replace(self._secret, "[api key]") if self._secret else text

    def _problem(self, text: str) -> str:
        return self._mask(f"{self.name}: {text}")[:600]
