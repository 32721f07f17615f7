"""The LLM judge (searchqa's optional verifier) against a loopback server that speaks the
OpenAI chat-completions protocol: yes and no are read, failures are tried 3 times and then leave
the verdict to exact match, every call is counted."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from harness.domains.base import Env, Task
from harness.domains.searchqa import SearchQADomain
from harness.judge import LLMJudge


class Endpoint:
    """127.0.0.1, port 0: answers each POST with the next (status, reply text) of ``script``."""

    def __init__(self, script):
        self.script, self.bodies = list(script), []
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.bodies.append(body)
                status, text = endpoint.script.pop(0)
                reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}}],
                         "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                   "total_tokens": 41}}  # fmt: skip
                data = json.dumps(reply if status == 200 else {"error": {"message": text}})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint(request):
    e = Endpoint(request.param)
    yield e
    e.close()


def judge(endpoint):
    return LLMJudge("openai", "judge-model", base_url=endpoint.url, sleep=lambda s: None)


@pytest.mark.parametrize("endpoint", [[(200, "Yes."), (200, "no")]], indirect=True)
def test_yes_and_no_at_temperature_zero(endpoint):
    j = judge(endpoint)
    assert j.judge("Capital of France?", ["Paris"], "the city of Paris") is True
    assert j.judge("Capital of France?", ["Paris"], "Lyon") is False
    assert [b["temperature"] for b in endpoint.bodies] == [0.0, 0.0]
    assert "Reference answers: Paris" in endpoint.bodies[0]["messages"][0]["content"]
    assert (j.calls, j.tokens, j.failures) == (2, 82, 0)


@pytest.mark.parametrize("endpoint", [[(500, "down")] * 3 + [(200, "maybe")]], indirect=True)
def test_failures_are_tried_three_times_then_exact_match_decides(endpoint):
    j = judge(endpoint)
    assert j.judge("q", ["Paris"], "Lyon") is None
    assert (j.calls, j.failures) == (3, 3)
    assert j.judge("q", ["Paris"], "Lyon") is None  # neither yes nor no: no verdict either
    domain = SearchQADomain(judge=j)
    task = Task(id="t", question="q", gold=["Paris"])
    assert domain.score(task, "<answer>Paris</answer>", Env()) == (1.0, "Paris")  # no call
    assert j.calls == 4
    assert domain.costs() == {"judge_calls": 4, "judge_tokens": 41, "judge_failures": 3}


@pytest.mark.parametrize("endpoint", [[(200, "yes")]], indirect=True)
def test_the_domain_asks_the_judge_only_when_exact_match_fails(endpoint):
    domain = SearchQADomain(judge=judge(endpoint))
    task = Task(id="t", question="Capital of France?", gold=["Paris"])
    assert domain.score(task, "<answer>the city of Paris</answer>", Env()) == (
        1.0, "the city of Paris",
    )  # fmt: skip
    assert len(endpoint.bodies) == 1


def test_a_judge_needs_a_kind_and_a_model():
    with pytest.raises(ValueError, match="'claude'"):
        LLMJudge("claude", "m")
    with pytest.raises(ValueError, match="model name"):
        LLMJudge("openai", "")
