"""The offline model end to end: GGUF weights + GGUF tokenizer + chat template + greedy decoding."""

import subprocess
import sys

from tests.conftest import REPO


def test_smollm2_answers_paris_through_the_cli():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "whale_jax.generate",
            "--model=smollm2",
            "--prompt=What is the capital of France?",
            "--max_new_tokens=16",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout, proc.stdout


def test_cli_names_a_missing_model():
    proc = subprocess.run(
        [sys.executable, "-m", "whale_jax.generate", "--model=no/such-model-dir/x", "--prompt=hi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "no/such-model-dir/x" in proc.stderr
