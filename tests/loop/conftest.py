"""Shared pieces of the loop tests: a tiny random dense model that carries SmolLM2's real tokenizer
and chat template (so the whole program runs, fast), and the flags of a small run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def shared_compile_cache(model: str) -> str:
    """The persistent compilation cache that every run of ``model`` in a session shares. A run's
    own cache (``<run_dir>/compile_cache``, the default) would start empty: each run would compile
    its engine and train steps again (about a third of a small run). Programs are keyed by their
    HLO, so a loaded one is the one this run would have compiled."""
    return model.rstrip("/") + "-compile_cache"


def small_run_flags(run_dir: str, model: str, **overrides) -> list[str]:
    """A whole WHALE run in seconds: W(2 steps) H(2 iterations) W(2 steps) on arith. Pass
    ``compilation_cache_dir=""`` for the run's own cache in place of the shared one."""
    flags = {
        "run_dir": run_dir, "model": model, "domain": "arith", "method": "whale",
        "train_size": 8, "prompt_batch": 4, "samples": 2, "minibatch_episodes": 4,
        "epochs": 2, "weight_epochs": 1, "harness_iterations": 2, "slots": 1, "audit_tasks": 1,
        "search_size": 4, "validation_size": 4, "test_size": 4, "eval_samples": 2,
        "eval_every_epochs": 0.5, "engine_slots": 8, "max_len": 128, "max_new_tokens": 8,
        "seq_len": 128, "micro_tokens": 512, "remat": "false", "lr": 1e-4,
        "checkpoint_every_steps": 1, "checkpoint_keep": 2, "progress": "false",
        "compilation_cache_dir": shared_compile_cache(model),
    }  # fmt: skip
    flags.update(overrides)
    return [f"--{k}={v}" for k, v in flags.items()]


def run_in_process(args: list[str]) -> dict:
    """``python -m whale_jax.main ARGS`` in this process: the flags parsed as the program parses
    them, then the loop (``run``). A program an earlier run here compiled (the same shapes) is
    reused from memory, where a new process would load it from the persistent cache; use it
    where what is tested is the loop, not the process."""
    from absl import flags

    from whale_jax import main as cli
    from whale_jax.loop.run import run

    flags.FLAGS.unparse_flags()
    try:
        cli.parse_flags(["whale_jax.main", *args])
        config = cli.config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()
    return run(config, log=lambda s: None)


def main_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "whale_jax.main", *args]


def run_main(args: list[str], timeout: float = 280) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(main_command(args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def metric_lines(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f.read().splitlines() if x.strip()]
