"""The SFT update: packed == bucketed, sharded == single device, non-finite steps change nothing,
learning raises the trained tokens' probability and the engine then samples from the new weights."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import whale_jax
from tests.conftest import run_on_devices
from tests.engine.conftest import assert_greedy
from whale_jax.engine import GREEDY, Engine, EngineConfig, Request
from whale_jax.train.rows import Row
from whale_jax.train.trainer import OptimConfig, TrainConfig, Trainer


def rows_for(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = tuple(int(x) for x in rng.integers(0, vocab, n))
        mask = tuple(bool(j >= n // 2) for j in range(n))
        out.append(Row(ids=ids, mask=mask, episode=i, task_id=f"t{i}", session_id=f"s{i}"))
    return out


def max_rel(a, b):
    """Largest difference over all leaves, relative to the largest magnitude in ``b``."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    diffs = [float(jnp.abs(x - y).max()) for x, y in pairs]
    scale = max(float(jnp.abs(y).max()) for y in jax.tree.leaves(b))
    return max(diffs) / scale


@pytest.fixture(scope="module")
def tiny(fixtures_dir):
    return whale_jax.load_model(fixtures_dir / "tiny_qwen3_5")


def test_packed_equals_bucketed_and_accumulation_equals_one_microbatch(tiny):
    model, cfg, _ = tiny
    rows = rows_for(cfg.vocab_size, [37, 5, 70, 12, 64, 3])
    # A row trained on all but 10 of 120 tokens: the step's loss width (128) exceeds the 64-token
    # bucket, which must then take all its positions.
    ids = tuple(int(x) for x in np.random.default_rng(9).integers(0, cfg.vocab_size, 120))
    rows.append(Row(ids=ids, mask=(False,) * 10 + (True,) * 110, episode=6, task_id="t6",
                    session_id="s6"))  # fmt: skip
    results = {}
    for name, config in {
        "packed": TrainConfig(seq_len=128, micro_tokens=128),  # 2 sequences, 2 microbatches
        "one_micro": TrainConfig(seq_len=128, micro_tokens=1024),
        "bucketed": TrainConfig(seq_len=128, micro_tokens=256, pack=False, remat=False),
    }.items():
        trainer = Trainer(model, config)
        results[name] = trainer.loss_and_grad(rows)
        if name == "packed":
            assert trainer.compile_counts["accumulate"] == 1
    loss, grads = results["one_micro"]
    for other in ("packed", "bucketed"):
        # Reordered fp32 sums over ~100 tokens: relative to the largest gradient entry.
        assert results[other][0] == pytest.approx(loss, rel=1e-5)
        assert max_rel(results[other][1], grads) < 1e-4


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3, 0.0])  # clipping on, not reached, off
def test_update_is_optax_clip_then_adamw(tiny, max_grad_norm):
    """The apply step fuses clipping, the token mean and AdamW into one pass; two steps of it must
    equal optax's chain (clip_by_global_norm, adamw) applied to loss_and_grad's gradient."""
    import optax

    model, cfg, _ = tiny
    # eps near the clipped gradient's entries: AdamW's step then depends on the gradient's scale,
    # so a clip or a token mean left out changes the weights by a large part of the step.
    optim = OptimConfig(learning_rate=1e-2, weight_decay=0.1, warmup_steps=1, eps=1e-5,
                        max_grad_norm=max_grad_norm)  # fmt: skip
    trainer = Trainer(model, TrainConfig(optim=optim, seq_len=64, micro_tokens=128))
    params = jax.tree.map(jnp.array, trainer.params)
    opt_state = trainer.tx.init(params)
    for seed in (0, 1):  # the second step runs at the schedule's full rate, on moved moments
        rows = rows_for(cfg.vocab_size, [30, 18], seed=seed)
        _, grads = trainer.loss_and_grad(rows)
        norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
        m = trainer.update(rows)
        assert m.applied and m.grad_norm == pytest.approx(norm, rel=1e-5)
        updates, opt_state = trainer.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # AdamW's step is lr * m / (sqrt(v) + eps) ~ lr per entry: compare the weights' change.
        moved = jax.tree.map(lambda a, b: a - b, trainer.params, params)
        assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(moved)) < 1e-2 * 1e-3
    if max_grad_norm == 1e-3:
        assert norm > 1e-3  # the clip really acted


def test_non_finite_loss_changes_nothing(tiny):
    model, cfg, _ = tiny
    trainer = Trainer(model, TrainConfig(seq_len=64, micro_tokens=64))
    rows = rows_for(cfg.vocab_size, [20, 9])
    ok = trainer.update(rows)
    assert ok.applied and trainer.step == 1
    poisoned = jax.tree.map(lambda a: a, trainer.params)
    poisoned["embed"].set_value(poisoned["embed"].get_value().at[0, 0].set(jnp.inf))
    trainer.params = poisoned
    before = jax.tree.map(np.asarray, (trainer.params, trainer.opt_state))
    bad = trainer.update(rows)
    assert not bad.applied and not np.isfinite(bad.loss) and trainer.step == 1
    after = jax.tree.map(np.asarray, (trainer.params, trainer.opt_state))
    same = jax.tree.map(lambda x, y: np.array_equal(x, y, equal_nan=True), before, after)
    assert all(jax.tree.leaves(same))


def test_no_trained_tokens_no_update(tiny):
    model, cfg, _ = tiny
    trainer = Trainer(model, TrainConfig(seq_len=64, micro_tokens=64))
    before = jax.tree.map(np.asarray, trainer.params)
    untrained = [Row(ids=(1, 2, 3), mask=(False,) * 3, episode=0, task_id="t", session_id="s")]
    for rows in ([], untrained):
        m = trainer.update(rows)
        assert not m.applied and m.trained_tokens == 0 and trainer.step == 0
    after = jax.tree.map(np.asarray, trainer.params)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))


def test_bf16_compute_keeps_fp32_masters(tiny):
    model, cfg, _ = tiny
    rows = rows_for(cfg.vocab_size, [30, 18])
    loss32, _ = Trainer(model, TrainConfig(seq_len=64, micro_tokens=128)).loss_and_grad(rows)
    trainer = Trainer(model, TrainConfig(seq_len=64, micro_tokens=128, compute_dtype="bfloat16"))
    loss16, _ = trainer.loss_and_grad(rows)
    # bf16 keeps 8 mantissa bits (relative 2^-8 per rounding); the NLL of ~6 nats moves ~1%.
    assert loss16 == pytest.approx(loss32, rel=3e-2)
    assert loss16 != loss32  # the compute really ran in bf16
    assert {a.dtype for a in jax.tree.leaves(trainer.params)} == {jnp.dtype(jnp.float32)}
    assert trainer.update(rows).applied
    assert {a.dtype for a in jax.tree.leaves(trainer.params)} == {jnp.dtype(jnp.float32)}


def test_learning_raises_log_probability_and_the_engine_samples_the_new_weights(fixtures_dir):
    model, cfg, _ = whale_jax.load_model(fixtures_dir / "tiny_llama")
    prompt = (5, 17, 42, 99, 7)
    target = (200, 13, 77, 150, 31, 9)  # the accepted episode's completion
    row = Row(
        ids=prompt + target,
        mask=(False,) * len(prompt) + (True,) * len(target),
        episode=0,
        task_id="t",
        session_id="s",
    )
    engine = Engine(model, EngineConfig(slots=2, max_len=32, steps=4), eos_ids=())
    request = Request(prompt_ids=prompt, sampling=GREEDY.__class__(temperature=0.0,
                      max_new_tokens=len(target)))  # fmt: skip
    old = engine.generate([request])[0]
    assert old.weights_version == 0 and old.token_ids != target

    trainer = Trainer(
        model, TrainConfig(optim=OptimConfig(learning_rate=3e-2), seq_len=16, micro_tokens=16)
    )
    losses = [trainer.update([row]).loss for _ in range(12)]
    assert losses[-1] < 0.2 * losses[0]  # the accepted tokens' log-probability went up
    assert all(b < a for a, b in zip(losses[:3], losses[1:4], strict=True))

    assert engine.set_params(trainer.model_state()) == 1
    new = engine.generate([request])[0]
    assert new.weights_version == 1 and new.token_ids == target
    assert_greedy(trainer.model(), [prompt], [new.token_ids])  # the new weights' argmax
    engine.close()


SHARDED = textwrap.dedent(
    """
    import dataclasses, jax, numpy as np
    from whale_jax import load_model
    from whale_jax.sharding import make_mesh
    from whale_jax.train.trainer import Trainer, TrainConfig, OptimConfig
    from whale_jax.train.rows import Row
    assert jax.device_count() == 8
    rng = np.random.default_rng(0)
    rows = []
    for i, n in enumerate([37, 5, 70, 12, 64, 3, 50, 20, 9, 100, 120, 90]):
        ids = tuple(int(x) for x in rng.integers(0, 320, n))
        rows.append(Row(ids=ids, mask=tuple(j >= n // 3 for j in range(n)), episode=i,
                        task_id="t", session_id=str(i)))
    config = TrainConfig(optim=OptimConfig(learning_rate=1e-3), seq_len=128, micro_tokens=256)
    out = {}
    unrolled = dataclasses.replace(config, remat=False)  # layer groups unrolled, no remat
    # The hybrid with its own LM head through the scanned, rematerialised layers, and a dense
    # model whose head is the tied embedding (its gradient is accumulated transposed under the
    # transposed sharding, then laid back) through the unrolled ones: each of the step's two
    # programs, and each kind of head, on every mesh axis. (Each case compiles a whole train step,
    # ~40 s on 2 cores; test_packed_equals_bucketed_... checks the unrolled program against the
    # scanned one on a hybrid.)
    one, eight = make_mesh(devices=jax.devices()[:1]), make_mesh(data=2, fsdp=2, tp=2)
    cases = [("tiny_qwen3_5", "one", one, config),
             ("tiny_qwen3_5", "eight", eight, config),
             ("tiny_qwen3", "one", one, unrolled),
             ("tiny_qwen3", "eight_unrolled", eight, unrolled)]
    for fixture, name, mesh, c in cases:
        model = load_model(f"tests/fixtures/{fixture}").model
        t = Trainer(model, c, mesh)
        loss, grads = t.loss_and_grad(rows)
        m = t.update(rows)
        out[fixture, name] = (loss, jax.tree.map(np.asarray, grads), m, t)
    for fixture, name in [k for k in out if k[1] != "one"]:
        l1, g1, m1, _ = out[fixture, "one"]
        l8, g8, m8, t8 = out[fixture, name]
        name = f"{fixture}/{name}"
        # The update kept the FSDP/TP layout, the (tied) head's included.
        embed = t8.params["embed"].get_value().sharding
        assert embed == t8.shardings["embed"].get_value(), (name, embed.spec)
        spec = t8.params["blocks"]["b0"]["mlp"]["gate_proj"].get_value().sharding.spec
        print("SPEC", name, spec, embed.spec)
        assert tuple(spec) == (None, "fsdp", "tp"), spec
        assert m8.applied and m8.microbatches == 2 and m1.microbatches == 3
        assert m1.trained_tokens == m8.trained_tokens
        # Reordered fp32 sums across shards: the loss to ~1e-6 relative, each gradient entry to
        # a small fraction of the largest one.
        assert abs(l1 - l8) <= 1e-5 * l1, (name, l1, l8)
        scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(g1))
        pairs = zip(jax.tree.leaves(g1), jax.tree.leaves(g8), strict=True)
        diff = max(float(np.abs(a - b).max()) for a, b in pairs)
        print("MAXDIFF", name, diff / scale)
        assert diff <= 1e-4 * scale, (name, diff / scale)

    # FSDP gathers weights, never a batch of activations. Compiled ahead of time (no weights) at
    # widths where XLA, left alone, would rather gather whole [8, 256, ...] activation batches.
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.conftest import tiny_hf_config
    from whale_jax.models.config import ModelConfig
    from whale_jax.io.safetensors import abstract_model
    cfg = ModelConfig.from_hf(tiny_hf_config(hidden_size=256, intermediate_size=768,
        vocab_size=4096, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64))
    mesh = make_mesh(data=1, fsdp=8, tp=1)
    graphdef, abstract = nnx.split(abstract_model(cfg, jax.numpy.float32))
    for remat in (True, False):
        built = {}
        def construct(state):
            built["t"] = Trainer(nnx.merge(graphdef, state), TrainConfig(seq_len=256,
                                 micro_tokens=8 * 256, remat=remat), mesh)
            return built["t"].params
        shapes = jax.eval_shape(construct, abstract)
        t = built["t"]
        typed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             shapes, t.shardings)
        scalar = jax.ShapeDtypeStruct((), np.float32, sharding=NamedSharding(mesh, P()))
        ids = jax.ShapeDtypeStruct((8, 256), np.int32, sharding=t._batch_sharding)
        weight = jax.ShapeDtypeStruct((8, 256), np.float32, sharding=t._batch_sharding)
        hlo = t._accumulate.lower(typed, typed, scalar, ids, ids, ids, weight).compile().as_text()
        gathered = [l.split("=", 1)[1].split("all-gather(")[0].strip() for l in hlo.splitlines()
                    if "all-gather(" in l]
        print("GATHERED", remat, sorted(set(gathered)))
        assert gathered and not [g for g in gathered if g.startswith("f32[8,256,")], gathered
    """
)


def test_sharded_step_equals_single_device_step():
    proc = run_on_devices(SHARDED, timeout=600)
    assert "MAXDIFF" in proc.stdout
