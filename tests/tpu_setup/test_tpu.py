"""tpu_setup/tpu.py without a cloud: the watcher's decisions, the launch command run by a real
shell, and a whole watch (create, install, launch, a preemption, the new VM, the end) against a
scripted stand-in for the gcloud CLI that records every call."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from tpu_setup import tpu

FAKE_GCLOUD = r'''#!/usr/bin/env python3
"""A scripted gcloud: queued resources and TPU VM hosts as a JSON state file."""
import json, os, shutil, sys
path = os.environ["FAKE_GCLOUD_STATE"]
with open(path) as f:
    s = json.load(f)
argv = sys.argv[1:]
s["log"].append(argv)
out, err, code = "", "", 0
words = [a for a in argv if not a.startswith("--")]
flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
if words[:3] == ["compute", "tpus", "queued-resources"]:
    verb = words[3]
    if verb == "create":
        s["qr"], s["countdown"], s["installed"] = "WAITING_FOR_RESOURCES", 1, False
    elif verb == "describe":
        if s["qr"] is None:
            err, code = "ERROR: (gcloud) NOT_FOUND: queued resource not found", 1
        else:
            if s["qr"] == "WAITING_FOR_RESOURCES":
                s["countdown"] -= 1
                if s["countdown"] < 0:
                    s["qr"] = "ACTIVE"
            out = s["qr"] + "\n"
    elif verb == "delete":
        s["qr"] = None
elif words[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    dest = os.path.join(s["vm"], words[5].split(":", 1)[1])
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    shutil.copy(words[4], dest)
elif words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    command = flags["command"]
    if "pgrep" in command:
        if not s["installed"]:
            out = "uninstalled\n"
        elif not s["queue"]:
            out = "none\n"
        else:
            item = s["queue"].pop(0)
            if item == "preempt":  # running when looked at; the VM is taken right after
                s["qr"], s["installed"], item = "SUSPENDED", False, "running"
            out = item + "\n"
    elif "pip install" in command:
        assert os.path.exists(os.path.join(s["vm"], "whale_jax.tar.gz"))
        s["installed"] = True
    elif "whale_jax.main" in command:
        s["launches"] += 1
        s["queue"] = list(s["script"][s["launches"] - 1])
with open(path, "w") as f:
    json.dump(s, f)
sys.stdout.write(out)
sys.stderr.write(err)
sys.exit(code)
'''


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
    exe = tmp_path / "gcloud"
    exe.write_text(FAKE_GCLOUD)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    state = tmp_path / "state.json"
    monkeypatch.setenv("FAKE_GCLOUD_STATE", str(state))

    def setup(script):
        state.write_text(json.dumps({"qr": None, "countdown": 0, "installed": False,
                                     "launches": 0, "script": script, "queue": [], "log": [],
                                     "vm": str(tmp_path / "vm")}))  # fmt: skip
        return str(exe), lambda: json.loads(state.read_text())

    return setup


def target(gcloud: str, **kw) -> tpu.Target:
    base = dict(name="whale-math", zone="zone-a", accelerator="v4-8", runtime="tpu-rt",
                mirror="gs://bucket/runs/math", flags=("--flagfile=experiments/math.flags",),
                gcloud=gcloud)  # fmt: skip
    return tpu.Target(**{**base, **kw})


@pytest.mark.parametrize(
    ("state", "job", "restarts", "action"),
    [
        ("NOT_FOUND", None, 0, "create"),
        ("WAITING_FOR_RESOURCES", None, 0, "wait"),
        ("PROVISIONING", None, 0, "wait"),
        ("SUSPENDED", None, 0, "recreate"),  # a Spot VM taken back
        ("FAILED", None, 0, "recreate"),
        ("ACTIVE", "uninstalled", 0, "install"),
        ("ACTIVE", "none", 0, "launch"),
        ("ACTIVE", "running", 0, "wait"),
        ("ACTIVE", 0, 0, "done"),
        ("ACTIVE", 2, 0, "fail"),  # bad flags or data: a relaunch cannot mend them
        ("ACTIVE", 143, 3, "launch"),  # SIGTERM (maintenance): never counted against restarts
        ("ACTIVE", 1, 2, "launch"),
        ("ACTIVE", 137, 3, "fail"),  # crashed --max_restarts times already
    ],
)
def test_decide(state, job, restarts, action):
    assert tpu.decide(state, job, restarts, max_restarts=3) == action


def test_the_launch_command_runs_in_a_shell(tmp_path):
    """The exact string every host runs, in sh here: the run's flags arrive whole (quoting), the
    passed variables are exported, output and exit status land in files, and it returns at once."""
    home = tmp_path / "host"
    (home / tpu.REMOTE_DIR / ".venv" / "bin").mkdir(parents=True)
    python = home / tpu.REMOTE_DIR / ".venv" / "bin" / "python"
    python.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        sleep 1
        printf '%s\\n' "$@" > args.txt
        echo "key=$WHALE_TEST_KEY"
        exit 3
    """)
    )
    python.chmod(0o755)
    (home / tpu.REMOTE_DIR / ".env").write_text("export WHALE_TEST_KEY='s3 cr\"t'\n")
    t = tpu.Target(name="r1", zone="z", mirror="gs://b/r1",
                   flags=("--flagfile=experiments/math.flags", "--proposer_command=ask 'it' {prompt}"))  # fmt: skip
    # A run left from a launch before, hung in a collective: the launch ends it first.
    (home / tpu.REMOTE_DIR / "runs").mkdir()
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "whale_jax"])
    (home / tpu.REMOTE_DIR / "runs" / "r1.pid").write_text(f"{leftover.pid}\n")
    t0 = time.monotonic()
    # Output captured: the command must also let go of ssh's stdout at once.
    done = subprocess.run(["sh", "-c", tpu.launch_command(t)], cwd=home, check=True, timeout=30,
                          capture_output=True)  # fmt: skip
    assert time.monotonic() - t0 < 3.0 and done.stdout == b""  # in the background
    assert leftover.wait(timeout=5) == -9
    status = home / tpu.REMOTE_DIR / "runs" / "r1.exit"
    deadline = time.monotonic() + 20
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status.read_text().strip() == "3"
    args = (home / tpu.REMOTE_DIR / "args.txt").read_text().splitlines()
    assert args == ["-m", "whale_jax.main", "--flagfile=experiments/math.flags",
                    "--proposer_command=ask 'it' {prompt}", "--run_dir=runs/r1",
                    "--run_dir_mirror=gs://b/r1", "--compilation_cache_dir=gs://b/r1/compile_cache",
                    "--distributed"]  # fmt: skip
    assert (home / tpu.REMOTE_DIR / "runs" / "r1.out").read_text() == 'key=s3 cr"t\n'
    # The slice's hosts join jax.distributed unless the flags say how already.
    for own in ("--nodistributed", "--coordinator_address=h:1"):
        mine = tpu.launch_command(dataclasses.replace(t, flags=(*t.flags, own)))
        assert "--distributed" not in mine


def test_watch_brings_a_preempted_run_back_on_a_new_vm(fake_gcloud, monkeypatch):
    # First VM: the run is running, then the VM is taken. Second VM: running, then it ends.
    gcloud, read = fake_gcloud([["running", "preempt"], ["running", "exit 0"]])
    monkeypatch.setenv("WHALE_TEST_KEY", "not-on-any-command-line")
    cloud = tpu.Cloud(target(gcloud, pass_env=("WHALE_TEST_KEY",)), log=lambda s: None)
    assert tpu.watch(cloud, os.getcwd(), poll_s=0, max_restarts=3, delete_when_done=True) == 0
    s = read()
    verbs = [" ".join(a[2:4]) if a[1] == "tpus" and a[2] == "queued-resources" else a[3]
             for a in s["log"] if "describe" not in a and "pgrep" not in " ".join(a)]  # fmt: skip
    assert verbs == ["queued-resources create", "scp", "ssh",  # create, install
                     "scp", "ssh", "ssh",  # the key file, chmod, launch
                     "queued-resources delete", "queued-resources create", "scp", "ssh",
                     "scp", "ssh", "ssh", "queued-resources delete"]  # fmt: skip
    assert s["launches"] == 2 and s["qr"] is None
    create = next(a for a in s["log"] if "create" in a)
    assert "--spot" in create and "--accelerator-type=v4-8" in create and "--zone=zone-a" in create
    assert not any("not-on-any-command-line" in " ".join(a) for a in s["log"])
    env = os.path.join(s["vm"], tpu.REMOTE_DIR, ".env")
    assert open(env).read() == "export WHALE_TEST_KEY=not-on-any-command-line\n"


@pytest.mark.parametrize(
    ("words", "job"),
    [
        (["running", "running"], "running"),
        (["exit 0", "running"], "running"),  # host 0 is done, host 1 still writing its end
        (["exit 0", "exit 0"], 0),
        (["running", "exit 1"], 1),  # host 1 crashed: host 0 waits for it for ever
        (["exit 143", "running"], 143),
        (["none", "none"], "none"),
        (["exit", "none"], "none"),  # an exit file cut short
        (["uninstalled", "exit 0"], "uninstalled"),  # a host replaced by a fresh one
    ],
)
def test_the_job_over_every_host(words, job):
    assert tpu.combine(words) == job


def test_watch_rides_out_failing_gcloud_calls(fake_gcloud):
    gcloud, read = fake_gcloud([["running", "exit 0"]])
    calls = []

    def flaky(cloud):  # ssh to a VM that is coming up, then a dropped connection
        calls.append(1)
        if len(calls) in (2, 4):
            raise tpu.GcloudError("ssh: connect to host: Connection refused")
        return tpu.job_status(cloud)

    logs: list[str] = []
    cloud = tpu.Cloud(target(gcloud), log=logs.append)
    assert tpu.watch(cloud, os.getcwd(), poll_s=0, max_restarts=3, delete_when_done=True,
                     status=flaky) == 0  # fmt: skip
    assert read()["launches"] == 1 and sum("gcloud failed (1 of 10" in x for x in logs) == 2
    # Failing every time, it gives up after max_failures.
    gcloud, read = fake_gcloud([])
    cloud = tpu.Cloud(target(gcloud), log=logs.append)

    def down(cloud):
        raise tpu.GcloudError("ssh: Connection timed out")

    assert tpu.watch(cloud, os.getcwd(), poll_s=0, max_restarts=3, delete_when_done=True,
                     status=down, max_failures=2) == 1  # fmt: skip
    assert "failed 3 times in a row; stopping" in logs[-1]


def test_watch_stops_on_bad_input_and_after_max_restarts(fake_gcloud):
    gcloud, read = fake_gcloud([["exit 2"]])
    cloud = tpu.Cloud(target(gcloud), log=lambda s: None)
    assert tpu.watch(cloud, os.getcwd(), poll_s=0, max_restarts=3, delete_when_done=True) == 1
    assert read()["launches"] == 1 and read()["qr"] == "ACTIVE"  # kept for a look at the logs
    gcloud, read = fake_gcloud([["exit 1"]] * 3)
    cloud = tpu.Cloud(target(gcloud), log=lambda s: None)
    assert tpu.watch(cloud, os.getcwd(), poll_s=0, max_restarts=2, delete_when_done=True) == 1
    assert read()["launches"] == 3  # the first launch and two restarts


def test_the_command_line_checks_what_it_needs(capsys):
    with pytest.raises(SystemExit):
        tpu.parse(["watch", "--name=n", "--zone=z", "--", "--flagfile=f"])
    assert "needs --mirror" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpu.parse(["launch", "--name=n", "--zone=z", "--mirror=gs://b/r", "--", "--run_dir=x"])
    assert "set from --name and --mirror" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="gs:// path"):
        tpu.launch_command(tpu.Target(name="n", zone="z", mirror="/local/disk"))
    for bad, says in (
        (["--name=n;reboot"], "--name='n;reboot': lowercase"),
        (["--name=n", "--pass_env=A;rm -rf ~"], "is not a variable name"),
    ):
        with pytest.raises(SystemExit):
            tpu.parse(["status", "--zone=z", *bad])
        assert says in capsys.readouterr().err
    args, t = tpu.parse(["status", "--name=n", "--zone=z", "--no-spot", "--", "--seed=1"])
    assert args.command == "status" and not t.spot and t.flags == ("--seed=1",)
    done = subprocess.run([sys.executable, "tpu_setup/tpu.py", "--help"], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0 and "watch" in done.stdout
