"""A small WHALE run that really trains and really searches: SmolLM2-135M-Instruct (the bundled
GGUF) on generated addition, starting from a few-shot harness it partly solves, the offline
proposer; weight phase, harness phase, weight phase."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from whale_jax.loop import config as cfg
from whale_jax.loop.metrics import read_metrics
from whale_jax.loop.run import run
from whale_jax.train.rsft import RSFTConfig
from whale_jax.train.trainer import OptimConfig, TrainConfig

HERE = Path(__file__).resolve().parent


# The whole loop compiles the engine's and the trainer's programs and runs four evaluations, two
# RSFT steps and a search on a 135M model: 220-270 s of a 2-core machine, the suite's longest.
# Slow (`make test-all`): faster tests cover each part with the tiny model, the loop
# (tests/loop/test_run.py::test_a_whole_run: W H W, the search, its archive, the report), verified
# episodes kept, trained and published to the engine (tests/train/test_rsft.py, the two-host run
# in tests/loop/test_hosts.py), and the seed harnesses with SmolLM2 itself
# (tests/harness/test_seeds_e2e.py); the demo runs this model through the loop for real.
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_whale_trains_searches_and_reports(tmp_path):
    from harness.search.phase import SearchConfig
    from harness.search.validate import ValidationConfig

    config = cfg.RunConfig(
        run_dir=str(tmp_path / "run"),
        initial_harness=str(HERE / "fewshot_arith.py"),
        data=cfg.DataConfig(train_size=16, search_size=8, validation_size=4, test_size=8),
        model=cfg.ModelSettings(engine_slots=32, max_len=256, max_new_tokens=8),
        rsft=RSFTConfig(prompt_batch=8, samples=4, minibatch_episodes=16),
        train=TrainConfig(optim=OptimConfig(learning_rate=1e-5), seq_len=128, micro_tokens=2048,
                          remat=False),  # fmt: skip
        search=SearchConfig(slots=1, validation=ValidationConfig(audit_tasks=1)),
        schedule=cfg.ScheduleConfig(epochs=1, weight_epochs=0.5, harness_iterations=2),
        eval=cfg.EvalConfig(samples=2, every_epochs=0),
        checkpoint=cfg.CheckpointConfig(keep=1, every_minutes=0),
        progress=False,
    )  # fmt: skip
    cfg.validate(config)
    summary = run(config, log=lambda s: None)
    lines = read_metrics(os.path.join(config.run_dir, "metrics.jsonl"))
    steps = [x for x in lines if x["kind"] == "rsft"]
    assert [x["step"] for x in steps] == [1, 2]
    assert sum(x["kept"] for x in steps) > 0, "the few-shot harness should solve some tasks"
    assert max(x["weights_version"] for x in steps) >= 1, "the engine got trained weights"
    assert any(x["updates"] for x in steps) and all(
        x["loss"] is None or x["loss"] > 0 for x in steps
    )
    phase = Path(config.run_dir) / "archive" / "phase-001"
    scored = [d for d in (phase / "candidates").iterdir() if (d / "summary.json").exists()]
    proposed = [d for d in (phase / "candidates").iterdir() if "incoming" not in d.name]
    assert proposed, "the proposer made a candidate"
    assert len(scored) + sum((d / "invalid.json").exists() for d in proposed) == len(
        list((phase / "candidates").iterdir())
    )
    accepted = json.loads((phase / "accepted.json").read_text())
    (line,) = [x for x in lines if x["kind"] == "harness_phase"]
    if "incoming" in accepted["name"]:
        assert line["vs_incoming"] is None and line["accepted"] == "fewshot_arith"
    else:
        assert line["vs_incoming"]["n"] == 8 and line["accepted"].endswith(accepted["name"])
    assert summary["steps"] == 2 and summary["phases"] == ["weight", "harness", "weight"]
    assert os.path.exists(summary["report"])
    report = Path(summary["report"]).read_text()
    assert "Harness lineage" in report and "phase-001" in report
