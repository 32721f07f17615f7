"""Continuous batching: correctness against a full-forward oracle, RNG, stops, bad requests."""

import numpy as np
import pytest

from tests.conftest import EPS_BF16
from tests.engine.conftest import assert_greedy
from whale_jax.engine import Engine, EngineConfig, Request, Sampling

LENGTHS = (3, 17, 5, 30, 9, 1, 12)
N_NEW = (6, 3, 9, 1, 7, 5, 4)
# Sampled tokens are compared exactly only between runs of one engine whose claim is that a
# request's logits do not depend on the rest of the batch (rows are computed independently and
# masked cache positions add exact zeros); an ulp of difference would still flip a Gumbel-max draw
# only at a near-tie, about 1e-6 per token.
SAMPLED = Sampling(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=8)


def letters(ids):
    """A detokenizer for the tiny vocabularies: one letter per id."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


def prompts_for(vocab, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, vocab, n).tolist()) for n in lengths]


@pytest.fixture(scope="module", params=["tiny_qwen3_5", "tiny_llama"])
def setup(request):
    model, cfg, _ = request.getfixturevalue(request.param)
    engine = Engine(
        model,
        # min_kept_tokens=0: every finished state with a park name is parked, however short
        EngineConfig(
            slots=3, max_len=64, steps=4, prefill_batch=4, min_kv_bucket=32, min_kept_tokens=0
        ),
        eos_ids=(),
        detokenize=letters,
    )
    yield model, cfg, engine
    engine.close()


def greedy(n):
    return Sampling(temperature=0.0, max_new_tokens=n)


def test_greedy_matches_full_forward_with_slot_refills(setup):
    model, cfg, engine = setup
    prompts = prompts_for(cfg.vocab_size)
    before = dict(engine.stats)
    outs = engine.generate(
        [Request(prompt_ids=p, sampling=greedy(n)) for p, n in zip(prompts, N_NEW, strict=True)]
    )
    assert [len(o.token_ids) for o in outs] == list(N_NEW)
    assert_greedy(model, prompts, [o.token_ids for o in outs])
    assert all(o.finish_reason == "length" for o in outs)
    # 7 requests through 3 slots: slots were freed and refilled while others were decoding.
    assert engine.stats["prefills"] - before.get("prefills", 0) == len(prompts)


def test_request_samples_the_same_alone_or_among_others(setup):
    _, cfg, engine = setup
    prompts = prompts_for(cfg.vocab_size, seed=1)
    target = Request(prompt_ids=prompts[2], sampling=SAMPLED, identity=(7, "task", 3, 0))
    alone = engine.generate([target])[0]
    others = [Request(prompt_ids=p, sampling=SAMPLED, identity=(7, "other", i, 0))
              for i, p in enumerate(prompts)]  # fmt: skip
    crowded = engine.generate([*others[:4], target, *others[4:]])[4]
    assert alone.token_ids == crowded.token_ids
    assert len(alone.token_ids) == SAMPLED.max_new_tokens
    other_identity = Request(prompt_ids=prompts[2], sampling=SAMPLED, identity=(7, "task", 4, 0))
    assert engine.generate([other_identity])[0].token_ids != alone.token_ids


def test_n_samples_share_one_prefill(setup):
    _, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(11,), seed=2)[0]
    before = engine.stats["prefills"]
    reqs = [Request(prompt_ids=prompt, sampling=SAMPLED, identity=("s", i)) for i in range(3)]
    outs = engine.generate(reqs)
    assert engine.stats["prefills"] - before == 1
    assert len({o.token_ids for o in outs}) == 3  # different identities, different samples
    # Each sample is the one it would have been on its own.
    assert engine.generate([reqs[1]])[0].token_ids == outs[1].token_ids


def test_max_new_tokens_one(setup):
    model, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(5,))[0]
    out = engine.generate([Request(prompt_ids=prompt, sampling=greedy(1))])[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_greedy(model, [prompt], [out.token_ids])


def test_eos_stops_and_frees_the_slot(setup):
    _, cfg, engine = setup
    prompts = prompts_for(cfg.vocab_size, lengths=(4, 6, 8, 5, 7), seed=3)
    # The reference is the same batch without the stop id: until the first request stops, the
    # engine runs the same programs on the same inputs, so its tokens are bit-identical.
    plain = engine.generate([Request(prompt_ids=p, sampling=greedy(6)) for p in prompts])
    ref = list(plain[0].token_ids)
    eos = ref[2]
    sampling = Sampling(temperature=0.0, max_new_tokens=6, stop_ids=(eos,))
    outs = engine.generate([Request(prompt_ids=p, sampling=sampling) for p in prompts])
    first = outs[0]
    assert list(first.token_ids) == ref[: ref.index(eos) + 1]
    assert first.finish_reason == "stop"
    # Five requests through three slots: a stopped slot is freed and refilled.
    assert all(o.error is None and o.token_ids for o in outs)
    assert all(o.finish_reason == "stop" or len(o.token_ids) == 6 for o in outs)


def test_stop_strings_cut_exactly(setup):
    _, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(7,), seed=4)[0]
    # The reference is the engine's own run without stop strings (same programs, same inputs).
    ref = list(engine.generate([Request(prompt_ids=prompt, sampling=greedy(9))])[0].token_ids)
    text = letters(ref)
    stop = text[4:6]
    at = text.find(stop)
    keep = next(n for n in range(1, 10) if stop in letters(ref[:n]))
    sampling = Sampling(temperature=0.0, max_new_tokens=9, stop_strings=("zzzzzz", stop))
    out = engine.generate([Request(prompt_ids=prompt, sampling=sampling)])[0]
    assert list(out.token_ids) == ref[:keep]
    assert out.finish_reason == "stop" and out.stop_text_at == at
    assert letters(out.token_ids)[: out.stop_text_at] + stop == text[: at + len(stop)]


def test_bad_requests_fail_alone(setup):
    model, cfg, engine = setup
    good = prompts_for(cfg.vocab_size, lengths=(5, 9), seed=5)
    bad = [
        Request(prompt_ids=(), sampling=greedy(3)),
        Request(prompt_ids=(1,) * 64, sampling=greedy(3)),
        Request(prompt_ids=good[0], sampling=greedy(0)),
        Request(prompt_ids=good[0], sampling=greedy(-2)),
        Request(prompt_ids=(cfg.vocab_size,), sampling=greedy(3)),
    ]
    reqs = [Request(prompt_ids=good[0], sampling=greedy(4)), *bad,
            Request(prompt_ids=good[1], sampling=greedy(4))]  # fmt: skip
    outs = engine.generate(reqs)
    assert [o.finish_reason for o in outs[1:-1]] == [
        "error", "prompt_too_long", "error", "error", "error"
    ]  # fmt: skip
    assert all(o.error and not o.token_ids for o in outs[1:-1])
    assert "empty" in outs[1].error and "max_new_tokens" in outs[3].error
    assert [len(outs[0].token_ids), len(outs[-1].token_ids)] == [4, 4]
    assert_greedy(model, good, [outs[0].token_ids, outs[-1].token_ids])


def test_long_generation_is_capped_by_the_context(setup):
    _, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(60,), seed=6)[0]
    out = engine.generate([Request(prompt_ids=prompt, sampling=greedy(50))])[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_resume_from_parked_state_equals_reprefill(setup):
    """Continuing from a parked state decodes as a prefill of the whole sequence would. The two
    round differently, so each is checked against the full forward (teacher-forced)."""
    model, cfg, engine = setup
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(13, 5), seed=7)
    first = engine.generate([Request(prompt_ids=prompt, sampling=greedy(8), park="conv")])[0]
    follow = prompt + first.token_ids + delta
    resumed = engine.generate([Request(prompt_ids=follow, sampling=greedy(8))])[0]
    fresh = engine.generate([Request(prompt_ids=follow, sampling=greedy(8), cache=False)])[0]
    assert resumed.reused_tokens == len(prompt) + len(first.token_ids) - 1
    assert fresh.reused_tokens == 0
    assert len(resumed.token_ids) == len(fresh.token_ids) == 8
    assert_greedy(model, [follow, follow], [resumed.token_ids, fresh.token_ids])


def test_new_weights_without_recompiling(setup):
    model, cfg, engine = setup
    import jax
    from flax import nnx

    prompt = prompts_for(cfg.vocab_size, lengths=(6,), seed=8)[0]
    req = Request(prompt_ids=prompt, sampling=greedy(5))
    before = engine.generate([req])[0].token_ids
    counts = dict(engine.compile_counts)
    _, params = nnx.split(model)
    engine.set_params(jax.tree.map(lambda x: -x, params))
    after = engine.generate([req])[0].token_ids
    engine.set_params(params)
    assert after != before
    assert engine.generate([req])[0].token_ids == before
    assert engine.compile_counts == counts


def test_scanned_decoding_equals_unrolled(tiny_qwen3_5):
    """The accelerator path (layers scanned over stacked weights) and the CPU default (unrolled
    over per-group weights) both decode the full forward's greedy tokens, fresh and resumed from a
    parked state. They round differently (~3e-6 of the logits' scale), so each is checked against
    the forward teacher-forced rather than token for token against the other."""
    model, cfg, _ = tiny_qwen3_5
    prompts = prompts_for(cfg.vocab_size, seed=9)
    checked_prompts, checked_outputs = [], []
    for unroll in (False, True):
        engine = Engine(
            model,
            EngineConfig(
                slots=3, max_len=64, steps=4, prefill_batch=4, cache_rows=8, unroll_layers=unroll
            ),
            eos_ids=(),
        )
        assert engine.device.unroll is unroll and (engine.device.groups is None) is not unroll
        reqs = [Request(prompt_ids=p, sampling=greedy(8), park=f"s{i}")
                for i, p in enumerate(prompts)]  # fmt: skip
        first = engine.generate(reqs)
        follow = [Request(prompt_ids=p + o.token_ids + (1, 2), sampling=greedy(8))
                  for p, o in zip(prompts, first, strict=True)]  # fmt: skip
        second = engine.generate(follow)
        engine.close()
        assert any(o.reused_tokens > 0 for o in second)
        assert all(len(o.token_ids) == 8 for o in first + second)
        checked_prompts += prompts + [r.prompt_ids for r in follow]
        checked_outputs += [o.token_ids for o in first + second]
    assert_greedy(model, checked_prompts, checked_outputs)


def test_a_failing_admission_fails_its_requests_and_the_engine_goes_on(setup, monkeypatch):
    """A device error while prefilling (injected: a real one cannot be provoked on demand) fails
    the requests being admitted, with the error named; nothing hangs and the next call works."""
    _, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(7,), seed=10)[0]
    req = Request(prompt_ids=prompt, sampling=greedy(3), cache=False)  # always prefilled
    good = engine.generate([req])[0]
    real = engine.device.prefill

    def broken(*args):
        monkeypatch.setattr(engine.device, "prefill", real)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.device, "prefill", broken)
    failed = engine.submit(req).result(timeout=120)
    assert failed.finish_reason == "error" and "device lost" in failed.error
    assert engine.generate([req])[0].token_ids == good.token_ids


def test_requests_submitted_together_are_admitted_together(tiny_llama):
    """generate() queues its requests atomically, so the engine thread cannot start on the first
    one alone: 4 prompts through 4 slots take one prefill call of 4 rows, every time."""
    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=4, max_len=64, steps=4, prefill_batch=4), eos_ids=())
    prompts = prompts_for(cfg.vocab_size, lengths=(5, 9, 3, 7), seed=11)
    for _ in range(3):
        engine.generate([Request(prompt_ids=p, sampling=greedy(2)) for p in prompts])
    assert engine.device.signatures["prefill"] == {((4, 16),)}
    engine.close()


def test_a_batch_that_would_be_mostly_padding_is_split(tiny_llama):
    """A call's rows are padded to a power of two and a padding row costs as much as a real one:
    5 prompts go in calls of 4 and 1 (not 8), 7 in one of 8 (one padding row), and the tokens are
    those of the full forward."""
    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=8, max_len=64, steps=4, prefill_batch=8), eos_ids=())
    for n, shapes in ((5, {((4, 16),), ((1, 16),)}), (7, {((8, 16),)})):
        engine.device.signatures.clear()
        prompts = prompts_for(cfg.vocab_size, lengths=(5, 9, 3, 7, 4, 6, 8)[:n], seed=20 + n)
        outs = engine.generate([Request(prompt_ids=p, sampling=greedy(3)) for p in prompts])
        assert engine.device.signatures["prefill"] == shapes
        assert_greedy(model, prompts, [o.token_ids for o in outs])
    engine.close()


def test_row_moves_compile_once_per_state_shape(tiny_llama):
    """Inserting, parking and keeping rows take index arrays of one size whatever the number of
    rows moved (padding is free on device; every new count used to be a new compile)."""
    model, cfg, _ = tiny_llama
    engine = Engine(
        model,
        EngineConfig(slots=4, max_len=64, steps=4, prefill_batch=4, cache_rows=32,
                     min_kept_tokens=0),
        eos_ids=(),
    )  # fmt: skip
    prompts = prompts_for(cfg.vocab_size, lengths=(5, 9, 3, 7), seed=13)
    for n in (1, 3, 2, 4):
        reqs = [Request(prompt_ids=p, sampling=greedy(4), park=f"s{n}.{i}")
                for i, p in enumerate(prompts[:n])]  # fmt: skip
        engine.generate(reqs)
    for n in (1, 3):  # whole prompts kept with their logits: straight from the store
        engine.generate([Request(prompt_ids=p, sampling=greedy(4)) for p in prompts[:n]])
    sig = engine.device.signatures
    engine.close()
    assert engine.stats["parked"] == 10 and engine.stats["full_hits"] == 10  # repeats: stored
    assert len(sig["park"]) == 1 and len(sig["insert_stored"]) == 1
    # Kept and inserted inside the prefill's own call: one program per prompt shape (1 and 2
    # new prompts: the rest are served from the store), none for the rows it moves.
    assert "insert" not in sig and "store_put" not in sig
    assert sig["prefill"] == {((1, 16),), ((2, 16),)}


def test_a_failing_resume_leaves_an_empty_cache_and_the_engine_serves(setup, monkeypatch):
    """A device error while continuing a kept state fails that request; the store (which the
    failed call may have consumed) starts empty with every row free, and serving goes on."""
    model, cfg, engine = setup
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(9, 4), seed=12)
    first = engine.generate([Request(prompt_ids=prompt, sampling=greedy(3), park="r")])[0]
    assert engine._index.rows_in_use() > 0

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.device, "resume", broken)
    follow = Request(prompt_ids=prompt + first.token_ids + delta, sampling=greedy(2))
    failed = engine.submit(follow).result(timeout=120)
    assert failed.finish_reason == "error" and "device lost" in failed.error
    assert len(engine._index) == 0 and engine._index.rows_in_use() == 0
    monkeypatch.undo()
    again = engine.generate([follow])[0]
    assert again.error is None and again.reused_tokens == 0
    assert_greedy(model, [follow.prompt_ids], [again.token_ids])


def test_bf16_engine_follows_the_bf16_forward(fixtures_dir):
    """Real runs decode in bf16: matrices, activations and the KV cache in bf16, the GDN state and
    the logits in fp32. Every greedy token the engine picks is (within bf16 rounding) the argmax
    of a full bf16 forward over the engine's own sequence — teacher-forced, so a near-tie that
    rounds the other way cannot make the check depend on the platform."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import whale_jax

    model = whale_jax.load_model(fixtures_dir / "tiny_qwen3_5", dtype=jnp.bfloat16).model
    prompts = prompts_for(model.cfg.vocab_size, lengths=(5, 3, 7), seed=2)
    with Engine(model, EngineConfig(slots=2, max_len=64, steps=4), eos_ids=()) as engine:
        outs = engine.generate([Request(prompt_ids=p, sampling=greedy(8)) for p in prompts])
        state = engine.device.state
        kinds = model.cfg.layer_types[: model.cfg.period]
        for kind, (a, b) in zip(kinds, state.cache.layers, strict=True):
            expect = (
                ("bfloat16", "bfloat16") if kind == "full_attention" else ("bfloat16", "float32")
            )
            assert (str(a.dtype), str(b.dtype)) == expect, kind
        assert state.logits.dtype == jnp.float32
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    for prompt, out in zip(prompts, outs, strict=True):
        seq = list(prompt) + list(out.token_ids)
        logits = np.asarray(forward(params, jnp.asarray([seq], jnp.int32))[0], np.float32)
        steps = logits[len(prompt) - 1 : len(seq) - 1]
        picked = steps[np.arange(len(out.token_ids)), list(out.token_ids)]
        assert len(out.token_ids) == 8
        # bf16 logits of the cached path and of the full forward differ by up to 0.06 here, 1.7 eps
        # of their scale (4.4): activations are rounded to bf16 at different points. The picked
        # and the best logit may each be off by that, so 8 eps (~0.27) leaves 2.3x; a wrong token
        # typically sits 0.5-3 below the best.
        tol = 8 * EPS_BF16 * np.abs(steps).max()
        assert (picked >= steps.max(-1) - tol).all(), (picked, steps.max(-1), tol)


def test_set_params_is_a_barrier(tiny_llama):
    """Requests running when new weights arrive finish on the old weights; everything admitted
    later runs on the new ones; parked session states (old weights) are dropped; completions say
    which weights version sampled them."""
    import time

    import jax
    from flax import nnx

    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=1), eos_ids=())
    old_prompts = prompts_for(cfg.vocab_size, lengths=(4, 6), seed=11)
    new_prompts = prompts_for(cfg.vocab_size, lengths=(5, 3), seed=12)
    n = 50
    parked = engine.generate([Request(prompt_ids=old_prompts[0], sampling=greedy(3), park="conv")])[
        0
    ]
    graphdef, params = nnx.split(model)
    negated = jax.block_until_ready(jax.tree.map(lambda x: -x, params))
    running = engine.submit_many([Request(prompt_ids=p, sampling=greedy(n)) for p in old_prompts])
    while not all(engine._running):  # both admitted and decoding
        time.sleep(0.0005)
    assert engine.set_params(negated, wait=False) == 1
    assert not any(f.done() for f in running)  # the swap really came mid-generation
    later = engine.submit_many([Request(prompt_ids=p, sampling=greedy(n)) for p in new_prompts])
    follow = old_prompts[0] + parked.token_ids + (1,)
    resumed = engine.submit(Request(prompt_ids=follow, sampling=greedy(2)))
    old_out = [f.result() for f in running]
    new_out = [f.result() for f in later]
    assert not any(o.token_ids == () for o in old_out + new_out)
    new_model = nnx.merge(graphdef, negated)
    assert [o.weights_version for o in old_out] == [0, 0]
    assert_greedy(model, old_prompts, [o.token_ids for o in old_out])
    assert [o.weights_version for o in new_out] == [1, 1]
    assert_greedy(new_model, new_prompts, [o.token_ids for o in new_out])
    assert resumed.result().reused_tokens == 0  # the parked state was computed by old weights
    assert engine.stats["cache_dropped_on_update"] >= 1
    engine.close()


def test_refused_weights_keep_the_old_ones(tiny_llama):
    """Weights of another shape are refused by name; the engine keeps its version and serves."""
    import jax
    from flax import nnx

    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=2, max_len=32, steps=2), eos_ids=())
    prompt = prompts_for(cfg.vocab_size, lengths=(5,), seed=13)[0]
    before = engine.generate([Request(prompt_ids=prompt, sampling=greedy(4))])[0]
    _, params = nnx.split(model)
    wrong = jax.tree.map(lambda x: x, params)
    wrong["embed"].set_value(wrong["embed"].get_value()[:-1])
    with pytest.raises(RuntimeError, match=r"embed.*shape"):
        engine.set_params(wrong)
    after = engine.generate([Request(prompt_ids=prompt, sampling=greedy(4))])[0]
    assert engine.weights_version == 0 and after.weights_version == 0
    assert after.token_ids == before.token_ids
    assert engine.set_params(params) == 1
    engine.close()


def test_generate_returns_early_for_waiting_requests(tiny_llama):
    """With a request waiting, a generate call ends as soon as a slot is free for it instead of
    running its remaining steps with that slot idle; nobody's tokens change."""
    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=8), eos_ids=())
    prompts = prompts_for(cfg.vocab_size, lengths=(4, 6, 5), seed=14)
    budgets = (2, 8, 2)
    reqs = [
        Request(prompt_ids=p, sampling=greedy(n)) for p, n in zip(prompts, budgets, strict=True)
    ]
    outs = engine.generate(reqs)
    # Call 1: both slots until the first stops (2 iterations); call 2: the rest (6).
    # Running every call to its 8 steps would take 8 + 2.
    assert engine.stats["decode_steps"] == 2 + 6 and engine.stats["generate_calls"] == 2
    assert [len(o.token_ids) for o in outs] == list(budgets)
    assert_greedy(model, prompts, [o.token_ids for o in outs])
    engine.close()


def test_the_pipelined_loop_samples_what_the_serial_one_does(setup):
    """Reading each generate call's tokens one call late (the default) changes when the host
    learns that a slot stopped, never what any request draws: more requests than slots, sampled,
    with stop ids, stop strings and budgets, sessions parked and continued; the same tokens,
    finish reasons, stop offsets and reused tokens as dispatch-wait-read."""
    model, cfg, _ = setup
    prompts = prompts_for(cfg.vocab_size, seed=21)
    stops = [
        SAMPLED,
        Sampling(temperature=1.0, top_k=20, max_new_tokens=9, stop_ids=tuple(range(0, 56, 8))),
        Sampling(temperature=1.0, max_new_tokens=9, stop_strings=("a", "e", "i", "o", "u")),
    ]

    def run(pipeline: bool):
        config = EngineConfig(slots=3, max_len=64, steps=4, prefill_batch=4, min_kv_bucket=32,
                              min_kept_tokens=0, cache_rows=16, pipeline=pipeline)  # fmt: skip
        with Engine(model, config, eos_ids=(), detokenize=letters) as engine:
            first = engine.generate([
                Request(prompt_ids=p, sampling=stops[i % 3], identity=(i,), park=f"s{i}")
                for i, p in enumerate(prompts)])  # fmt: skip
            turns = [p + o.token_ids + (1, 2) for p, o in zip(prompts, first, strict=True)]
            second = engine.generate([
                Request(prompt_ids=t, sampling=stops[(i + 1) % 3], identity=(i, 1))
                for i, t in enumerate(turns)])  # fmt: skip
            outs = [(o.token_ids, o.finish_reason, o.stop_text_at, o.reused_tokens)
                    for o in first + second]  # fmt: skip
            return outs, dict(engine.stats)

    pipelined, stats = run(True)
    serial, serial_stats = run(False)
    assert pipelined == serial
    assert {o[1] for o in serial} == {"stop", "length"} and any(o[3] for o in serial[7:])
    # Reads one call late did happen (and never without the pipeline).
    assert stats["late_reads"] > 0 and serial_stats.get("late_reads", 0) == 0


def test_kv_buckets_per_octave_sizes():
    from whale_jax.engine.engine import _bucket

    sizes = [1, 64, 65, 96, 97, 128, 129, 192, 193, 300, 385, 600]
    assert [_bucket(n, 64, 512) for n in sizes] == [64, 64, 128, 128, 128, 128, 256, 256, 256,
                                                    512, 512, 512]  # fmt: skip
    assert [_bucket(n, 64, 512, 2) for n in sizes] == [64, 64, 96, 96, 128, 128, 192, 192, 256,
                                                       384, 512, 512]  # fmt: skip
    assert [_bucket(n, 64, 1024, 4) for n in (65, 81, 97, 113, 129, 600)] == [
        80, 96, 112, 128, 160, 640
    ]  # fmt: skip


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5", "tiny_llama"])
def test_prefill_and_resume_pad_to_halfway_lengths(request, fixture):
    """With two new-token buckets per doubling above ``min_bucket`` (8), a 10-token prompt
    prefills padded to 12, not 16, and a turn that adds 10 tokens to a parked state resumes
    padded to 12; both decode the full forward's greedy tokens. One per doubling pads to 16."""
    model, cfg, _ = request.getfixturevalue(fixture)
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(10, 9), seed=23)
    shapes = {}
    for per_octave in (1, 2):
        engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=4, min_bucket=8,
                                            min_resume_bucket=4, min_kv_bucket=32,
                                            min_kept_tokens=0,
                                            length_buckets_per_octave=per_octave),
                        eos_ids=())  # fmt: skip
        first = engine.generate([Request(prompt_ids=prompt, sampling=greedy(8), park="t")])[0]
        follow = prompt + first.token_ids + delta  # 1 unparked reply token + 9 new
        second = engine.generate([Request(prompt_ids=follow, sampling=greedy(6))])[0]
        assert second.reused_tokens == len(follow) - 10
        sig = engine.device.signatures
        shapes[per_octave] = ({t for (t,) in sig["prefill"]}, {t for t, _ in sig["resume"]})
        engine.close()
        assert_greedy(model, [prompt, follow], [first.token_ids, second.token_ids])
    assert shapes == {1: ({(1, 16)}, {(1, 16)}), 2: ({(1, 12)}, {(1, 12)})}
    with pytest.raises(ValueError, match="length_buckets_per_octave must be in 1..min_bucket"):
        Engine(model, EngineConfig(slots=1, max_len=64, length_buckets_per_octave=17), eos_ids=())


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5", "tiny_llama"])
def test_decode_reads_a_halfway_kv_window(request, fixture):
    """With two KV windows per doubling, a decode whose longest slot needs 33..48 positions reads
    48 of them, not 64, and still decodes the full forward's greedy tokens; with one per doubling
    it reads 64."""
    model, cfg, _ = request.getfixturevalue(fixture)
    prompts = prompts_for(cfg.vocab_size, lengths=(30, 9, 12), seed=21)
    windows = {}
    for per_octave in (1, 2):
        engine = Engine(model, EngineConfig(slots=3, max_len=64, steps=4, min_kv_bucket=32,
                                            kv_buckets_per_octave=per_octave), eos_ids=())  # fmt: skip
        outs = engine.generate([Request(prompt_ids=p, sampling=greedy(8)) for p in prompts])
        windows[per_octave] = {kv for _, kv in engine.device.signatures["generate"]}
        engine.close()
        assert_greedy(model, prompts, [o.token_ids for o in outs])
    # 30 + 8 new + 4 steps: the longest slot needs up to 42 positions.
    assert windows == {1: {64}, 2: {48}}
    with pytest.raises(ValueError, match="kv_buckets_per_octave must be in 1..min_kv_bucket"):
        Engine(model, EngineConfig(slots=1, max_len=64, kv_buckets_per_octave=0), eos_ids=())
