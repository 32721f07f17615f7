"""One engine per local device (``EnginePool``) on 4 simulated CPU devices (each engine compiles
its own programs, so 8 would double the time and test nothing more): the tokens of one
engine, greedy and sampled, first turns and continued sessions (a parked state, the prefix cache)
alike; work spread over the devices; new weights from a sharded trainer reach every device."""

from __future__ import annotations

import textwrap

from tests.conftest import run_on_devices

POOL_SCRIPT = textwrap.dedent(
    """
    import jax
    from whale_jax import load_model
    from whale_jax.engine import Engine, EngineConfig, Request, Sampling
    from whale_jax.engine.pool import EnginePool
    from whale_jax.sharding import make_mesh
    assert jax.local_device_count() == 4, jax.devices()
    path = "tests/fixtures/tiny_qwen3_5"
    model = load_model(path).model
    config = EngineConfig(slots=16, max_len=96, steps=4, cache_rows=16)

    def first_turns():
        out = []
        for i in range(12):
            # Long enough that a finished turn is worth parking (EngineConfig.min_kept_tokens).
            prompt = tuple(int(x) for x in (5 + i, 9, 200, 31, 7 + i % 3, 11) * 4)
            greedy = i % 3 == 0
            sampling = Sampling(temperature=0.0 if greedy else 1.0, top_k=0 if greedy else 20,
                                max_new_tokens=6)
            out.append(Request(prompt_ids=prompt, identity=(i,), sampling=sampling,
                               park=f"session-{i}"))
        return out

    def second_turns(requests, completions):
        # Each session's next turn: its prompt and reply so far, then a new message.
        return [Request(prompt_ids=r.prompt_ids + c.token_ids + (17, 23, 4), identity=(i, 2),
                        sampling=r.sampling, park=r.park)
                for i, (r, c) in enumerate(zip(requests, completions))]

    def run(engine):
        reqs = first_turns()
        one = engine.generate(reqs)
        two = engine.generate(second_turns(reqs, one))
        return [c.token_ids for c in one], [c.token_ids for c in two], engine.cache_stats()

    single = Engine(model, config, eos_ids=())
    want_one, want_two, single_stats = run(single)
    single.close()
    pool = EnginePool(model, config, jax.local_devices(), eos_ids=())
    assert [len(e.device.state.count) for e in pool.engines] == [4] * 4  # 16 slots over 4
    # Engines sharing XLA:CPU read each call as it ends (the pipeline deadlocked it there).
    assert not any(e.config.pipeline for e in pool.engines)
    # ... and take turns (one lock for all): running at once they hung now and then.
    assert len({id(e.device_lock) for e in pool.engines}) == 1
    got_one, got_two, stats = run(pool)
    assert got_one == want_one, (got_one, want_one)
    assert got_two == want_two, (got_two, want_two)
    # The second turns continued their sessions' parked states on the engine that kept them.
    assert stats["cached_tokens"] == single_stats["cached_tokens"] > 0, (stats, single_stats)
    busy = [e.stats["admitted"] for e in pool.engines]
    assert sum(busy) == 24 and all(b > 0 for b in busy), busy
    homes = {d for e in pool.engines for a in jax.tree.leaves(e.device.params)
             for d in a.sharding.device_set}
    assert all(len({d for a in jax.tree.leaves(e.device.params) for d in a.sharding.device_set})
               == 1 for e in pool.engines)
    assert len(homes) == 4  # a copy of the weights on each device
    # The trainer's weights, FSDP/TP-sharded over the same 4 devices, reach every engine.
    trained = load_model(path, mesh=make_mesh(data=1, fsdp=2, tp=2)).model
    assert pool.set_params(trained) == 1 and pool.weights_version == 1
    again = [c.token_ids for c in pool.generate(first_turns())]
    assert again == want_one, (again, want_one)
    pool.close()
    print("POOL OK")
    """
)


def test_one_engine_per_device_samples_what_one_engine_does():
    assert "POOL OK" in run_on_devices(POOL_SCRIPT, devices=4).stdout
