"""Several hosts, as two processes on this machine (jax.distributed over gloo, one CPU device
each): runs whose rollouts are host-local and whose train step is global. Every host
logs the same lines with the whole batch's counts, so their schedules cannot diverge."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from harness.files import read_json
from tests.conftest import xla_flags
from tests.loop.conftest import REPO, main_command, run_main, small_run_flags
from tests.loop.test_run import metric_lines


def lines_of(run_dir: str) -> list[dict]:
    """The metric lines without what the clock says (``time`` and every ``*_s``)."""

    def steady(d: dict) -> dict:
        return {k: steady(v) if isinstance(v, dict) else v for k, v in d.items()
                if k != "time" and not k.endswith("_s")}  # fmt: skip

    return [steady(x) for x in metric_lines(run_dir)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_hosts(tmp_path, tiny_model_dir, **overrides) -> list[subprocess.Popen]:
    port = free_port()
    overrides.setdefault("checkpoint_dir", str(tmp_path / "checkpoints"))  # shared, like a bucket
    overrides.setdefault("method", "weight-only")
    overrides.setdefault("reward_threshold", -1)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())  # one device per process
    procs = []
    for i in range(2):
        args = small_run_flags(str(tmp_path / f"host{i}"), tiny_model_dir,
                               coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=i, **overrides)  # fmt: skip
        procs.append(subprocess.Popen(main_command(args), cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 280) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # a host left hanging in a collective must not outlive the test
            p.kill()


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 240) -> None:
    """Polls ``ready()`` until it holds; fails if ``proc`` ended or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, what
        time.sleep(0.05)


def logged(run_dir, text: str):
    log = Path(run_dir) / "run.log"
    return lambda: log.exists() and text in log.read_text()


def test_sigterm_on_one_host_stops_both_at_the_same_step(tiny_model_dir, tmp_path):
    """Preemption notices reach hosts at different times. Were each host to act on its own, the
    one told would stop (or go into the save's barrier) while the other trained on, and both
    would hang in their next collective; they agree instead, save one checkpoint, exit 143."""
    procs = start_hosts(tmp_path, tiny_model_dir, epochs=6, eval_every_epochs=0,
                        checkpoint_every_steps=0, checkpoint_every_minutes=0,
                        preemption_grace_s=600)  # fmt: skip
    host1 = str(tmp_path / "host1")
    wait_for(procs[1], lambda: any(x["kind"] == "rsft" for x in lines_of(host1)),
             "host 1 did not step")  # fmt: skip
    procs[1].send_signal(signal.SIGTERM)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [143, 143], outs[0][-2000:] + outs[1][-2000:]
    saved = [re.findall(r"preempted: saved checkpoint (\d+)", out) for out in outs]
    assert saved[0] == saved[1] == ["1"], outs
    host0 = lines_of(str(tmp_path / "host0"))
    assert host0 == lines_of(host1) and 0 < sum(x["kind"] == "rsft" for x in host0) < 12


def test_checkpoints_each_host_keeps_to_itself_are_refused(tiny_model_dir, tmp_path):
    """The default checkpoint directory is inside each host's own run directory: on separate
    disks, one checkpoint's shards would be scattered over them."""
    procs = start_hosts(tmp_path, tiny_model_dir, checkpoint_dir="")
    outs = finish(procs)
    assert [p.returncode for p in procs] == [2, 2], outs[0][-2000:] + outs[1][-2000:]
    assert all("hosts [1] do not see what host 0 writes there" in out for out in outs)
    assert not os.listdir(tmp_path / "host0" / "checkpoints")  # the mark is cleaned up


def test_process_flags_without_a_coordinator_are_refused(tiny_model_dir, tmp_path):
    done = run_main(small_run_flags(str(tmp_path / "r"), tiny_model_dir, num_processes=2))
    assert done.returncode == 2 and "--coordinator_address" in done.stderr


def test_a_whale_run_on_two_hosts_searches_on_host_0_and_both_take_its_harness(
    tiny_model_dir, tmp_path
):
    """Host 0 proposes and scores candidates; host 1 waits on the coordination service and takes
    the accepted harness, its source and the phase's metric line, so every later line (the
    evaluations under that harness, the steps after it) is the same on both."""
    procs = start_hosts(tmp_path, tiny_model_dir, method="whale")
    outs = finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    host0, host1 = lines_of(str(tmp_path / "host0")), lines_of(str(tmp_path / "host1"))
    assert host0 == host1
    steps = [x for x in host0 if x["kind"] == "rsft"]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    # Rollouts are host-local, the train step global: each host sampled half of the batch, and
    # every line counts all of it (4 tasks x 2 samples).
    assert all(x["tasks"] == 4 and x["episodes"] == 8 and x["kept"] == 8 for x in steps)
    # Every step trained (the threshold keeps all) and each host's engine took the new weights.
    assert [x["weights_version"] for x in steps] == [1, 2, 3, 4]
    assert all(x["trained_tokens"] > 0 and x["loss"] is not None for x in steps)
    phase = [x for x in host0 if x["kind"] == "harness_phase"]
    assert len(phase) == 1 and phase[0]["candidates"] > 0
    assert phase[0]["cost"]["proposer_calls"] > 0  # host 0's calls, the only ones
    assert "host 0 searches; waiting" in outs[1] and "waiting" not in outs[0]
    accepted = [x["harness"] for x in host0 if x["kind"] == "eval"][-1]
    summaries = [read_json(str(tmp_path / f"host{i}" / "summary.json")) for i in range(2)]
    assert summaries[0]["harness"] == summaries[1]["harness"]
    assert summaries[0]["harness"]["id"] == accepted
    sources = [(tmp_path / f"host{i}" / summaries[i]["harness"]["path"]).read_text()
               for i in range(2)]  # fmt: skip
    assert sources[0] == sources[1]
    # Only host 0 scored candidates and writes the report.
    assert os.listdir(tmp_path / "host0" / "archive" / "phase-001" / "candidates")
    assert not (tmp_path / "host1" / "archive" / "phase-001" / "candidates").exists()
    assert (tmp_path / "host0" / "report").is_dir() and not (tmp_path / "host1" / "report").exists()


def test_sigterm_on_a_waiting_host_stops_host_0s_search(tiny_model_dir, tmp_path):
    """A host told to stop while host 0 searches posts it on the board; host 0 ends its phase at
    its next candidate, tells the others, and every host saves the same checkpoint and exits
    143 without the phase's line."""
    procs = start_hosts(tmp_path, tiny_model_dir, method="whale", harness_iterations=8,
                        checkpoint_every_steps=0, checkpoint_every_minutes=0,
                        preemption_grace_s=600)  # fmt: skip
    wait_for(procs[1], logged(tmp_path / "host1", "host 0 searches; waiting"),
             "host 1 did not wait")  # fmt: skip
    procs[1].send_signal(signal.SIGTERM)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [143, 143], outs[0][-2000:] + outs[1][-2000:]
    assert "(another host was told to stop)" in outs[0], outs[0][-3000:]
    assert "iteration 8" not in outs[0]
    # The weight phase before was saved at its end; both hosts agree nothing is new since.
    assert all("preempted: nothing new since the last checkpoint" in out for out in outs), outs
    host0 = lines_of(str(tmp_path / "host0"))
    assert host0 == lines_of(str(tmp_path / "host1"))
    assert not any(x["kind"] == "harness_phase" for x in host0)
    # The same command again: host 0 resumes its phase from its archive, host 1 waits again.
    procs = start_hosts(tmp_path, tiny_model_dir, method="whale", harness_iterations=8,
                        checkpoint_every_steps=0, checkpoint_every_minutes=0,
                        preemption_grace_s=600)  # fmt: skip
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "host 0 searches; waiting" in outs[1]
    host0 = lines_of(str(tmp_path / "host0"))
    assert host0 == lines_of(str(tmp_path / "host1"))
    assert sum(x["kind"] == "harness_phase" for x in host0) == 1
    assert [x["step"] for x in host0 if x["kind"] == "rsft"] == [1, 2, 3, 4]


def test_a_host_that_lost_its_archive_resumes_with_host_0s_harness(tiny_model_dir, tmp_path):
    """Stopped in the weight phase after a search, then resumed on a host 1 whose disk lost the
    archive (a fresh VM): the checkpoint names the accepted harness's path, and host 0's source
    is written there before anything reads it."""
    flags = dict(method="whale", checkpoint_every_steps=0, checkpoint_every_minutes=0,
                 preemption_grace_s=600, epochs=4)  # fmt: skip
    procs = start_hosts(tmp_path, tiny_model_dir, **flags)
    host1 = str(tmp_path / "host1")
    wait_for(procs[1], lambda: any(x["kind"] == "harness_phase" for x in lines_of(host1)),
             "no search on host 1")  # fmt: skip
    procs[1].send_signal(signal.SIGTERM)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [143, 143], outs[0][-2000:] + outs[1][-2000:]
    shutil.rmtree(os.path.join(host1, "archive"))
    procs = start_hosts(tmp_path, tiny_model_dir, **flags)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    host0 = lines_of(str(tmp_path / "host0"))
    assert host0 == lines_of(host1)
    assert [x["step"] for x in host0 if x["kind"] == "rsft"] == list(range(1, 9))
    harness = read_json(os.path.join(host1, "summary.json"))["harness"]
    assert (tmp_path / "host0" / harness["path"]).read_text() == (
        tmp_path / "host1" / harness["path"]
    ).read_text()


def test_a_search_that_fails_on_host_0_stops_the_waiting_host_too(tiny_model_dir, tmp_path):
    """Host 0's mirror breaks mid-search: its phase fails, it publishes why, and host 1 stops
    with that reason instead of waiting for an outcome that never comes."""
    mirror = tmp_path / "bucket" / "run"
    procs = start_hosts(tmp_path, tiny_model_dir, method="whale", harness_iterations=8,
                        run_dir_mirror=str(mirror))  # fmt: skip
    wait_for(procs[1], logged(tmp_path / "host1", "host 0 searches; waiting"),
             "host 1 did not wait")  # fmt: skip
    shutil.move(mirror, tmp_path / "elsewhere")
    mirror.write_text("the bucket is gone")  # host 0's next push (its next iteration) fails
    outs = finish(procs)
    assert [p.returncode for p in procs] == [1, 1], outs[0][-2000:] + outs[1][-2000:]
    assert "failed 3 times" in outs[0]
    assert "harness phase 1 failed on host 0: MirrorError" in outs[1], outs[1][-3000:]


def test_harness_only_phases_back_to_back_on_two_hosts(tiny_model_dir, tmp_path):
    """Without weight phases between them, each phase's board is its own (a stop or an outcome
    of one is never read as the next one's) and the evaluations between them stay in step."""
    procs = start_hosts(tmp_path, tiny_model_dir, method="harness-only", harness_phases=2)
    outs = finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    host0 = lines_of(str(tmp_path / "host0"))
    assert host0 == lines_of(str(tmp_path / "host1"))
    assert [x["phase"] for x in host0 if x["kind"] == "harness_phase"] == [1, 2]
    assert outs[1].count("host 0 searches; waiting") == 2
