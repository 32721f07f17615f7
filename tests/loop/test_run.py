"""The WHALE program end to end, as users run it (``python -m whale_jax.main``): a whole run,
kill -9 at several points then restart, SIGTERM, a changed config on resume. A tiny random model
with SmolLM2's real tokenizer keeps each start to seconds; the learning run is in test_e2e.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.loop.conftest import (
    REPO,
    main_command,
    metric_lines,
    run_in_process,
    run_main,
    small_run_flags,
)
from whale_jax.engine import warmup


def shape(lines: list[dict]) -> list[tuple]:
    """What must not change with interruptions: the sequence of (kind, step, harness, phase)."""
    return [(x["kind"], x["step"], x["harness"], x.get("phase_kind"), x.get("reason"))
            for x in lines]  # fmt: skip


def archive_listing(run_dir: str) -> list[str]:
    root = os.path.join(run_dir, "archive")
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".discarded", "proposals")]
        for name in files:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(main_command(args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def wait_for_lines(proc: subprocess.Popen, run_dir: str, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(metric_lines(run_dir)) < n:
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended before {n} metric lines:\n{proc.stdout.read()[-3000:]}"
            )
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model_dir):
    run_dir = str(tmp_path_factory.mktemp("baseline") / "run")
    # The default compilation cache, the run's own (test_a_whole_run checks it is written).
    done = run_main(small_run_flags(run_dir, tiny_model_dir, compilation_cache_dir=""))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, done.stdout


def test_a_whole_run(baseline, tiny_model_dir):
    run_dir, out = baseline
    lines = metric_lines(run_dir)
    kinds = [x["kind"] for x in lines]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert [x["step"] for x in lines if x["kind"] == "rsft"] == [1, 2, 3, 4]
    assert [x["phase_kind"] for x in lines if x["kind"] == "phase_end"] == [
        "weight", "harness", "weight"]  # fmt: skip
    evals = [x for x in lines if x["kind"] == "eval"]
    assert evals[0]["step"] == 0 and {"test", "validation"} <= set(evals[0])
    assert lines[-1]["cost"]["weight_episodes"] == 4 * 4 * 2
    assert lines[-1]["cost"]["harness_episodes"] >= 4  # the incoming harness on 4 search tasks
    assert lines[-1]["cost"]["proposer_calls"] == 1
    assert "run directory" in out and "report:" in out
    assert os.path.exists(os.path.join(run_dir, "report", "report.md"))
    assert os.path.exists(os.path.join(run_dir, "report", "mean_at_k.png"))
    assert os.listdir(os.path.join(run_dir, "tensorboard"))
    assert os.listdir(os.path.join(run_dir, "compile_cache"))  # a resume loads, not compiles
    # ... and warms, before its first rollout, the engine shapes the run met.
    shapes = warmup.read_record(os.path.join(run_dir, warmup.RECORD_FILE))
    assert {"prefill", "generate"} <= set(shapes) and shapes["generate"]
    phase = os.path.join(run_dir, "archive", "phase-001")
    assert os.path.exists(os.path.join(phase, "accepted.json"))
    # Finished runs stay finished: a rerun does no work.
    again = run_main(small_run_flags(run_dir, tiny_model_dir))
    assert again.returncode == 0 and "already finished" in again.stdout
    assert len(metric_lines(run_dir)) == len(lines)
    assert warmup.read_record(os.path.join(run_dir, warmup.RECORD_FILE)) == shapes  # kept


def test_changed_config_on_resume_is_refused(baseline, tiny_model_dir):
    run_dir, _ = baseline
    refused = run_main(small_run_flags(run_dir, tiny_model_dir, lr=3e-4))
    assert refused.returncode == 2
    assert "another configuration" in refused.stderr and "learning_rate" in refused.stderr
    assert "--allow_config_change" in refused.stderr


def test_kill_9_at_several_points_then_resume(baseline, tiny_model_dir, tmp_path):
    base_dir, _ = baseline
    run_dir = str(tmp_path / "run")
    # The warm-up is off on the CPU by default ("auto"); here each restart warms its record.
    args = small_run_flags(run_dir, tiny_model_dir, engine_warm_up="recorded")
    total = len(metric_lines(base_dir))
    for n in (
        3,
        total // 2,
        total - 3,
    ):  # after the first steps, in the harness phase, near the end
        proc = start(args)
        wait_for_lines(proc, run_dir, n)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The engine's call sizes are operational: the last start changes them and still resumes.
    done = run_main(small_run_flags(run_dir, tiny_model_dir, engine_warm_up="recorded",
                                    engine_steps=4, engine_prefill_batch=2))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from checkpoint" in done.stdout
    assert "4 steps a call, prompt calls of at most 2 rows" in done.stdout, done.stdout[-3000:]
    # The last start warmed what its earlier selves met before it rolled anything out.
    assert re.search(r"engine warm-up: \d+ programs ready", done.stdout), done.stdout[-3000:]
    lines = metric_lines(run_dir)
    assert shape(lines) == shape(metric_lines(base_dir))  # nothing lost, nothing twice
    assert archive_listing(run_dir) == archive_listing(base_dir)
    # The report on demand, over both runs side by side.
    out = tmp_path / "cmp"
    made = subprocess.run([sys.executable, "-m", "whale_jax.loop.report", base_dir, run_dir,
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0, made.stderr
    report = (out / "report.md").read_text()
    assert report.count("| whale/fixed seed 0 (run) | 4 | WHW |") == 2
    assert (out / "mean_at_k.png").stat().st_size > 0 and (out / "timeline.png").exists()


def test_sigterm_saves_and_the_rerun_finishes(tiny_model_dir, tmp_path):
    """One long weight phase without periodic saves: SIGTERM after the first step stops before the
    next one, saves (the last save's duration fits the grace) and exits 143; the rerun resumes
    from that save without dropping or repeating a line."""
    run_dir = str(tmp_path / "run")
    args = small_run_flags(run_dir, tiny_model_dir, weight_epochs=2, eval_every_epochs=0,
                           checkpoint_every_steps=0, checkpoint_every_minutes=0,
                           preemption_grace_s=600)  # fmt: skip
    proc = start(args)
    wait_for_lines(proc, run_dir, 3)  # start, eval, rsft 1
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "preempted: saved checkpoint" in out
    stopped_at = [x["step"] for x in metric_lines(run_dir) if x["kind"] == "rsft"]
    assert 1 <= len(stopped_at) < 4
    done = run_main(args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        f"step {stopped_at[-1]}," in done.stdout
        and "0 metric lines after it dropped" in done.stdout
    )
    lines = metric_lines(run_dir)
    assert [x["step"] for x in lines if x["kind"] == "rsft"] == [1, 2, 3, 4]
    assert [x["kind"] for x in lines].count("start") == 1


@pytest.mark.parametrize(
    ("overrides", "phases", "steps"),
    [
        ({"method": "weight-only"}, ["weight"], 4),
        ({"method": "harness-only"}, ["harness"], 0),
        ({"method": "stagewise", "harness_budget": 3}, ["weight", "harness"], 4),
        ({"method": "fast-slow"}, ["weight", "harness", "weight"], 4),
        ({"schedule": "adaptive", "adaptive_window": 0.5, "adaptive_burn_in": 0.5,
          "adaptive_patience": 0.5, "search_min_proposals": 1, "search_patience": 1,
          "search_max_proposals": 2}, ["weight", "harness", "weight"], 4),
    ],
)  # fmt: skip
def test_every_method_runs_its_phase_sequence(tiny_model_dir, tmp_path, overrides, phases, steps):
    run_dir = str(tmp_path / "run")
    run_in_process(small_run_flags(run_dir, tiny_model_dir, report="false", **overrides))
    lines = metric_lines(run_dir)
    assert [x["phase_kind"] for x in lines if x["kind"] == "phase_end"] == phases
    assert len([x for x in lines if x["kind"] == "rsft"]) == steps
    cost = lines[-1]["cost"]
    assert (cost["weight_episodes"] > 0) == (steps > 0)
    assert (cost["harness_episodes"] > 0) == ("harness" in phases)
    if overrides.get("method") == "fast-slow":
        meta = json.load(open(os.path.join(run_dir, "archive", "phase-001", "phase.json")))
        assert meta["config"]["prompt_only"] is True
    if overrides.get("method") in ("stagewise", "harness-only"):
        meta = json.load(open(os.path.join(run_dir, "archive", "phase-001", "phase.json")))
        # --harness_budget, or by default one WHALE phase's worth: 1 x (I - 1) + 1
        assert meta["config"]["iterations"] == overrides.get("harness_budget", 2)
    if overrides.get("method") == "stagewise":
        # Evaluated along the search: the frontier's top after iteration 1 (the incoming
        # harness) and again whenever a later iteration changed it.
        along = [x for x in lines if x["kind"] == "eval" and x["reason"] == "search"]
        assert along and along[0]["iteration"] == 1 and along[0]["step"] == 4
        assert len({x["harness"] for x in along}) == len(along)
        assert [x["iteration"] for x in along] == sorted(x["iteration"] for x in along)


# The run as `python -m whale_jax.main`, with the mapping guard (whale_jax/compiled.py) made to
# drop every compiled program at each of its checks, as a CPU process near vm.max_map_count would.
_ALWAYS_DROP = """
import sys
from absl import app
import whale_jax.loop.build as build
from whale_jax import main
from whale_jax.compiled import MappingGuard

class AlwaysDrop(MappingGuard):
    def check(self):
        self.trigger = -1
        return super().check()

build.MappingGuard = AlwaysDrop
sys.argv = ["whale_jax.main", *sys.argv[1:]]
app.run(main.main)
"""


def test_dropping_compiled_programs_mid_run_changes_no_result(baseline, tiny_model_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, "-c", _ALWAYS_DROP, *small_run_flags(run_dir, tiny_model_dir)]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("dropped jax's compiled programs") >= 4 + 3  # each step, phase end
    ours, theirs = metric_lines(run_dir), metric_lines(baseline[0])
    assert shape(ours) == shape(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if a["kind"] in ("eval", "rsft"):
            for key in ("test", "validation", "loss", "kept", "mean_reward"):
                assert a.get(key) == b.get(key), (a["kind"], a["step"], key)


def test_the_trained_weights_export_as_an_hf_checkpoint(tiny_model_dir, tmp_path):
    import numpy as np
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import assert_close_to_scale
    from whale_jax.export import ExportError, export

    # Four RSFT steps that train every episode (a random model earns no reward to keep).
    run_dir = str(tmp_path / "run")
    run_in_process(small_run_flags(run_dir, tiny_model_dir, method="weight-only",
                                   reward_threshold=-1))  # fmt: skip
    out = tmp_path / "hf"
    wrote = export(run_dir, str(out), which="last", log=lambda s: None)
    assert wrote["step"] == 4 and (out / "config.json").exists()
    # The trained weights: the checkpoint's, not the base model's.
    exported = load_file(out / "model.safetensors")
    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert exported.keys() == base.keys()
    moved = [k for k in base if not np.array_equal(exported[k], base[k])]
    assert moved, "no weight differs from the base model's"
    # transformers loads the directory, tokenizer included, and its logits are ours on the
    # exported weights: fp32 both ways, reordered sums, 1e-4 of the logits' scale.
    from whale_jax import load_model

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("What is 12 + 30? Answer: 42")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(load_model(str(out)).model(np.asarray([ids], np.int32)))
    assert_close_to_scale(ours, theirs, 1e-4, "exported logits")
    # The validation-best checkpoint is the other choice: here the best validation score is the
    # start's (a random model scores 0 throughout), which no checkpoint holds.
    with pytest.raises(ExportError, match="no validation-best checkpoint"):
        export(run_dir, str(tmp_path / "best"), which="best", log=lambda s: None)
    assert not (tmp_path / "best").exists()
    # A used --out is refused, not mixed.
    with pytest.raises(ExportError, match="--out="):
        export(run_dir, str(out), log=lambda s: None)


def test_export_names_a_bad_run_dir_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "whale_jax.export", f"--run_dir={tmp_path}",
                           f"--out={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"--run_dir={tmp_path}: no config.json" in done.stderr
    assert not (tmp_path / "out").exists()
