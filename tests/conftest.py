import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent

# Tests run on the host CPU; keep XLA from grabbing both cores per test-process thread pool.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Run on an accelerator instead (JAX_PLATFORMS=cuda or tpu), the tolerances below still hold
# only for fp32 products computed in fp32, which a GPU (TF32) or TPU (bf16 passes) does not do
# at default precision: ask for it. The CPU computes fp32 products in fp32 either way.
if os.environ["JAX_PLATFORMS"] != "cpu":
    import jax  # (a pytest plugin may have imported it before this file: set it in its config)

    jax.config.update(
        "jax_default_matmul_precision", os.environ.get("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    )

# The suite's models are tiny: its time goes to XLA compiling thousands of programs, not to running
# them. Without LLVM's optimisation passes the CPU compiles them in about 60 % of the time (a
# prefix-cache test: 33 s -> 20 s on 2 cores). Every comparison a test makes is between programs
# compiled under the same flags, with tolerances from the arithmetic. Processes a test starts get
# the flags through the environment (``xla_flags``).
FAST_COMPILE = "--xla_backend_optimization_level=0" if os.environ["JAX_PLATFORMS"] == "cpu" else ""
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def xla_flags(*more: str) -> str:
    """XLA_FLAGS for a process a test starts: the suite's, and ``more``."""
    return " ".join([FAST_COMPILE, *more]).strip()


# -- compiled programs ---------------------------------------------------------------------------
# The suite compiles thousands of XLA programs in one process; without dropping them it passes
# Linux's vm.max_map_count and XLA segfaults (CI did, ~98 % through). See whale_jax/compiled.py.
from whale_jax.compiled import MappingGuard  # noqa: E402 (after JAX_PLATFORMS is set)
from whale_jax.models.config import tiny_qwen3_5_hf  # noqa: E402

_guard = MappingGuard()


@pytest.fixture(autouse=True)
def _keep_under_the_mapping_limit():
    yield
    _guard.check()


def run_on_devices(
    script: str, devices: int = 8, timeout: float = 400
) -> subprocess.CompletedProcess:
    """``python -c script`` from the repository root on ``devices`` simulated CPU devices; it must
    exit 0."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
               JAX_PLATFORMS="cpu")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A checkpoint directory of the random tiny SmolLM2-shaped model (TINY_SMOLLM2_HF) with
    SmolLM2's real tokenizer and chat template: whole programs (the loop, the server) in seconds."""
    import json

    from whale_jax.io.gguf import find_smollm2_gguf
    from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf
    from whale_jax.io.load import random_model
    from whale_jax.io.safetensors import save_hf
    from whale_jax.models.config import TINY_SMOLLM2_HF, ModelConfig

    out = tmp_path_factory.mktemp("tiny_smol")
    model = random_model(ModelConfig.from_hf(TINY_SMOLLM2_HF), seed=0)
    save_hf(model, out, TINY_SMOLLM2_HF)
    tokenizer_from_gguf(find_smollm2_gguf()).save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(TINY_SMOLLM2_HF))
    return str(out)


# A small Qwen3.5 text config with mixed layers and grouped value heads (Hv > Hk), as HF keys.
tiny_hf_config = tiny_qwen3_5_hf


# -- tolerances ----------------------------------------------------------------------------------
# Float results computed along two paths (or on two CPUs with different vector widths) differ by
# reordered rounding: a sum of n terms errs by about eps * sqrt(n), at most eps * n, times its
# largest term, and a model's layers add their errors up. Tolerances are therefore relative to the
# largest magnitude of the reference, never absolute numbers tuned to one machine.
EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
EPS_BF16 = float(2.0**-7)  # 7.8e-3: 8 significant bits
# Two fp32 computations of one quantity through several layers (blocked vs one-block attention,
# chunked vs recurrent delta rule, cached vs uncached forward, scanned vs unrolled layers, sharded
# vs single device) differ by 2e-7..4e-6 of its largest magnitude on the development machine and
# by up to 1.3e-5 on an AMD EPYC (issue 9): up to ~100 eps, from sums over tens to hundreds of
# terms in each layer. 1e-4 (~840 eps) leaves 8x over the worst seen, while a mask, position or
# state bug moves results by 1e-2..1 of their scale.
PATHS_REL = 1e-4


def assert_close_to_scale(actual, desired, rel: float, what: str = "") -> None:
    """max |actual - desired| <= rel * max |desired| (fp64 arithmetic)."""
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, (what, actual.shape, desired.shape)
    scale = float(np.abs(desired).max()) if desired.size else 0.0
    err = float(np.abs(actual - desired).max()) if desired.size else 0.0
    assert err <= rel * scale, (
        f"{what}: max |error| {err:.3g} > {rel:.3g} x max |reference| {scale:.3g} "
        f"(error / scale = {err / scale if scale else float('inf'):.3g})"
    )


def assert_trees_close_to_scale(actual, desired, rel: float) -> None:
    """``assert_close_to_scale`` leaf by leaf: each array against its own largest magnitude."""
    import jax

    paths = jax.tree_util.tree_leaves_with_path(desired)
    leaves = jax.tree.leaves(actual)
    assert len(leaves) == len(paths)
    for (path, b), a in zip(paths, leaves, strict=True):
        assert_close_to_scale(a, b, rel, jax.tree_util.keystr(path))


# -- order ---------------------------------------------------------------------------------------
# `make test` splits the suite over two processes (pytest-xdist): the longest files come first, so
# none of them is left to run alone at the end.
_LONGEST_FIRST = (
    "tests/loop/test_e2e.py",
    "tests/train/test_trainer.py",
    "tests/loop/test_hosts.py",
    "tests/loop/test_run.py",
    "tests/loop/test_mirror.py",
    "tests/models/test_attention.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
