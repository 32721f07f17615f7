"""Several hosts, as two processes on this machine (jax.distributed over gloo, one CPU device
each): a weight-only run whose rollouts are host-local and whose train step is global. Every host
logs the same lines with the whole batch's counts, so their schedules cannot diverge."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

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
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one device per process
    procs = []
    for i in range(2):
        args = small_run_flags(str(tmp_path / f"host{i}"), tiny_model_dir, method="weight-only",
                               reward_threshold=-1,
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


def test_a_weight_only_run_on_two_hosts(tiny_model_dir, tmp_path):
    procs = start_hosts(tmp_path, tiny_model_dir)
    outs = finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    host0, host1 = lines_of(str(tmp_path / "host0")), lines_of(str(tmp_path / "host1"))
    assert host0 == host1
    steps = [x for x in host0 if x["kind"] == "rsft"]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    # Each host sampled half of the batch; every line counts all of it (4 tasks x 2 samples).
    assert all(x["tasks"] == 4 and x["episodes"] == 8 and x["kept"] == 8 for x in steps)
    # Every step trained (the threshold keeps all) and each host's engine took the new weights.
    assert [x["weights_version"] for x in steps] == [1, 2, 3, 4]
    assert all(x["trained_tokens"] > 0 and x["loss"] is not None for x in steps)


def test_sigterm_on_one_host_stops_both_at_the_same_step(tiny_model_dir, tmp_path):
    """Preemption notices reach hosts at different times. Were each host to act on its own, the
    one told would stop (or go into the save's barrier) while the other trained on, and both
    would hang in their next collective; they agree instead, save one checkpoint, exit 143."""
    procs = start_hosts(tmp_path, tiny_model_dir, epochs=6, eval_every_epochs=0,
                        checkpoint_every_steps=0, checkpoint_every_minutes=0,
                        preemption_grace_s=600)  # fmt: skip
    host1 = str(tmp_path / "host1")
    deadline = time.monotonic() + 240
    while not any(x["kind"] == "rsft" for x in lines_of(host1)):
        assert procs[1].poll() is None and time.monotonic() < deadline, "host 1 did not step"
        time.sleep(0.05)
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
