"""The prefix cache: the host index on its own, then the engine serving from it.

Hit and miss are compared token for token, greedy and sampled: a request continued from a kept
state and one prefilled from scratch (``cache=False``) compute the same logits along different
paths (segment boundaries move the GDN chunking and the attention blocks), which round
differently by ~1e-6 of the logits' scale; a token can then differ only at a near-tie of that
size (greedy) or a Gumbel-max draw that close (sampled), about 1e-6 per token. Greedy tokens are
also checked against the full forward, teacher-forced."""

import functools
import random

import jax
import pytest
from flax import nnx

from tests.engine.conftest import assert_greedy
from tests.engine.test_engine import SAMPLED, greedy, prompts_for
from whale_jax.engine import Engine, EngineConfig, Request
from whale_jax.engine.device import auto_cache_rows, cache_bytes_per_slot
from whale_jax.engine.prefix_cache import PrefixIndex, branch_points

# -- the index -----------------------------------------------------------------------------------


def test_lookup_finds_the_longest_usable_prefix():
    index = PrefixIndex(4, block=2)
    a = index.add((1, 2), index.alloc(), logits=True)
    b = index.add((1, 2, 3, 4), index.alloc(), logits=False)
    index.add((9, 9, 9), index.alloc(), logits=True)
    assert index.lookup((1, 2, 3, 4, 5)) == (b, 4)
    assert index.lookup((1, 2, 3)) == (a, 2)
    # The whole prompt is usable only with its logits: without, the next shorter entry serves.
    assert index.lookup((1, 2, 3, 4)) == (a, 2)
    assert index.lookup((1, 2)) == (a, 2)
    assert index.lookup((2, 1)) == (None, 0)
    assert index.lookup((1, 2, 3, 7, 7)) == (a, 2)  # not a prefix of b's key: a serves
    assert index.shared_depth((1, 2, 3, 7, 7)) == 2
    assert index.shared_depth((1, 2, 3, 4, 7)) == 4
    assert index.shared_depth((9, 9, 5)) == 2
    assert index.shared_depth((5,)) == 0


def test_partial_lookup_serves_any_prefix_of_a_key_but_the_last_prompt_token():
    keys = [(1, 2, 3, 4, 5, 6), (1, 2)]
    exact, partial = PrefixIndex(4, block=2), PrefixIndex(4, block=2, partial=True)
    for index in (exact, partial):
        for key in keys:
            index.add(key, index.alloc(), logits=key == keys[0])
    long, short = (partial.get(k) for k in keys)
    assert partial.lookup((1, 2, 3, 4, 9)) == (long, 4)
    assert partial.lookup((1, 2, 3, 9)) == (long, 3)  # beyond the shared blocks, token by token
    assert partial.lookup((1, 2, 3, 4, 5)) == (long, 4)  # the last token's logits are needed
    assert partial.lookup((1, 2, 3, 4, 5, 6)) == (long, 6)  # the whole prompt, with its logits
    assert partial.lookup((1, 9, 3)) == (None, 0)  # nothing shares a whole block
    assert exact.lookup((1, 2, 3, 4, 9)) == (exact.get(keys[1]), 2)  # keys that start it only
    # An exact key deeper than the shared whole blocks, and a longer key deeper still.
    index = PrefixIndex(4, block=4, partial=True)
    snap = index.add((1, 2, 3, 4, 5), index.alloc(), logits=False)
    other = index.add((1, 2, 3, 4, 5, 6, 7, 8), index.alloc(), logits=True)
    assert index.lookup((1, 2, 3, 4, 5, 9, 9, 9)) == (snap, 5)
    assert index.lookup((1, 2, 3, 4, 5, 6, 9, 9)) == (other, 6)


def test_lookup_depths_equal_a_brute_force_search():
    rng = random.Random(0)
    for trial in range(200):
        block, partial = rng.choice([1, 2, 3]), trial % 2 == 1
        index = PrefixIndex(12, block=block, partial=partial)
        for _ in range(rng.randint(1, 12)):
            key = tuple(rng.choices(range(3), k=rng.randint(1, 9)))
            index.add(key, index.alloc(), logits=rng.random() < 0.5)
        entries = [index.get(k) for k in list(index._entries)]
        for _ in range(20):
            prompt = tuple(rng.choices(range(3), k=rng.randint(1, 10)))
            for limit, got in ((len(prompt) - 1, index.lookup(prompt)),
                               (len(prompt), (None, index.served(prompt)))):  # fmt: skip
                want = 0
                for e in entries:
                    pairs = zip(e.key, prompt, strict=False)  # up to the shorter one
                    lcp = next((i for i, (a, b) in enumerate(pairs) if a != b),
                               min(len(e.key), len(prompt)))  # fmt: skip
                    if lcp == len(e.key) and (lcp <= limit or e.logits):
                        want = max(want, lcp)  # an exact key that starts the prompt
                    elif partial and lcp >= block:  # found through a shared whole block
                        want = max(want, min(lcp, limit))
                assert got[1] == want, (prompt, limit, [e.key for e in entries])
                if got[0] is not None:
                    assert got[0].key[: got[1]] == prompt[: got[1]]


def test_eviction_takes_cold_entries_first_and_never_pinned_ones():
    index = PrefixIndex(4, block=4)  # at most 2 hot entries
    parked = index.add((1,), index.alloc(), logits=False, owner="session")
    snap = index.add((2,), index.alloc(), logits=True, hot=True)
    whole_old = index.add((3,), index.alloc(), logits=True)
    whole_new = index.add((4,), index.alloc(), logits=True)
    assert snap.hot and not (parked.hot or whole_old.hot or whole_new.hot)
    index.pin(parked)
    row = index.alloc()  # the least recently used cold entry is pinned: the next cold one goes
    assert row == whole_old.row and (3,) not in index and (1,) in index
    index.add((5,), row, logits=True)
    index.lookup((4, 0))  # hits make entries hot ...
    index.lookup((5, 0))  # ... and beyond the cap the least recently used hot one cools
    assert whole_new.hot and index.get((5,)).hot and not snap.hot
    # A speculative row may displace only cold entries; a needed one may take any unpinned.
    assert index.alloc(evict_hot=False) == snap.row
    index.unpin(parked)
    assert index.alloc(evict_hot=False) == parked.row
    assert index.alloc(evict_hot=False) is None
    assert index.alloc() == whole_new.row
    assert index.evictions == 4 and index.rows_in_use() == 4


def test_forget_drops_a_session_and_a_new_park_replaces_the_old():
    index = PrefixIndex(4, block=4)
    index.add((1, 2), index.alloc(), logits=False, owner="s")
    index.add((1, 2, 3, 4), index.alloc(), logits=False, owner="s")
    assert (1, 2) not in index and (1, 2, 3, 4) in index
    index.forget("s")
    assert len(index) == 0 and index.rows_in_use() == 0
    index.forget("never-parked")


def test_a_prompt_that_does_not_continue_a_park_drops_it():
    index = PrefixIndex(4, block=4)
    index.add((1, 2), index.alloc(), logits=False, owner="s")
    index.supersede("s", (1, 2, 3))  # continues the parked state: kept
    index.supersede("other", (7,))
    assert (1, 2) in index
    index.supersede("s", (1, 5, 2))  # another vote, a rewritten conversation: dropped
    assert len(index) == 0 and index.rows_in_use() == 0


def test_branch_points_are_where_sharing_groups_shrink():
    common, other = tuple(range(40)), tuple(range(100, 140))
    prompts = [common + (1, 2, 3), common + (4,) * 20, common[:20] + (7,) * 9, other, common + (1,)]
    points = branch_points(prompts, block=8)
    # Four prompts share 16 tokens (two blocks), three of them share 40 (five blocks).
    assert points[prompts[0]] == [16, 40]
    assert points[prompts[1]] == [16, 40]
    assert points[prompts[2]] == [16]
    assert points[prompts[3]] == []
    # A prompt that is a whole-block prefix of others branches at its own end.
    assert branch_points([common[:16], common], block=8)[common[:16]] == [16]


# -- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny_qwen3_5", "tiny_llama"])
def setup(request):
    model, cfg, _ = request.getfixturevalue(request.param)
    config = EngineConfig(slots=4, max_len=96, steps=4, prefill_batch=4, min_kv_bucket=32,
                          cache_rows=16, share_block=8, min_kept_tokens=8)  # fmt: skip
    engine = Engine(model, config, eos_ids=())
    yield model, cfg, engine
    engine.close()


def _pairs(engine, prompts, sampling, snapshots=()):
    """Each prompt through the cache and from scratch, same identity: (hit, miss) completions."""
    ids = [("case", i) for i in range(len(prompts))]
    hits = engine.generate([Request(prompt_ids=p, sampling=sampling, identity=k, snapshots=snapshots)
                            for p, k in zip(prompts, ids, strict=True)])  # fmt: skip
    misses = engine.generate([Request(prompt_ids=p, sampling=sampling, identity=k, cache=False)
                              for p, k in zip(prompts, ids, strict=True)])  # fmt: skip
    return hits, misses


@pytest.mark.parametrize("where", ["mid_message", "boundary", "whole_prompt"])
def test_a_hit_samples_what_a_miss_does(setup, where):
    model, cfg, engine = setup
    head, tail_a, *tails = prompts_for(cfg.vocab_size, lengths=(21, 6, 9, 10), seed=40)
    seed = engine.generate([Request(prompt_ids=head + tail_a, sampling=greedy(1),
                                    snapshots=(13, 21))])[0]  # fmt: skip
    assert seed.error is None
    for tail_b, sampling in zip(tails, (greedy(6), SAMPLED), strict=True):
        if where == "mid_message":  # kept at 13 tokens: a cut that is no message boundary
            prompts, reused = [head[:13] + tail_b, head[:13] + tail_a + tail_b], 13
        elif where == "boundary":  # kept at 21 (the "system prompt" end)
            prompts, reused = [head + tail_b, head + tail_b + tail_a], 21
        else:  # the whole first prompt, kept with its logits: no prefill at all
            prompts, reused = [head + tail_a, head + tail_a], len(head + tail_a)
        hits, misses = _pairs(engine, prompts, sampling)
        if engine.device.partial_resume:  # may also read a prefix of an earlier case's prompt
            assert all(h.reused_tokens >= reused for h in hits), where
        else:
            assert [h.reused_tokens for h in hits] == [reused] * 2, where
        assert all(m.reused_tokens == 0 for m in misses)
        assert [h.token_ids for h in hits] == [m.token_ids for m in misses]
        if sampling.temperature == 0:
            assert_greedy(model, prompts * 2, [o.token_ids for o in hits + misses])


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_5"])
def test_a_partial_hit_samples_what_a_miss_does(request, fixture):
    """On attention-only models a kept prompt serves any prefix of itself; a recurrent state
    holds its whole length, so the hybrid model continues only from exact keys."""
    model, cfg, _ = request.getfixturevalue(fixture)
    engine = Engine(model, EngineConfig(slots=4, max_len=64, steps=4, cache_rows=8,
                                        min_kv_bucket=32), eos_ids=())  # fmt: skip
    common, tail_a, tail_b = prompts_for(cfg.vocab_size, lengths=(20, 7, 5), seed=47)
    first = common + tail_a
    engine.generate([Request(prompt_ids=first, sampling=greedy(1))])
    partial = engine.device.partial_resume
    assert partial == (fixture == "tiny_llama")
    # Shares the kept prompt's first 23 tokens; a strict prefix of it (its last token's logits
    # were never kept); a prompt that goes on past the whole kept one.
    prompts = [first[:23] + tail_b, first[:-1], first + tail_b]
    depths = [23, len(first) - 2, len(first)] if partial else [0, 0, len(first)]
    for sampling in (greedy(6), SAMPLED):
        hits, misses = _pairs(engine, prompts, sampling)
        assert [h.reused_tokens for h in hits] == depths
        assert [h.token_ids for h in hits] == [m.token_ids for m in misses]
        if sampling.temperature == 0:
            assert_greedy(model, prompts * 2, [o.token_ids for o in hits + misses])
        engine.set_params(nnx.split(model)[1])  # drops the kept states: the same depths again
        engine.generate([Request(prompt_ids=first, sampling=greedy(1))])
    engine.close()


def test_prompts_admitted_together_prefill_their_shared_prefix_once(setup):
    _, cfg, engine = setup
    common, *tails = prompts_for(cfg.vocab_size, lengths=(40, 5, 6, 7, 8), seed=41)
    prompts = [common + t for t in tails]
    before = engine.cache_stats()
    hits = engine.generate([Request(prompt_ids=p, sampling=greedy(3)) for p in prompts])
    after = engine.cache_stats()
    # Branch point at 40 (whole 8-token blocks): 40 shared tokens once, then each tail.
    assert after["computed_tokens"] - before["computed_tokens"] == 40 + sum(map(len, tails))
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(map(len, prompts))
    misses = engine.generate(
        [Request(prompt_ids=p, sampling=greedy(3), cache=False) for p in prompts]
    )
    assert [h.token_ids for h in hits] == [m.token_ids for m in misses]
    # A later prompt along the same prefix continues from the kept branch point (attention
    # only: from the kept whole prompt it runs along, up to its own last token).
    later = engine.generate([Request(prompt_ids=common + tails[0][:2], sampling=greedy(3))])[0]
    assert later.reused_tokens == (41 if engine.device.partial_resume else 40)


def test_n_samples_arriving_apart_share_one_prefill(setup):
    _, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(19,), seed=42)[0]
    before = engine.cache_stats()
    outs = [engine.generate([Request(prompt_ids=prompt, sampling=SAMPLED, identity=("n", i))])[0]
            for i in range(4)]  # fmt: skip
    after = engine.cache_stats()
    assert after["computed_tokens"] - before["computed_tokens"] == len(prompt)
    assert after["full_hits"] - before["full_hits"] == 3
    assert [o.reused_tokens for o in outs] == [0] + [len(prompt)] * 3
    assert len({o.token_ids for o in outs}) == 4  # each its own sample


def test_a_cache_too_small_gives_the_same_tokens_within_its_budget(tiny_qwen3_5):
    model, cfg, _ = tiny_qwen3_5
    common, *tails = prompts_for(cfg.vocab_size, lengths=(24, 3, 4, 5, 6, 7, 8, 9), seed=43)
    prompts = [common + t for t in tails] + [common[:10] + t for t in tails]
    ref = Engine(model, EngineConfig(slots=4, max_len=64, steps=4, cache_rows=0), eos_ids=())
    want = ref.generate([Request(prompt_ids=p, sampling=SAMPLED, identity=(i,), cache=False)
                         for i, p in enumerate(prompts)])  # fmt: skip
    assert ref.cache_stats()["entries"] == 0
    ref.close()
    budget = 2 * ref.memory["slot_bytes"] + ref.memory["slot_bytes"] // 2
    small = Engine(model, EngineConfig(slots=4, max_len=64, steps=4, cache_bytes=budget,
                                       share_block=4), eos_ids=())  # fmt: skip
    for _ in range(2):  # the second round meets whatever the first left
        got = small.generate([Request(prompt_ids=p, sampling=SAMPLED, identity=(i,), park=f"s{i}")
                              for i, p in enumerate(prompts)])  # fmt: skip
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        stats = small.cache_stats()
        assert stats["rows"] == 2 and stats["bytes_in_use"] <= budget
    assert stats["evictions"] > 0  # under pressure all along
    assert stats["computed_tokens"] < stats["prompt_tokens"]  # and still sharing
    small.close()


def test_the_loop_sizes_its_cache_for_the_episodes_in_flight_within_memory(tiny_qwen3_5):
    _, cfg, _ = tiny_qwen3_5
    row = cache_bytes_per_slot(cfg, 512)
    rows = functools.partial(auto_cache_rows, cfg, 512, slots=8, episodes=16)
    assert rows(free_bytes=1000 * row) == 32  # two per episode when a quarter holds them
    assert rows(free_bytes=8 * row + 4 * 12 * row) == 12  # a quarter of what the slots leave
    assert rows(free_bytes=8 * row) == 8 and rows(free_bytes=None) == 8  # never below slots


def test_new_weights_drop_every_kept_state(setup):
    model, cfg, engine = setup
    prompt = prompts_for(cfg.vocab_size, lengths=(17,), seed=44)[0]
    req = Request(prompt_ids=prompt, sampling=greedy(5), park="p")
    engine.generate([req])
    assert engine.cache_stats()["entries"] > 0
    graphdef, params = nnx.split(model)
    negated = jax.tree.map(lambda x: -x, params)
    engine.set_params(negated)
    try:
        assert engine.cache_stats()["entries"] == 0
        after = engine.generate([req])[0]
        assert after.reused_tokens == 0
        fresh = Engine(nnx.merge(graphdef, negated), engine.config, eos_ids=())
        assert fresh.generate([req])[0].token_ids == after.token_ids
        fresh.close()
    finally:
        engine.set_params(params)


def test_a_session_drops_its_park_when_its_next_prompt_does_not_continue_it(tiny_llama):
    model, cfg, _ = tiny_llama
    config = EngineConfig(slots=2, max_len=64, steps=4, cache_rows=8, min_kept_tokens=0)
    engine = Engine(model, config, eos_ids=())
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(12, 3), seed=46)
    first = engine.generate([Request(prompt_ids=prompt, sampling=greedy(4), park="s")])[0]
    follow = prompt + first.token_ids + delta
    turn = engine.generate([Request(prompt_ids=follow, sampling=greedy(4), park="s")])[0]
    assert turn.reused_tokens == len(prompt) + len(first.token_ids) - 1  # resumed the park
    entries = engine.cache_stats()["entries"]
    # The same messages again (a vote): a whole-prompt hit that parks nothing new (its final
    # state is the kept prompt), and the parked second turn can no longer be continued.
    vote = engine.generate([Request(prompt_ids=follow, sampling=greedy(1), park="s")])[0]
    assert vote.reused_tokens == len(follow)
    assert engine.cache_stats()["entries"] == entries - 1
    engine.close()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_5"])
def test_a_short_reply_after_a_kept_prompt_is_not_parked(request, fixture):
    """A finished state is parked only if it holds min_kept_tokens tokens beyond the deepest kept
    state serving it; a session whose short reply was not parked resumes from its kept prompt
    (recomputing the reply) and samples the same tokens."""
    model, cfg, _ = request.getfixturevalue(fixture)
    engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=4, cache_rows=8,
                                        min_kept_tokens=6), eos_ids=())  # fmt: skip
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(12, 3), seed=48)
    short = engine.generate([Request(prompt_ids=prompt, sampling=greedy(5), park="a")])[0]
    assert engine.stats["parks_skipped"] == 1  # 4 tokens past the kept prompt
    follow = prompt + short.token_ids + delta
    turn = engine.generate([Request(prompt_ids=follow, sampling=greedy(4), park="a")])[0]
    assert turn.reused_tokens == len(prompt)  # the kept prompt, not a parked state
    fresh = engine.generate([Request(prompt_ids=follow, sampling=greedy(4), cache=False)])[0]
    assert turn.token_ids == fresh.token_ids
    long = engine.generate([Request(prompt_ids=prompt[:11], sampling=greedy(8), park="b")])[0]
    again = prompt[:11] + long.token_ids + delta  # 7 tokens past the kept prompt: parked
    resumed = engine.generate([Request(prompt_ids=again, sampling=greedy(4))])[0]
    assert resumed.reused_tokens == 11 + len(long.token_ids) - 1
    assert_greedy(model, [follow, follow, again], [turn.token_ids, fresh.token_ids,
                                                   resumed.token_ids])  # fmt: skip
    engine.close()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_5"])
def test_a_boundary_just_past_a_parked_reply_is_not_a_round_of_its_own(request, fixture):
    """A session's next turn marks the end of its messages two tokens past its parked reply: with
    min_kept_tokens 6 the turn resumes in one call and keeps nothing there; with 0 it stops at
    the boundary first. The same tokens either way, and those of a fresh prefill."""
    model, cfg, _ = request.getfixturevalue(fixture)
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(12, 5), seed=49)
    outs = []
    for min_tokens in (6, 0):
        engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=4, cache_rows=8,
                                            min_kept_tokens=min_tokens), eos_ids=())  # fmt: skip
        first = engine.generate([Request(prompt_ids=prompt, sampling=greedy(8), park="s")])[0]
        parked = len(prompt) + len(first.token_ids) - 1
        follow = prompt + first.token_ids + delta
        boundary = parked + 2
        resumes = engine.stats["resumes"]
        turn = engine.generate([Request(prompt_ids=follow, sampling=greedy(4), park="s",
                                        snapshots=(boundary,))])[0]  # fmt: skip
        assert turn.reused_tokens == parked
        kept = engine._index.get(tuple(follow[:boundary])) is not None
        assert (engine.stats["resumes"] - resumes, kept) == (
            (1, False) if min_tokens else (2, True)
        )
        fresh = engine.generate([Request(prompt_ids=follow, sampling=greedy(4), cache=False)])[0]
        assert turn.token_ids == fresh.token_ids
        outs.append(turn.token_ids)
        engine.close()
    assert outs[0] == outs[1]
    assert_greedy(model, [follow], [outs[0]])


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_5"])
def test_a_prefix_too_short_to_pay_for_a_resume_is_prefilled_with_the_rest(request, fixture):
    """A client boundary fewer than min_kept_tokens into the prompt (a short system prompt) is not
    kept, and a kept state that short is not resumed from: the prompt is prefilled whole, as a
    resume of the few tokens after it costs more than prefilling them again. With 0 the same
    prompts stop at the boundary and resume from it; the tokens are the same."""
    model, cfg, _ = request.getfixturevalue(fixture)
    head, *tails = prompts_for(cfg.vocab_size, lengths=(5, 10, 11), seed=50)
    outs = []
    for min_tokens in (8, 0):
        # share_block 4: llama (every layer attention) could serve the 5 tokens from the first
        # whole prompt's kept state, found by block.
        engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=4, cache_rows=8,
                                            share_block=4, min_kept_tokens=min_tokens),
                        eos_ids=())  # fmt: skip
        got = [
            engine.generate(
                [Request(prompt_ids=head + tail, sampling=greedy(4), snapshots=(len(head),))]
            )[0]  # fmt: skip
            for tail in tails
        ]
        kept = engine._index.get(tuple(head)) is not None
        reused = [c.reused_tokens for c in got]
        assert (engine.stats["resumes"], kept, reused) == (
            (0, False, [0, 0]) if min_tokens else (2, True, [0, len(head)])
        )
        outs.append([c.token_ids for c in got])
        engine.close()
    assert outs[0] == outs[1]
    assert_greedy(model, [head + t for t in tails], outs[0])


def test_a_resume_of_a_few_tokens_is_padded_to_min_resume_bucket(tiny_llama):
    """Three new tokens past a kept prompt resume in a 4-token bucket (a prefill's smallest is
    16), with the tokens of the full forward."""
    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=4, cache_rows=8), eos_ids=())
    prompt, more = prompts_for(cfg.vocab_size, lengths=(20, 3), seed=51)
    engine.generate([Request(prompt_ids=prompt, sampling=greedy(2))])
    out = engine.generate([Request(prompt_ids=prompt + more, sampling=greedy(4))])[0]
    assert out.reused_tokens == len(prompt)
    assert {T for (_, T), _ in engine.device.signatures["resume"]} == {4}
    assert_greedy(model, [prompt + more], [out.token_ids])
    engine.close()


def test_prefix_cache_off_keeps_sessions_only(tiny_llama):
    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=2, max_len=64, steps=4, prefix_cache=False,
                                        min_kept_tokens=0), eos_ids=())  # fmt: skip
    prompt, delta = prompts_for(cfg.vocab_size, lengths=(12, 3), seed=45)
    first = engine.generate([Request(prompt_ids=prompt, sampling=greedy(4), park="s")])[0]
    again = engine.generate([Request(prompt_ids=prompt, sampling=greedy(4))])[0]
    assert again.reused_tokens == 0  # no whole-prompt state was kept
    follow = prompt + first.token_ids + delta
    turn = engine.generate([Request(prompt_ids=follow, sampling=greedy(4))])[0]
    assert turn.reused_tokens == len(prompt) + len(first.token_ids) - 1
    assert_greedy(model, [prompt, prompt, follow], [first.token_ids, again.token_ids,
                                                    turn.token_ids])  # fmt: skip
    engine.close()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_5"])
def test_row_moves_by_scatter_serve_what_the_loop_does(request, fixture):
    """The accelerators' row moves (one scatter for all entries) against the CPU's (a row at a
    time), on the same work: whole prompts kept and served again, a shared prefix, sessions
    parked and resumed, all through a store small enough to evict. Same tokens, same stats."""
    model, cfg, _ = request.getfixturevalue(fixture)
    common, *tails = prompts_for(cfg.vocab_size, lengths=(24, 5, 6, 7, 9), seed=52)
    prompts = [common + t for t in tails]
    runs = {}
    for moves in ("loop", "scatter"):
        engine = Engine(model, EngineConfig(slots=4, max_len=96, steps=4, cache_rows=5,
                                            min_kv_bucket=32, share_block=8, min_kept_tokens=8,
                                            row_moves=moves), eos_ids=())  # fmt: skip
        assert engine.device.row_moves == moves
        turns = []
        firsts = engine.generate([Request(prompt_ids=p, sampling=SAMPLED, identity=(i,),
                                          park=f"s{i}") for i, p in enumerate(prompts)])  # fmt: skip
        turns.append(firsts)
        # Every prompt again (whole-prompt hits) and each session's next turn (resumes).
        again = engine.generate([Request(prompt_ids=p, sampling=greedy(5), identity=("a", i))
                                 for i, p in enumerate(prompts)])  # fmt: skip
        turns.append(again)
        follow = [p + f.token_ids + tails[0][:3] for p, f in zip(prompts, firsts, strict=True)]
        turns.append(engine.generate([Request(prompt_ids=p, sampling=greedy(5), park=f"s{i}")
                                      for i, p in enumerate(follow)]))  # fmt: skip
        runs[moves] = (
            [[(o.token_ids, o.reused_tokens) for o in outs] for outs in turns],
            engine.cache_stats(),
            follow,
        )
        engine.close()
    assert runs["scatter"][0] == runs["loop"][0]
    assert runs["scatter"][1] == runs["loop"][1]
    stats = runs["loop"][1]
    assert (
        stats["full_hits"] >= 1 and stats["evictions"] >= 1 and stats["hits"] > stats["full_hits"]
    )
    outs = [o for o, _ in runs["scatter"][0][2]]
    assert_greedy(model, runs["scatter"][2], outs)


def test_whole_prompt_hits_admitted_together_go_in_one_insert(tiny_llama, monkeypatch):
    """Five repeats of a kept prompt admitted together fill their slots in one call from the
    store, whatever prefill_batch (2 here), with the tokens of the full forward."""
    model, cfg, _ = tiny_llama
    engine = Engine(model, EngineConfig(slots=8, max_len=64, steps=4, prefill_batch=2,
                                        cache_rows=4), eos_ids=())  # fmt: skip
    prompt = prompts_for(cfg.vocab_size, lengths=(20,), seed=53)[0]
    engine.generate([Request(prompt_ids=prompt, sampling=greedy(1))])
    calls = []
    insert = engine.device.insert
    monkeypatch.setattr(
        engine.device,
        "insert",
        lambda init, window=None: (calls.append(window), insert(init, window)),
    )
    outs = engine.generate([Request(prompt_ids=prompt, sampling=greedy(3), identity=(i,))
                            for i in range(5)])  # fmt: skip
    assert len(calls) == 1 and engine.stats["prefills"] == 1  # the first request's only
    assert [o.reused_tokens for o in outs] == [len(prompt)] * 5
    assert_greedy(model, [prompt] * 5, [o.token_ids for o in outs])
    engine.close()
