"""The sharding table on a simulated 8-device CPU mesh: sharded forward == single-device forward."""

import textwrap

from jax.sharding import PartitionSpec

from tests.conftest import run_on_devices
from whale_jax.sharding import logical_spec

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from whale_jax import load_model
    from whale_jax.models.transformer import Jitted
    from whale_jax.sharding import batch_sharding, make_mesh
    assert jax.device_count() == 8, jax.devices()
    path = "tests/fixtures/tiny_qwen3_5"
    ref = np.load(path + "/reference.npz")
    tokens = np.concatenate([ref["input_ids"]] * 4)  # batch 8: two rows per data x fsdp shard
    single = Jitted(load_model(path).model)(tokens)
    mesh = make_mesh(data=2, fsdp=2, tp=2)
    model = load_model(path, mesh=mesh).model
    specs = {tuple(v.get_value().sharding.spec) for v in [model.embed, model.blocks.b1.attn.q_proj,
             model.blocks.b0.mlp.down_proj, model.blocks.b0.gdn.in_proj_z]}
    print("SPECS", sorted(map(str, specs)))
    assert len(model.embed.get_value().sharding.device_set) == 8
    sharded = Jitted(model)(jax.device_put(jnp.asarray(tokens), batch_sharding(mesh)))
    err = float(np.abs(np.asarray(sharded) - np.asarray(single)).max() / np.abs(single).max())
    print("MAXERR", err)
    # Reduction order differs across shards: 4e-6 of the logits' scale measured (tests/conftest.py
    # PATHS_REL explains 1e-4); a wrong layout or a missing all-reduce is off by O(1).
    assert err < 1e-4, err

    # The gated delta rule with its heads split over tp (a GDN layer's layout on a tp mesh): each
    # device scans its own heads, nothing is gathered, and the result equals one device's.
    from jax.sharding import NamedSharding, PartitionSpec as P
    from whale_jax.models.gated_delta import chunked_gated_delta_rule
    rng = np.random.default_rng(0)
    B, T, H, K = 2, 100, 8, 16
    xs = [rng.standard_normal(s).astype(np.float32) for s in [(B, T, H, K)] * 3 + [(B, T, H)] * 2]
    xs[0] /= np.linalg.norm(xs[0], axis=-1, keepdims=True)
    xs[1] /= np.linalg.norm(xs[1], axis=-1, keepdims=True)
    xs[3], xs[4] = -np.abs(xs[3]) * 0.1, 1 / (1 + np.exp(-xs[4]))
    tp = make_mesh(data=1, fsdp=1, tp=8)
    heads = [P(None, None, "tp", None)] * 3 + [P(None, None, "tp")] * 2
    split = [jax.device_put(x, NamedSharding(tp, s)) for x, s in zip(xs, heads)]
    f = jax.jit(lambda *a: chunked_gated_delta_rule(*a, chunk_size=32))
    (o1, s1), (o8, s8) = f(*xs), f(*split)
    assert o8.sharding.spec == P(None, None, "tp", None), o8.sharding
    hlo = f.lower(*split).compile().as_text()
    assert "all-gather" not in hlo and "f32[2,1,32,16]" in hlo  # one head per device
    # Relative to each result's scale: the per-head arithmetic is the same (exact here), but a
    # different shape may vectorise the reductions differently on another CPU.
    gdn_err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                  for a, b in [(o8, o1), (s8, s1)])
    print("GDN_SPLIT_ERR", gdn_err)
    assert gdn_err < 1e-4, gdn_err
    """
)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from whale_jax import load_model
    from whale_jax.engine import Engine, EngineConfig, Request, Sampling
    from whale_jax.sharding import make_mesh
    assert jax.device_count() == 8, jax.devices()
    path = "tests/fixtures/tiny_qwen3_5"
    engine = Engine(load_model(path).model, EngineConfig(slots=2, max_len=64, steps=4), eos_ids=())
    reqs = [Request(prompt_ids=(5, 9, 200, 31, 7), identity=(i,),
                    sampling=Sampling(temperature=1.0, top_k=20, max_new_tokens=6))
            for i in range(3)]
    from whale_jax.engine import device
    before = [o.token_ids for o in engine.generate(reqs)]
    assert [o.token_ids for o in engine.generate(reqs)] == before  # every shape compiled now
    steps = (device._prefill_placed, device._insert_stored, device._generate)
    compiled = [f._cache_size() for f in steps]
    assert min(compiled) > 0, compiled  # the steps the engine runs (the repeats: from the store)
    # The trainer's copy of the same weights, FSDP/TP-sharded over 8 devices.
    trained = load_model(path, mesh=make_mesh(data=2, fsdp=2, tp=2)).model
    assert len(trained.blocks.b0.mlp.up_proj.get_value().sharding.device_set) > 1
    engine.set_params(trained)
    leaves = jax.tree.leaves(engine.device.params)
    assert all(len(a.sharding.device_set) == 1 for a in leaves)  # resharded into the engine's
    after = [o.token_ids for o in engine.generate(reqs)]
    assert after == before, (before, after)
    now = [f._cache_size() for f in steps]
    assert now == compiled, (compiled, now)  # jit caches hold no new executable
    print("RESHARDED OK")
    """
)


def test_engine_takes_weights_from_a_sharded_trainer():
    """set_params with FSDP/TP-sharded weights: moved device to device into the engine's layout,
    same samples, no recompilation."""
    assert "RESHARDED OK" in run_on_devices(ENGINE_SCRIPT).stdout


def test_sharded_forward_equals_single_device():
    proc = run_on_devices(SCRIPT)
    assert "MAXERR" in proc.stdout and "GDN_SPLIT_ERR" in proc.stdout
    # Heads / MLP on tp, the model dimension on fsdp.
    assert "(None, 'fsdp', 'tp', None)" in proc.stdout


class FakeMesh:
    def __init__(self, **shape):
        self.shape = shape


def test_logical_spec_uses_divisible_axes_once():
    mesh = FakeMesh(data=2, fsdp=4, tp=2)
    assert logical_spec((64, 8), ("embed", "heads"), mesh) == PartitionSpec("fsdp", "tp")
    # 6 is not divisible by fsdp=4: replicate that dim rather than fail.
    assert logical_spec((6, 8), ("embed", "mlp"), mesh) == PartitionSpec(None, "tp")
    # Batches go over data x fsdp together.
    assert logical_spec((16, 5), ("batch", None), mesh) == PartitionSpec(("data", "fsdp"), None)
    # A mesh axis is never used twice in one spec.
    assert logical_spec((8, 8), ("mlp", "heads"), mesh) == PartitionSpec("tp", None)
