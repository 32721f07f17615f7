"""The OpenAI and Gemini proposers against loopback servers that speak each API's wire protocol.

Each server replays a script: one step per HTTP request, which checks what the proposer sent (the
tool results of the previous turn above all) and returns the next scripted model turn. A failed
check is recorded in ``server.failures`` and answered with HTTP 400, which ends the proposal.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest

from harness.endpoints import MissingAPIKeyError
from harness.search.archive import Proposal
from harness.search.proposers.base import TOOL_SPECS, ProposeRequest
from harness.search.proposers.gemini_backend import GeminiProposer
from harness.search.proposers.llm import clip
from harness.search.proposers.openai_backend import OpenAIProposer

KEY = "test-key-0123456789"
SKILL = "You improve harnesses. SKILL-MARKER"
TRACE = '{"task_id": "t1", "reward": 0.0, "note": "TRACE-MARKER wrong number"}\n'
HARNESS = '''"""Few-shot arith harness."""

SYSTEM_PROMPT = "Answer with only the number. Example: 2 + 3 -> 5"


def run(task, model, tools):
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.question},
    ]
    return model.chat(messages, max_new_tokens=12)
'''
PENDING = [{"name": "few-shot", "hypothesis": "traces show bare-number slips",
            "changes": "one worked example in the system prompt"}]  # fmt: skip

# A step answers one request: body -> (HTTP status, JSON body, extra headers).
Step = Callable[[dict[str, Any]], tuple[int, dict[str, Any], dict[str, str]]]


# ---- loopback servers --------------------------------------------------------------------------


class ScriptedServer:
    """An HTTP server on 127.0.0.1 (port 0) answering each POST with the next step of a script."""

    def __init__(self, wire: Wire, steps: list[Step]):
        self.wire = wire
        self.steps = list(steps)
        self.requests: list[dict[str, Any]] = []
        self.failures: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                try:
                    server.wire.check_request(self.path, self.headers)
                    if not server.steps:
                        raise AssertionError(f"request {len(server.requests)} beyond the script")
                    status, payload, headers = server.steps.pop(0)(body)
                except AssertionError as e:
                    server.failures.append(f"request {len(server.requests)}: {e}")
                    status, payload, headers = 400, server.wire.error(400, f"script: {e}"), {}
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (the timeout test)
                    pass

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Wire(Protocol):
    """One API's wire format, as a server speaks it (and checks it)."""

    key_env: str

    def proposer(self, url: str, **kw: Any) -> OpenAIProposer | GeminiProposer: ...
    def check_request(self, path: str, headers: Any) -> None: ...
    def calls(self, calls: list[tuple[str, dict[str, Any]]], prompt: int, out: int) -> dict: ...
    def text(self, text: str, prompt: int, out: int) -> dict: ...
    def error(self, status: int, message: str) -> dict: ...
    def rate_limited(self, delay_s: int) -> tuple[int, dict[str, Any], dict[str, str]]: ...
    def prompts(self, body: dict[str, Any]) -> tuple[str, str]: ...
    def tool_names(self, body: dict[str, Any]) -> list[str]: ...
    def results(self, body: dict[str, Any]) -> list[str]: ...


class OpenAIWire:
    """POST /v1/chat/completions, Bearer key, tool calls in ``choices[0].message.tool_calls``."""

    key_env = "WHALE_TEST_OPENAI_KEY"
    model = "qwen3-test"

    def proposer(self, url: str, **kw: Any) -> OpenAIProposer:
        return OpenAIProposer(self.model, base_url=url + "/v1", api_key_env=self.key_env, **kw)

    def check_request(self, path: str, headers: Any) -> None:
        assert path == "/v1/chat/completions", path
        assert headers["Authorization"] == f"Bearer {KEY}"

    def _completion(self, message: dict, finish: str, prompt: int, out: int) -> dict:
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                          "total_tokens": prompt + out}}  # fmt: skip

    def calls(self, calls: list[tuple[str, dict[str, Any]]], prompt: int, out: int) -> dict:
        tool_calls = [{"id": f"call-{prompt}-{i}", "type": "function",
                       "function": {"name": name, "arguments": json.dumps(args)}}
                      for i, (name, args) in enumerate(calls)]  # fmt: skip
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        return self._completion(message, "tool_calls", prompt, out)

    def text(self, text: str, prompt: int, out: int) -> dict:
        return self._completion({"role": "assistant", "content": text}, "stop", prompt, out)

    def error(self, status: int, message: str) -> dict:
        return {"error": {"message": message, "type": "test", "code": status}}

    def rate_limited(self, delay_s: int) -> tuple[int, dict[str, Any], dict[str, str]]:
        return 429, self.error(429, "rate limited"), {"Retry-After": str(delay_s)}

    def prompts(self, body: dict[str, Any]) -> tuple[str, str]:
        system, user = body["messages"][:2]
        assert system["role"] == "system" and user["role"] == "user"
        return system["content"], user["content"]

    def tool_names(self, body: dict[str, Any]) -> list[str]:
        assert all(t["type"] == "function" for t in body["tools"])
        return [t["function"]["name"] for t in body["tools"]]

    def results(self, body: dict[str, Any]) -> list[str]:
        """The tool messages after the last assistant turn, checked against its call ids."""
        messages = body["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids = [c["id"] for c in messages[last]["tool_calls"]]
        tail = messages[last + 1 :]
        assert [m["role"] for m in tail] == ["tool"] * len(ids), tail
        assert [m["tool_call_id"] for m in tail] == ids
        return [m["content"] for m in tail]


class GeminiWire:
    """POST /v1/models/<model>:generateContent (google-genai 3.x's default API version, "v1"),
    x-goog-api-key, ``functionCall`` parts."""

    key_env = "WHALE_TEST_GEMINI_KEY"
    model = "gemini-test"
    signature = "c2lnbmF0dXJl"  # base64; thinking models require it echoed in the history

    def proposer(self, url: str, **kw: Any) -> GeminiProposer:
        return GeminiProposer(self.model, api_key_env=self.key_env, base_url=url, **kw)

    def check_request(self, path: str, headers: Any) -> None:
        assert path == f"/v1/models/{self.model}:generateContent", path
        assert headers["x-goog-api-key"] == KEY

    def _response(self, parts: list[dict], prompt: int, out: int) -> dict:
        # Two of the output tokens are thinking tokens: the proposer counts both kinds.
        return {"candidates": [{"content": {"role": "model", "parts": parts},
                                "finishReason": "STOP", "index": 0}],
                "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": out - 2,
                                  "thoughtsTokenCount": 2, "totalTokenCount": prompt + out}}  # fmt: skip

    def calls(self, calls: list[tuple[str, dict[str, Any]]], prompt: int, out: int) -> dict:
        parts = [{"functionCall": {"name": name, "args": args}, "thoughtSignature": self.signature}
                 for name, args in calls]  # fmt: skip
        return self._response(parts, prompt, out)

    def text(self, text: str, prompt: int, out: int) -> dict:
        return self._response([{"text": text}], prompt, out)

    def error(self, status: int, message: str) -> dict:
        return {"error": {"code": status, "message": message, "status": "TEST"}}

    def rate_limited(self, delay_s: int) -> tuple[int, dict[str, Any], dict[str, str]]:
        info = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{delay_s}s"}
        body = {"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED",
                          "details": [info]}}  # fmt: skip
        return 429, body, {}

    def prompts(self, body: dict[str, Any]) -> tuple[str, str]:
        first = body["contents"][0]
        assert first["role"] == "user"
        return body["systemInstruction"]["parts"][0]["text"], first["parts"][0]["text"]

    def tool_names(self, body: dict[str, Any]) -> list[str]:
        assert len(body["tools"]) == 1
        return [d["name"] for d in body["tools"][0]["functionDeclarations"]]

    def results(self, body: dict[str, Any]) -> list[str]:
        """The function responses of the last user turn, checked against the model turn before
        it (whose parts must come back unchanged, thought signatures included)."""
        model_turn, results_turn = body["contents"][-2:]
        assert model_turn["role"] == "model" and results_turn["role"] == "user"
        calls = [p for p in model_turn["parts"] if "functionCall" in p]
        assert all(p.get("thoughtSignature") == self.signature for p in calls), model_turn
        responses = [p["functionResponse"] for p in results_turn["parts"]]
        assert [r["name"] for r in responses] == [p["functionCall"]["name"] for p in calls]
        return [json.dumps(r["response"]) for r in responses]


WIRES = {"openai": OpenAIWire(), "gemini": GeminiWire()}


@pytest.fixture(params=sorted(WIRES))
def wire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    w = WIRES[request.param]
    monkeypatch.setenv(w.key_env, KEY)
    monkeypatch.delenv("GOOGLE_GENAI_API_VERSION", raising=False)  # would change Gemini's path
    yield w


@pytest.fixture
def propose_request(tmp_path: Any) -> ProposeRequest:
    """An archive with the incoming harness and its traces, and an empty slot directory."""
    archive = tmp_path / "archive"
    incoming = archive / "phase-001" / "candidates" / "h000-incoming"
    incoming.mkdir(parents=True)
    (incoming / "harness.py").write_text("def run(task, model, tools):\n    return ''\n")
    (incoming / "traces.jsonl").write_text(TRACE)
    slot_dir = archive / "phase-001" / "proposals" / "iter-002"
    slot_dir.mkdir(parents=True)
    return ProposeRequest(
        archive_dir=str(archive), phase_dir=str(archive / "phase-001"), slot_dir=str(slot_dir),
        skill=SKILL, domain="arith", slots=3, iteration=2,
    )  # fmt: skip


def reply(payload: dict[str, Any]) -> Step:
    return lambda body: (200, payload, {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the scripted session ----------------------------------------------------------------------


def test_scripted_session(wire: Wire, propose_request: ProposeRequest, tmp_path: Any) -> None:
    """list_dir, read_file, two writes into the slots, two refused writes outside, submit."""
    w = wire
    trace_path = "phase-001/candidates/h000-incoming/traces.jsonl"
    outside = ["phase-001/evil.py", "slots/../../../../evil.py"]

    def turn1(body: dict[str, Any]) -> tuple[int, dict, dict]:
        system, task = w.prompts(body)
        assert system == SKILL
        assert "slots/pending.json" in task and "Iteration 2" in task and "phase-001" in task
        assert w.tool_names(body) == [spec["name"] for spec in TOOL_SPECS]
        return 200, w.calls([("list_dir", {"path": ""})], 100, 10), {}

    def turn2(body: dict[str, Any]) -> tuple[int, dict, dict]:
        (listing,) = w.results(body)
        assert "phase-001/" in listing, listing
        return 200, w.calls([("read_file", {"path": trace_path})], 120, 12), {}

    def turn3(body: dict[str, Any]) -> tuple[int, dict, dict]:
        (trace,) = w.results(body)
        assert "TRACE-MARKER" in trace, trace
        args = {"path": "slots/few-shot/harness.py", "content": HARNESS}
        return 200, w.calls([("write_file", args)], 140, 14), {}

    def turn4(body: dict[str, Any]) -> tuple[int, dict, dict]:
        (wrote,) = w.results(body)
        assert "wrote few-shot/harness.py" in wrote, wrote
        args = {"path": "slots/pending.json", "content": json.dumps(PENDING)}
        return 200, w.calls([("write_file", args)], 160, 16), {}

    def turn5(body: dict[str, Any]) -> tuple[int, dict, dict]:
        (wrote,) = w.results(body)
        assert "wrote pending.json" in wrote, wrote
        calls = [("write_file", {"path": p, "content": "import os\n"}) for p in outside]
        return 200, w.calls(calls, 180, 18), {}

    def turn6(body: dict[str, Any]) -> tuple[int, dict, dict]:
        refused_phase, refused_escape = w.results(body)
        assert "error" in refused_phase and "slot directory only" in refused_phase, refused_phase
        assert "error" in refused_escape and "is outside the slots" in refused_escape
        return 200, w.calls([("submit", {})], 200, 20), {}

    with ScriptedServer(w, [turn1, turn2, turn3, turn4, turn5, turn6]) as server:
        proposer = w.proposer(server.url)
        proposals, problems = proposer.propose(propose_request)

    assert server.failures == []
    assert len(server.requests) == 6  # nothing is sent after submit
    assert problems == []
    assert proposals == [
        Proposal(name="few-shot", source=HARNESS, hypothesis=PENDING[0]["hypothesis"],
                 changes=PENDING[0]["changes"], proposer=proposer.name)
    ]  # fmt: skip
    assert proposer.name == f"{'openai' if isinstance(w, OpenAIWire) else 'gemini'}:{w.model}"
    assert not (tmp_path / "archive" / "phase-001" / "evil.py").exists()
    assert not (tmp_path / "evil.py").exists()
    assert dataclasses.asdict(proposer.last_usage) == {"prompt_tokens": 900, "completion_tokens": 90, "turns": 6,
                                   "tool_calls": 7, "retries": 0}  # fmt: skip


# ---- retries, errors, limits -------------------------------------------------------------------


def test_rate_limit_is_retried_after_the_server_hint(
    wire: Wire, propose_request: ProposeRequest
) -> None:
    sleeps: list[float] = []
    steps = [lambda body: wire.rate_limited(2), reply(wire.text("nothing to do", 50, 5))]
    with ScriptedServer(wire, steps) as server:
        proposer = wire.proposer(server.url, sleep=sleeps.append, seed=0)
        proposals, problems = proposer.propose(propose_request)
    assert server.failures == []
    assert len(server.requests) == 2 and server.requests[0] == server.requests[1]
    assert sleeps == [2.0]  # the hint beats the first backoff (at most 1.5 s)
    assert dataclasses.asdict(proposer.last_usage) == {"prompt_tokens": 50, "completion_tokens": 5, "turns": 1,
                                   "tool_calls": 0, "retries": 1}  # fmt: skip
    assert proposals == []
    assert len(problems) == 2
    assert "replied without a tool call" in problems[0] and "did not call submit" in problems[0]
    assert problems[1] == "no pending.json in the slot directory"


def test_server_error_on_every_attempt_ends_with_a_problem(
    wire: Wire, propose_request: ProposeRequest
) -> None:
    sleeps: list[float] = []
    steps = [lambda body: (500, wire.error(500, "boom"), {}) for _ in range(4)]
    with ScriptedServer(wire, steps) as server:
        proposer = wire.proposer(server.url, max_retries=3, sleep=sleeps.append, seed=0)
        proposals, problems = proposer.propose(propose_request)
    assert server.failures == [] and len(server.requests) == 4
    assert len(sleeps) == 3
    for i, delay in enumerate(sleeps):  # exponential backoff, +-50% jitter
        assert 0.5 * 2**i <= delay <= 1.5 * 2**i
    assert proposals == []
    assert "API error after 3 retries" in problems[0] and "HTTP 500" in problems[0]
    assert "boom" in problems[0] and KEY not in problems[0]
    assert proposer.last_usage.retries == 3 and proposer.last_usage.turns == 0


def test_client_error_is_not_retried(wire: Wire, propose_request: ProposeRequest) -> None:
    sleeps: list[float] = []
    steps = [lambda body: (400, wire.error(400, "bad request: unknown field"), {})]
    with ScriptedServer(wire, steps) as server:
        proposer = wire.proposer(server.url, sleep=sleeps.append)
        proposals, problems = proposer.propose(propose_request)
    assert len(server.requests) == 1 and sleeps == []
    assert proposals == []
    assert "API error: HTTP 400" in problems[0] and "unknown field" in problems[0]


def test_connection_refused_is_retried_then_reported(
    wire: Wire, propose_request: ProposeRequest
) -> None:
    sleeps: list[float] = []
    proposer = wire.proposer(f"http://127.0.0.1:{free_port()}", max_retries=2, sleep=sleeps.append)
    proposals, problems = proposer.propose(propose_request)
    assert proposals == [] and len(sleeps) == 2
    assert "API error after 2 retries" in problems[0]
    assert proposer.last_usage.retries == 2


def test_max_turns_ends_the_session(wire: Wire, propose_request: ProposeRequest) -> None:
    steps = [reply(wire.calls([("list_dir", {"path": ""})], 10, 3)) for _ in range(6)]
    with ScriptedServer(wire, steps) as server:
        proposer = wire.proposer(server.url, max_turns=3)
        proposals, problems = proposer.propose(propose_request)
        assert server.failures == [] and len(server.requests) == 3
        assert "max_turns=3" in problems[0]
        once = {"prompt_tokens": 30, "completion_tokens": 9, "turns": 3, "tool_calls": 3,
                "retries": 0}  # fmt: skip
        assert dataclasses.asdict(proposer.last_usage) == once
        # A second proposal: its own usage, and the proposer's whole spend (what the loop counts,
        # failed proposals included) is the sum.
        proposer.propose(propose_request)
    assert dataclasses.asdict(proposer.last_usage) == once
    assert dataclasses.asdict(proposer.usage) == {k: 2 * v for k, v in once.items()}
    assert proposer.usage.tokens == 78


def test_timeout_bounds_the_whole_proposal(wire: Wire, propose_request: ProposeRequest) -> None:
    def slow(body: dict[str, Any]) -> tuple[int, dict, dict]:
        time.sleep(3)
        return 200, wire.text("late", 1, 1), {}

    with ScriptedServer(wire, [slow]) as server:
        proposer = wire.proposer(server.url, timeout_s=0.5, sleep=lambda s: None)
        start = time.monotonic()
        proposals, problems = proposer.propose(propose_request)
        elapsed = time.monotonic() - start
    assert elapsed < 2.5
    assert proposals == [] and "timeout_s=0.5" in problems[0]


# ---- configuration -----------------------------------------------------------------------------


def test_missing_api_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WHALE_TEST_OPENAI_KEY", raising=False)
    monkeypatch.delenv("WHALE_TEST_GEMINI_KEY", raising=False)
    with pytest.raises(MissingAPIKeyError, match="WHALE_TEST_OPENAI_KEY"):
        OpenAIProposer("gpt-test", base_url="https://llm.example.com/v1",
                       api_key_env="WHALE_TEST_OPENAI_KEY")  # fmt: skip
    with pytest.raises(MissingAPIKeyError, match="WHALE_TEST_OPENAI_KEY"):
        OpenAIProposer("gpt-test", api_key_env="WHALE_TEST_OPENAI_KEY")  # the official API
    with pytest.raises(MissingAPIKeyError, match="WHALE_TEST_GEMINI_KEY"):
        GeminiProposer(api_key_env="WHALE_TEST_GEMINI_KEY")


def test_loopback_server_needs_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WHALE_TEST_OPENAI_KEY", raising=False)
    monkeypatch.delenv("WHALE_TEST_GEMINI_KEY", raising=False)
    OpenAIProposer("local", base_url="http://127.0.0.1:8000/v1",
                   api_key_env="WHALE_TEST_OPENAI_KEY")  # fmt: skip
    GeminiProposer(api_key_env="WHALE_TEST_GEMINI_KEY", base_url="http://localhost:9000")


def test_openai_bad_tool_arguments_go_back_as_an_error(
    propose_request: ProposeRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = WIRES["openai"]
    monkeypatch.setenv(w.key_env, KEY)
    bad = w.calls([("read_file", {})], 10, 1)
    bad["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = "{not json"

    def check(body: dict[str, Any]) -> tuple[int, dict, dict]:
        (result,) = w.results(body)
        assert "not valid JSON" in result, result
        return 200, w.text("giving up", 10, 1), {}

    with ScriptedServer(w, [reply(bad), check]) as server:
        proposer = w.proposer(server.url)
        proposer.propose(propose_request)
    assert server.failures == [] and len(server.requests) == 2
    assert proposer.last_usage.tool_calls == 1


def test_long_tool_results_are_clipped() -> None:
    assert clip("short", 10) == "short"
    assert clip(["a", "b"], 100) == ["a", "b"]
    cut = clip("x" * 50, 10)
    assert cut.startswith("x" * 10) and "40 more characters cut" in cut
    assert clip(["y" * 30], 10).startswith('["yyyyyyyy')


def test_repr_does_not_show_the_key(wire: Wire) -> None:
    assert KEY not in repr(wire.proposer("http://127.0.0.1:1"))
