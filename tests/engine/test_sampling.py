"""Sampling rules: greedy, top-k support, top-p nucleus, per-request keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from whale_jax.engine.sampling import SlotSampling, request_key, sample

DRAWS = 512


def draws(logits_V, *, temperature=1.0, top_k=0, top_p=1.0, max_top_k=8, n=DRAWS):
    """n tokens from one row: the batch holds the same row with token indices 0..n-1."""
    logits = jnp.tile(jnp.asarray(logits_V, jnp.float32)[None], (n, 1))
    params = SlotSampling(
        temperature=jnp.full((n,), temperature, jnp.float32),
        top_k=jnp.full((n,), top_k, jnp.int32),
        top_p=jnp.full((n,), top_p, jnp.float32),
        key=jnp.tile(jnp.asarray(request_key(0, ("t",)))[None], (n, 1)),
    )
    fn = jax.jit(sample, static_argnames="max_top_k")
    return np.asarray(fn(logits, params, jnp.arange(n, dtype=jnp.int32), max_top_k=max_top_k))


def expected_probs(logits_V, *, temperature, top_k=0, top_p=1.0):
    """The distribution the module docstring defines, in float64: softmax(logits / T), cut to the
    top-k, then to the smallest prefix whose mass reaches top-p, renormalised."""
    z = np.asarray(logits_V, np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    keep[order[: top_k if top_k > 0 else len(probs)]] = True
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep[order[mass_before >= top_p]] = False
    return np.where(keep, probs, 0.0) / probs[keep].sum()


def assert_frequencies_follow(got, probs, delta=1e-6):
    """Each token's empirical frequency over n independent draws is within Hoeffding's bound of its
    probability: P(|freq - p| >= t) <= 2 exp(-2 n t^2), so t = sqrt(ln(2 / delta) / (2 n)) fails a
    correct sampler with probability at most delta per token (n = 4096: t = 0.042). Tokens of
    probability zero must never be drawn."""
    n = len(got)
    freq = np.bincount(got, minlength=len(probs)) / n
    t = np.sqrt(np.log(2 / delta) / (2 * n))
    assert (freq[probs == 0] == 0).all(), (freq, probs)
    assert (np.abs(freq - probs) < t).all(), (freq.round(3), probs.round(3), t)


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=40)
    assert set(draws(logits, temperature=0.0, top_k=5, top_p=0.5)) == {int(np.argmax(logits))}


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_top_k_never_leaves_the_k_best(top_k):
    logits = np.random.default_rng(1).normal(size=40) * 0.1  # flat: every token is plausible
    best = set(np.argsort(-logits)[:top_k].tolist())
    got = set(draws(logits, top_k=top_k).tolist())
    assert got <= best
    assert len(got) == top_k  # and all k of them do occur


@pytest.mark.parametrize("top_k, max_top_k", [(0, 8), (4, 8), (20, 8)])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_k, max_top_k):
    # Probabilities 0.4, 0.3, 0.2, 0.1 then a flat tail of ~0: top-p 0.65 keeps exactly the first 2,
    # 0.75 the first 3 (wide top-k and no top-k take the full-sort path, top_k=4 the top-k path).
    probs = np.array([0.4, 0.3, 0.2, 0.1] + [1e-9] * 12)
    logits = np.log(probs)[np.random.default_rng(2).permutation(16)]
    order = np.argsort(-logits)
    for p, n in [(0.65, 2), (0.75, 3), (0.3, 1)]:
        got = set(draws(logits, top_k=top_k, top_p=p, max_top_k=max_top_k).tolist())
        assert got == set(order[:n].tolist()), (p, got)


def test_frequencies_follow_the_renormalised_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    got = draws(np.log(probs), top_p=0.9, n=4096)  # keeps 0.5, 0.3, 0.15 -> renormalised by 0.95
    assert_frequencies_follow(got, np.append(probs[:3] / 0.95, 0.0))


# Six tokens, shuffled. Their probabilities at T = 1 are 0.54, 0.20, 0.12, 0.07, 0.04, 0.03; at
# T = 0.5 the best has 0.82 and at T = 2 0.34. On every path below, a sampler that ignores the
# temperature is off by 0.17 or more on some token: four times the frequency bound at 4096 draws.
TEMPERATURE_LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])[[3, 0, 5, 1, 4, 2]]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize(
    "top_k, top_p",
    [
        (0, 1.0),  # the full vocabulary, no sort
        (0, 0.9),  # the full vocabulary, sorted for top-p
        (4, 1.0),  # the top-k path (top_k <= max_top_k)
        (4, 0.9),  # the top-k path with top-p inside it
    ],
)
def test_temperature_scales_the_logits_on_every_path(temperature, top_k, top_p):
    probs = expected_probs(TEMPERATURE_LOGITS, temperature=temperature, top_k=top_k, top_p=top_p)
    got = draws(TEMPERATURE_LOGITS, temperature=temperature, top_k=top_k, top_p=top_p, n=4096)
    assert_frequencies_follow(got, probs)


def test_a_rows_draw_ignores_its_batch_position():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 30)), jnp.float32)
    key = jnp.asarray(request_key(5, ("task", 1)))
    params = SlotSampling(
        temperature=jnp.ones(4), top_k=jnp.full(4, 10, jnp.int32), top_p=jnp.full(4, 0.95),
        key=jnp.stack([key] * 4),
    )  # fmt: skip
    index = jnp.array([3, 3, 3, 3], jnp.int32)
    same = jnp.tile(logits[2:3], (4, 1))
    out = sample(same, params, index, max_top_k=16)
    assert len(set(np.asarray(out).tolist())) == 1
    single = sample(logits[2:3], jax.tree.map(lambda x: x[:1], params), index[:1], max_top_k=16)
    assert int(single[0]) == int(out[0])


def test_request_keys_depend_on_identity_only():
    a = request_key(0, (1, "task-3", 2, 0))
    assert (a == request_key(0, (1, "task-3", 2, 0))).all()
    others = [request_key(1, (1, "task-3", 2, 0)), request_key(0, (1, "task-3", 2, 1)),
              request_key(0, (1, "task-4", 2, 0))]  # fmt: skip
    assert all(not (a == o).all() for o in others)
