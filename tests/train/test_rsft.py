"""One RSFT step end to end: the executor runs the harness, rewards select, the trainer updates,
the engine gets the weights; the data cursor is deterministic and resumable."""

import jax
import numpy as np
import pytest

import whale_jax
from harness.backends import ScriptedBackend
from harness.domains.arith import ArithDomain, generate
from harness.executor import Executor, ExecutorConfig
from tests.harness.conftest import TEST_BUDGETS, TEST_LIMITS, add_numbers
from whale_jax.engine import Engine, EngineConfig
from whale_jax.train import DataCursor, RSFTConfig, TrainConfig, Trainer, rsft_step


@pytest.fixture(scope="module")
def parts(fixtures_dir):
    # The tiny Qwen3.5's 320 ids cover the scripted backend's byte tokenizer (bytes + 3 specials).
    model, _, _ = whale_jax.load_model(fixtures_dir / "tiny_qwen3_5")
    engine = Engine(model, EngineConfig(slots=2, max_len=32), eos_ids=())
    yield model, engine
    engine.close()


def run_step(parts, respond, step=1):
    model, engine = parts
    domain = ArithDomain()
    config = ExecutorConfig(concurrency=8, budgets=TEST_BUDGETS, limits=TEST_LIMITS)
    trainer = Trainer(model, TrainConfig(seq_len=256, micro_tokens=512))
    before = jax.tree.map(np.asarray, trainer.params)
    with Executor(ScriptedBackend(respond), config) as executor:
        metrics, records = rsft_step(
            step,
            tasks=generate(10, seed=5),
            cursor=DataCursor(seed=3),
            source=domain.seed_harness(),
            domain=domain,
            executor=executor,
            trainer=trainer,
            engine=engine,
            config=RSFTConfig(prompt_batch=4, samples=2, minibatch_episodes=3),
        )
    changed = not all(
        jax.tree.leaves(
            jax.tree.map(np.array_equal, before, jax.tree.map(np.asarray, trainer.params))
        )
    )
    return metrics, records, changed


def test_step_keeps_correct_episodes_trains_and_publishes(parts):
    version = parts[1].weights_version
    metrics, records, changed = run_step(parts, add_numbers)
    assert len(records) == 8 and metrics["episodes"] == 8 and metrics["kept"] == 8
    assert metrics["accept_rate"] == 1.0 and metrics["mean_reward"] == 1.0
    assert metrics["updates"] == 3  # minibatches of 3, 3 and 2 episodes
    sampled = sum(len(c.completion_ids) for r in records for c in r.calls)
    assert metrics["trained_tokens"] == sampled and metrics["rows"] == 8
    assert changed and metrics["weights_version"] == version + 1 == parts[1].weights_version
    assert {r.calls[0].settings["max_new_tokens"] for r in records} == {12}  # h0's own setting
    for key in ("rollout_s", "scoring_s", "train_s", "sync_s", "loss", "grad_norm"):
        assert metrics[key] is not None and metrics[key] >= 0


def test_nothing_kept_means_no_update(parts):
    version = parts[1].weights_version
    metrics, records, changed = run_step(parts, lambda request: "7", step=2)
    assert metrics["kept"] == 0 and metrics["updates"] == 0 and metrics["trained_tokens"] == 0
    assert "no update" in metrics["note"]
    assert not changed and parts[1].weights_version == version
    assert metrics["stop_reasons"] == {"answered": 8}


def test_data_cursor_order_is_fixed_by_seed_and_resumes():
    tasks = generate(7, seed=1)
    a = DataCursor(seed=4)
    first = [t.id for t in a.take(tasks, 5)]
    second = [t.id for t in a.take(tasks, 5)]  # crosses into epoch 1 with a new order
    assert a.epoch == 1 and a.position == 3
    assert sorted(first + second[:2]) == sorted(t.id for t in tasks)
    assert first == [t.id for t in DataCursor(seed=4).take(tasks, 5)]
    assert first != [t.id for t in DataCursor(seed=5).take(tasks, 5)]
    resumed = DataCursor.from_dict(a.to_dict())
    assert [t.id for t in resumed.take(tasks, 4)] == [t.id for t in a.take(tasks, 4)]
    with pytest.raises(ValueError, match="empty"):
        DataCursor(seed=0).take([], 1)
