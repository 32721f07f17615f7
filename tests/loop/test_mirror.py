"""The run directory's mirror (whale_jax/loop/mirror.py) on a local destination: what a push
copies and deletes, what a restore brings back, what it refuses; then a whole run whose VM loses
its disk mid-run and resumes from the mirror with the same command."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from tests.loop.conftest import run_in_process, run_main, small_run_flags
from tests.loop.test_run import archive_listing, metric_lines, shape, start, wait_for_lines
from whale_jax.loop.config import ConfigError, RunConfig, validate
from whale_jax.loop.mirror import MANIFEST, Mirror, MirrorError


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def tree(root) -> dict[str, str]:
    out = {}
    for top, _, names in os.walk(root):
        for name in names:
            path = os.path.join(top, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.fixture
def run_dir(tmp_path):
    root = tmp_path / "run"
    write(root / "config.json", '{"hash": "h"}')
    write(root / "metrics.jsonl", '{"kind": "start"}\n')
    write(root / "archive" / "initial.py", "def run(): pass\n")
    write(root / "compile_cache" / "program", "compiled")  # not mirrored
    write(root / "checkpoints" / "1" / "arrays", "weights")  # not mirrored
    return root


def test_push_then_restore_on_an_empty_disk(run_dir, tmp_path):
    dest = tmp_path / "bucket" / "run"
    assert Mirror(str(run_dir), str(dest), log=lambda s: None).push() == {"copied": 3, "deleted": 0}
    assert set(tree(dest)) == {"config.json", "metrics.jsonl", "archive/initial.py", MANIFEST}
    mtime = os.stat(run_dir / "metrics.jsonl").st_mtime_ns
    # The VM and its disk are gone: a new, empty run directory is filled from the mirror.
    fresh = tmp_path / "new-vm" / "run"
    assert Mirror(str(fresh), str(dest), log=lambda s: None).restore() == 3
    expected = {k: v for k, v in tree(run_dir).items() if not k.startswith(("compile", "check"))}
    assert tree(fresh) == expected
    assert os.stat(fresh / "metrics.jsonl").st_mtime_ns == mtime  # the next push sends nothing
    assert Mirror(str(fresh), str(dest), log=lambda s: None).push() == {"copied": 0, "deleted": 0}


def test_a_push_sends_what_changed_and_deletes_what_is_gone(run_dir, tmp_path):
    dest = tmp_path / "mirror"
    mirror = Mirror(str(run_dir), str(dest), log=lambda s: None)
    mirror.push()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"kind": "rsft"}\n')
    write(run_dir / "archive" / "phase-001" / "accepted.py", "def run(): return 1\n")
    shutil.move(run_dir / "archive" / "initial.py", run_dir / "archive" / "moved.py")
    assert mirror.push() == {"copied": 3, "deleted": 1}
    assert tree(dest)["metrics.jsonl"].count("\n") == 2
    assert not (dest / "archive" / "initial.py").exists()
    manifest = json.loads((dest / MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "metrics.jsonl", "archive/moved.py",
                                      "archive/phase-001/accepted.py"}  # fmt: skip


def test_a_started_run_directory_is_not_overwritten(run_dir, tmp_path):
    dest = tmp_path / "mirror"
    Mirror(str(run_dir), str(dest), log=lambda s: None).push()
    write(run_dir / "metrics.jsonl", "newer, not pushed yet\n")
    assert Mirror(str(run_dir), str(dest), log=lambda s: None).restore() == 0
    assert (run_dir / "metrics.jsonl").read_text() == "newer, not pushed yet\n"


def test_a_destination_holding_other_data_is_refused_and_left_alone(run_dir, tmp_path):
    dest = tmp_path / "shared"
    write(dest / "someone-elses.csv", "a,b\n")
    for call in ("push", "restore"):
        with pytest.raises(MirrorError, match=r"someone-elses.csv.*choose an empty path"):
            getattr(Mirror(str(run_dir), str(dest), log=lambda s: None), call)()
    assert tree(dest) == {"someone-elses.csv": "a,b\n"}
    # Files the mirror did not write are never deleted, even beside its own.
    ok = tmp_path / "ok"
    Mirror(str(run_dir), str(ok), log=lambda s: None).push()
    write(ok / "notes.txt", "mine")
    os.remove(run_dir / "config.json")
    Mirror(str(run_dir), str(ok), log=lambda s: None).push()
    assert (ok / "notes.txt").exists() and not (ok / "config.json").exists()


def test_a_first_push_cut_short_leaves_a_mirror_the_run_still_owns(run_dir, tmp_path):
    dest = tmp_path / "mirror"
    mirror = Mirror(str(run_dir), str(dest), log=lambda s: None, attempts=1)
    put = mirror._put
    sent: list[str] = []

    def dies_after_one_file(src, rel):  # the VM is gone after the first file
        if sent:
            raise OSError("connection reset")
        sent.append(rel)
        put(src, rel)

    mirror._put = dies_after_one_file
    with pytest.raises(MirrorError, match="connection reset"):
        mirror.push()
    assert len(sent) == 1 and (dest / sent[0]).exists()
    assert json.loads((dest / MANIFEST).read_text())["files"] == {}
    # The restarted run is not refused: nothing is restored (no save was made), then it pushes.
    fresh = tmp_path / "new-vm" / "run"
    assert Mirror(str(fresh), str(dest), log=lambda s: None).restore() == 0
    assert Mirror(str(run_dir), str(dest), log=lambda s: None).push()["copied"] == 3


def test_a_failing_destination_is_retried_then_named(run_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    logs: list[str] = []
    mirror = Mirror(str(run_dir), str(blocker / "run"), log=logs.append, backoff_s=0.0)
    with pytest.raises(MirrorError, match=r"--run_dir_mirror=.*a-file/run: .*failed 3 times"):
        mirror.push()
    assert sum("retrying" in x for x in logs) == 2


def test_a_corrupt_manifest_is_an_error_naming_it(run_dir, tmp_path):
    dest = tmp_path / "mirror"
    write(dest / MANIFEST, "{not json")
    with pytest.raises(MirrorError, match="cannot read it"):
        Mirror(str(tmp_path / "empty"), str(dest), log=lambda s: None).restore()


def test_a_local_mirror_inside_the_run_directory_is_refused(tmp_path):
    run = str(tmp_path / "run")
    for mirror in (os.path.join(run, "copy"), str(tmp_path)):
        with pytest.raises(ConfigError, match="--run_dir_mirror"):
            validate(RunConfig(run_dir=run, mirror=mirror))
    validate(RunConfig(run_dir=run, mirror=str(tmp_path / "elsewhere")))
    assert RunConfig(run_dir=run, mirror="gs://b/r").checkpoint_dir == "gs://b/r/checkpoints"


def test_a_vm_that_loses_its_disk_resumes_from_the_mirror(tiny_model_dir, tmp_path):
    """kill -9 mid-run (after the harness phase began), the local run directory deleted (a new
    VM), the same command again: it restores the run directory, resumes from the checkpoint beside
    the mirror, and ends with the metrics and archive of an uninterrupted run."""
    base = str(tmp_path / "base")
    run_in_process(small_run_flags(base, tiny_model_dir))  # the uninterrupted run
    # A mirror gained on resume moves the default checkpoint directory: refused, not restarted.
    before = metric_lines(base)
    moved = run_main(small_run_flags(base, tiny_model_dir, run_dir_mirror=str(tmp_path / "m")))
    assert moved.returncode == 2, moved.stdout[-3000:] + moved.stderr[-3000:]
    assert f"pass --checkpoint_dir={base}/checkpoints" in moved.stderr
    assert metric_lines(base) == before
    run_dir, mirror = str(tmp_path / "vm" / "run"), str(tmp_path / "bucket" / "run")
    args = small_run_flags(run_dir, tiny_model_dir, run_dir_mirror=mirror)
    proc = start(args)
    wait_for_lines(proc, run_dir, len(metric_lines(base)) // 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    shutil.rmtree(os.path.dirname(run_dir))
    assert os.listdir(os.path.join(mirror, "checkpoints"))  # Orbax wrote beside the mirror
    done = run_main(args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run directory restored from" in done.stdout and "resumed from checkpoint" in done.stdout
    assert shape(metric_lines(run_dir)) == shape(metric_lines(base))
    assert archive_listing(run_dir) == archive_listing(base)
    # The mirror ends equal to the run directory (what it mirrors), report included; the log
    # lacks only the line reporting the last push.
    local = {k: v for k, v in tree(run_dir).items()
             if not k.startswith(("compile_cache", "checkpoints"))}  # fmt: skip
    remote = {k: v for k, v in tree(mirror).items() if not k.startswith(("checkpoints", MANIFEST))}
    log, remote_log = local.pop("run.log"), remote.pop("run.log")
    assert log.startswith(remote_log) and log[len(remote_log) :].count("\n") <= 1
    assert remote == local and "report/report.md" in remote


def test_a_foreign_destination_stops_the_run_as_bad_input(tiny_model_dir, tmp_path):
    mirror = tmp_path / "shared"
    write(mirror / "someone-elses.csv", "a,b\n")
    args = small_run_flags(str(tmp_path / "run"), tiny_model_dir, run_dir_mirror=str(mirror))
    done = run_main(args)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "choose an empty path" in done.stderr
    assert tree(mirror) == {"someone-elses.csv": "a,b\n"}


def test_sigterm_with_a_broken_mirror_saves_nothing_and_exits_143(tiny_model_dir, tmp_path):
    """The mirror comes first: when it cannot be written at the preemption save, no checkpoint is
    made (it would refer to files the mirror lacks) and the run still stops as preempted."""
    run_dir, mirror = str(tmp_path / "run"), tmp_path / "bucket" / "run"
    checkpoints = str(tmp_path / "checkpoints")  # apart from the mirror: a save there would work
    args = small_run_flags(run_dir, tiny_model_dir, run_dir_mirror=str(mirror), weight_epochs=2,
                           checkpoint_dir=checkpoints, eval_every_epochs=0, checkpoint_every_steps=0,
                           checkpoint_every_minutes=0, preemption_grace_s=600)  # fmt: skip
    proc = start(args)
    wait_for_lines(proc, run_dir, 3)  # start, eval, rsft 1
    if mirror.exists():  # nothing was pushed yet in a weight-only run without saves
        shutil.move(mirror, tmp_path / "elsewhere")
    mirror.parent.mkdir(parents=True, exist_ok=True)
    mirror.write_text("the bucket is gone")  # every write into it now fails
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out[-3000:]
    assert "preempted: not saved" in out and "failed 3 times" in out
    assert not os.path.exists(checkpoints) or os.listdir(checkpoints) == []
