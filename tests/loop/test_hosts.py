"""Several hosts, as two processes on this machine (jax.distributed over gloo, one CPU device
each): a weight-only run whose rollouts are host-local and whose train step is global. Every host
logs the same lines with the whole batch's counts, so their schedules cannot diverge."""

from __future__ import annotations

import json
import os
import socket
import subprocess

from tests.loop.conftest import REPO, main_command, run_main, small_run_flags


def lines_of(run_dir: str) -> list[dict]:
    """The metric lines without what the clock says (``time`` and every ``*_s``)."""

    def steady(d: dict) -> dict:
        return {k: steady(v) if isinstance(v, dict) else v for k, v in d.items()
                if k != "time" and not k.endswith("_s")}  # fmt: skip

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [steady(json.loads(x)) for x in f if x.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_weight_only_run_on_two_hosts(tiny_model_dir, tmp_path):
    port, checkpoints = free_port(), str(tmp_path / "checkpoints")  # shared, like a bucket
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one device per process
    procs = []
    for i in range(2):
        args = small_run_flags(str(tmp_path / f"host{i}"), tiny_model_dir, method="weight-only",
                               reward_threshold=-1, checkpoint_dir=checkpoints,
                               coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=i)  # fmt: skip
        procs.append(subprocess.Popen(main_command(args), cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outs = [p.communicate(timeout=280)[0] for p in procs]
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


def test_process_flags_without_a_coordinator_are_refused(tiny_model_dir, tmp_path):
    done = run_main(small_run_flags(str(tmp_path / "r"), tiny_model_dir, num_processes=2))
    assert done.returncode == 2 and "--coordinator_address" in done.stderr
