"""Hostile harnesses: each is contained with the right recorded reason while a good harness runs
beside it (concurrently, in the same executor) and completes every episode."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import pytest

from harness.domains.arith import generate
from tests.harness.conftest import TEST_BUDGETS, make_executor

GOOD = """
def run(task, model, tools):
    return model.chat([{"role": "user", "content": task.question}])
"""


def run_beside_good(executor, arith, tasks, hostile: str):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(executor.run, hostile, arith, tasks[:2], run_id="bad")
        good = pool.submit(executor.run, GOOD, arith, tasks, run_id="good")
        bad_records, good_records = bad.result(timeout=90), good.result(timeout=90)
    assert [r.stop_reason for r in good_records] == ["answered"] * len(tasks)
    assert all(r.reward == 1.0 for r in good_records)
    return bad_records


def body(code: str) -> str:
    lines = "\n".join("    " + line for line in code.strip().splitlines())
    return f"def run(task, model, tools):\n{lines}\n"


# (name, source, expected stop_reason, text expected in the error, executor overrides)
OFF = {"static_check": False}

CASES = [
    (
        "syntax_error",
        "def run(task, model, tools)\n    return 1\n",
        "static_check",
        "SyntaxError",
        {},
    ),
    (
        "import_os",
        "import os\n" + body("return os.environ['OPENAI_API_KEY']"),
        "static_check",
        "'os'",
        {},
    ),
    (
        "import_subprocess",
        "import subprocess\n" + body("return None"),
        "static_check",
        "'subprocess'",
        {},
    ),
    ("import_ctypes", "import ctypes\n" + body("return None"), "static_check", "'ctypes'", {}),
    (
        "socket",
        "import socket\n" + body("socket.create_connection(('127.0.0.1', 9))"),
        "static_check",
        "'socket'",
        {},
    ),
    (
        "write_outside",
        body("open('/tmp/whale-escape', 'w').write('x')"),
        "static_check",
        "'open'",
        {},
    ),
    # The same attacks with the static check off: the worker's second line stops them.
    (
        "env_key_runtime",
        "import os\n" + body("return os.environ['OPENAI_API_KEY']"),
        "harness_load",
        "not allowed",
        OFF,
    ),
    ("socket_runtime", "import socket\n" + body("return None"), "harness_load", "not allowed", OFF),
    ("fork_runtime", "import os\n" + body("os.fork()"), "harness_load", "not allowed", OFF),
    ("write_runtime", body("open('/tmp/whale-escape', 'w').write('x')"), "error", "NameError", OFF),
    ("builtins_escape", body("return ().__class__.__base__.__subclasses__()"), "error", "", OFF),
    ("raises", body("raise RuntimeError('boom')"), "error", "RuntimeError: boom", {}),
    ("memory_bomb", body("x = 'a' * (8 << 30)\nreturn x"), "memory_limit", "MemoryError", {}),
    (
        "memory_growth",
        body("keep = []\nwhile True:\n    keep.append(bytearray(50 << 20))"),
        "memory_limit",
        "MemoryError",
        {"budgets": dataclasses.replace(TEST_BUDGETS, step_s=15.0)},
    ),  # touching 700 MB takes seconds
    ("huge_output", body("while True:\n    print('x' * 1000)"), "output_limit", "output", {}),
    ("huge_answer", body("return 'x' * (16 << 20)"), "output_limit", "answer", {}),
    ("infinite_loop", body("while True:\n    pass"), "timeout", "no request", {}),
    ("exit", body("raise SystemExit(0)"), "error", "SystemExit", {}),
    (
        "load_time_error",
        "raise RuntimeError('at import')\n" + GOOD,
        "harness_load",
        "at import",
        {},
    ),
]


@pytest.mark.parametrize(
    "name, source, stop, error_text, overrides", CASES, ids=[c[0] for c in CASES]
)
def test_hostile_harness_is_contained(
    name, source, stop, error_text, overrides, arith, arith_tasks, executor
):
    ex = make_executor(**overrides) if overrides else executor
    try:
        records = run_beside_good(ex, arith, arith_tasks, source)
    finally:
        if ex is not executor:
            ex.close()
    for r in records:
        assert r.stop_reason == stop, (r.stop_reason, r.error)
        assert r.reward == 0.0
        assert error_text in (r.error or ""), r.error
    assert not os.path.exists("/tmp/whale-escape")


def test_worker_reports_protections(arith, arith_tasks, executor):
    executor.run(GOOD, arith, arith_tasks[:1])
    p = executor.last_protections
    assert p["audit_hook"] == "installed"
    assert p["memory"] == str(768 << 20)
    if os.geteuid() == 0:  # where the OS allows it, every protection applies
        assert p["network"].startswith("isolated")
        assert p["privileges"].startswith("dropped to nobody")
        assert p["processes"].startswith("0")


def test_environment_is_scrubbed(monkeypatch):
    from harness.pytool import PythonToolConfig, run_python

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-sandboxes")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-sandboxes")
    out = run_python("import os\nprint(sorted(os.environ))", PythonToolConfig(timeout_s=20))
    assert out["status"] == "ok"
    assert "OPENAI_API_KEY" not in out["stdout"] and "AWS_SECRET" not in out["stdout"]


NON_FINITE_SETTINGS = body("""
errors = []
for settings in ({"max_new_tokens": float("inf")}, {"temperature": 1e400}, {"top_p": 10**400},
                 {"top_k": float("inf")}, {"top_k": True}, {"temperature": float("nan")},
                 {"max_new_tokens": 10**40}, {"stop": ["x"] * 17}, {"enable_thinking": 3}):
    try:
        model.chat([{"role": "user", "content": task.question}], **settings)
        errors.append("accepted " + repr(settings))
    except model.ModelError as e:
        errors.append("refused")
print(" ".join(errors))
return model.chat([{"role": "user", "content": task.question}])
""")


def test_absurd_sampling_settings_are_refused_and_the_run_finishes(arith, arith_tasks):
    """Non-finite, huge and mistyped sampling settings come back as model errors to the harness;
    they once killed the executor's reader thread and hung the run."""
    with make_executor() as ex:
        records = run_beside_good(ex, arith, arith_tasks, NON_FINITE_SETTINGS)
    assert [r.stop_reason for r in records] == ["answered"] * 2
    assert all(r.output.strip() == " ".join(["refused"] * 9) for r in records), records[0].output
    assert all(len(r.calls) == 1 for r in records)  # only the sane call reached the model


# A harness that reaches its worker's channel (possible with the Python-level layers off) and
# writes a frame of its own, addressed to its own episode so the handlers get past the lookup:
# each frame must end in a recorded reason for that worker's episodes, never a hang.
FORGED = body("""
frames = [
    {"t": "chat", "rid": 1, "messages": [{"role": "user", "content": "hi"}],
     "settings": {"top_p": 10**400}},
    {"t": "chat", "rid": 1, "messages": [{"role": "user", "content": "hi"}],
     "settings": {"max_new_tokens": 1e400}},
    {"t": "chat", "rid": 1, "messages": [{"role": "user", "content": "hi"}],
     "settings": {"bogus": 1}},
    {"t": "chat", "rid": [1], "messages": "x" * 5000, "settings": []},
    {"t": "tool", "rid": {}, "name": None, "args": {}, "kwargs": []},
    {"t": "done", "kind": ["x"], "answer": {"a": 1}, "output": 10**400},
    {"t": "ready", "protections": [1, 2]},
    {"t": 7},
]
frame = dict(frames[(OFFSET + int(model._ep.key[1:])) % len(frames)], ep=model._ep.key)
model._worker.chan.send(frame)
return model.chat([{"role": "user", "content": task.question}])
""")


@pytest.mark.parametrize("offset", [0, 4])
def test_forged_frames_never_hang_the_executor(arith, offset):
    tasks = generate(4, seed=100)
    with make_executor(static_check=False, concurrency=1) as ex:
        records = ex.run(f"OFFSET = {offset}\n" + FORGED, arith, tasks, run_id=f"forged{offset}")
    assert len(records) == len(tasks)
    assert all(r.stop_reason for r in records), [r.stop_reason for r in records]
