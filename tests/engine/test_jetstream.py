"""JetStream's orchestrator over our model (the ``jetstream`` extra, installed by ``make setup``):
its Driver, in this process on the CPU, must decode the tokens our own engine decodes greedily;
disaggregated over two simulated devices; and ``python -m whale_jax.serve`` over gRPC."""

import logging
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import whale_jax
from tests.conftest import REPO, run_on_devices, xla_flags
from tests.engine.conftest import assert_greedy
from whale_jax.engine import Engine, EngineConfig, Request, Sampling
from whale_jax.engine.jetstream_engine import (
    JetStreamEngine,
    LocalServer,
    js,
    text_request,
    token_request,
)
from whale_jax.io.gguf import find_smollm2_gguf
from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf
from whale_jax.models.config import TINY_SMOLLM2_HF

PROMPT_LENGTHS = (3, 9, 17, 26, 58, 5)  # buckets 16 to 64; past a KV window of 64; more than slots


@pytest.fixture(scope="module")
def smol_tokenizer():
    return tokenizer_from_gguf(find_smollm2_gguf())


# Untied: the tied tiny model's greedy tokens repeat the prompt's last token, which a broken cache
# would not change. This one's depend on the whole context.
SMOL_UNTIED = {**TINY_SMOLLM2_HF, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_smol():
    """SmolLM2's vocabulary and BOS on a random tiny model (for SmolLM2's real tokenizer)."""
    return whale_jax.random_model(whale_jax.ModelConfig.from_hf(SMOL_UNTIED), seed=0)


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request, tiny_llama, tiny_qwen3_5):
    """A dense model, and a hybrid one (Gated DeltaNet and attention layers)."""
    return (tiny_llama if request.param == "llama" else tiny_qwen3_5).model


def prompts_for(model, lengths=PROMPT_LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(3, model.cfg.vocab_size, n)) for n in lengths]


def ours(model, prompts, max_new, stop_ids=(), slots=4, max_len=128):
    """Our engine's greedy completions (token ids, the stop id included where one was drawn)."""
    with Engine(model, EngineConfig(slots=slots, max_len=max_len, prefill_batch=1)) as engine:
        sampling = Sampling(temperature=0.0, max_new_tokens=max_new, stop_ids=tuple(stop_ids))
        done = engine.generate([Request(prompt_ids=p, sampling=sampling) for p in prompts])
    return [list(c.token_ids) for c in done]


def assert_same_greedy(model, prompts, expected, got, stops=None):
    """Each request's tokens are ours, or (only where the two computations differ in rounding at a
    near-tie) both are greedy by the teacher-forced oracle. JetStream ends a request at a stop id
    without returning it: ours that end with one of ``stops`` (default: the model's EOS ids) are
    compared without it."""
    stops = set(model.cfg.eos_token_ids if stops is None else stops)
    expected = [w[:-1] if w and w[-1] in stops else w for w in expected]
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        if want != have:
            assert len(want) == len(have), (want, have)
            assert_greedy(model, [prompt, prompt], [want, have])


def a_stop_inside(completions):
    """(request, position, token): a token some request draws first at ``position`` >= 2 (a stop
    id there cuts that request short)."""
    for r, tokens in enumerate(completions):
        for i in range(2, len(tokens) - 1):
            if tokens[i] not in tokens[:i]:
                return r, i, tokens[i]
    pytest.fail(f"every request repeats its first tokens: {completions}")


def engine_for(model, tokenizer, **options):
    options = {"slots": 4, "max_len": 128, "steps": 1, **options}
    return JetStreamEngine(model, tokenizer, **options)


def test_the_driver_decodes_our_engines_greedy_tokens(model, smol_tokenizer):
    prompts = prompts_for(model)
    r, at, stop = a_stop_inside(ours(model, prompts, 10))
    expected = ours(model, prompts, 10, stop_ids=(stop,))
    eos = tuple(model.cfg.eos_token_ids)
    engine = engine_for(model, smol_tokenizer, stop_ids=(*eos, stop))
    with LocalServer([engine]) as server:
        got = server.decode([token_request(p, 10) for p in prompts])
    # JetStream ends a request at a stop id without returning it; exactly max_tokens otherwise.
    assert len(got[r]) == at and all(len(g) <= 10 for g in got)
    assert_same_greedy(model, prompts, expected, got, stops=(*eos, stop))
    # Each call's KV window bounds its slots' lengths: the 58-token prompt's last calls read 96.
    windows = {kv_len for _, kv_len in engine.signatures["generate"]}
    assert max(windows) >= 58 + 10 and min(windows) == 64, windows


def test_several_steps_per_call_end_a_request_at_its_last_whole_call(tiny_llama, smol_tokenizer):
    model = tiny_llama.model
    prompts = prompts_for(model)
    expected = ours(model, prompts, 10)
    with LocalServer([engine_for(model, smol_tokenizer, steps=4)]) as server:
        got = server.decode([token_request(p, 10) for p in prompts])
    # Checked once per call of 4: calls ending at 4 and 8 tokens are within 10, the third is not
    # (a stop id ends a request where it is drawn).
    assert_same_greedy(model, prompts, [w[:8] if len(w) > 8 else w for w in expected], got)


def test_text_requests_and_the_bos(tiny_smol, smol_tokenizer):
    text = "The capital of France is"
    ids = tuple(smol_tokenizer.encode(text, add_special_tokens=False))
    bos = tiny_smol.cfg.bos_token_id
    plain, with_bos = ours(tiny_smol, [ids, (bos, *ids)], 6)
    with LocalServer([engine_for(tiny_smol, smol_tokenizer)]) as server:
        # No BOS by default: the model sees the prompt as sent, as our engine does.
        got = server.decode([text_request(text, 6), token_request(ids, 6)])
    assert_same_greedy(tiny_smol, [ids, ids], [plain, plain], got)
    with LocalServer([engine_for(tiny_smol, smol_tokenizer, add_bos=True)]) as server:
        # add_bos: JetStream's convention (a BOS unless the request names a session_cache).
        got = server.decode([token_request(ids, 6), token_request(ids, 6, session_cache="s")])
    assert_same_greedy(tiny_smol, [(bos, *ids), ids], [with_bos, plain], got)


def test_a_prompt_longer_than_max_prefill_length_keeps_its_last_tokens(
    tiny_llama, smol_tokenizer, caplog
):
    model = tiny_llama.model
    (prompt,) = prompts_for(model, (40,))
    (expected,) = ours(model, [prompt[-32:]], 5)
    engine = engine_for(model, smol_tokenizer, max_prefill_length=32)
    with caplog.at_level(logging.WARNING), LocalServer([engine]) as server:
        (got,) = server.decode([token_request(prompt, 5, session_cache="s")])
    assert_same_greedy(model, [prompt[-32:]], [expected], [got])
    assert "cut a prompt of 40 tokens to its last 32" in caplog.text


def test_out_of_vocabulary_ids_are_clipped_not_fatal(tiny_llama, smol_tokenizer, caplog):
    model = tiny_llama.model
    vocab = model.cfg.vocab_size
    (expected,) = ours(model, [(5, vocab - 1)], 4)
    with caplog.at_level(logging.ERROR), LocalServer([engine_for(model, smol_tokenizer)]) as s:
        (got,) = s.decode([token_request((5, vocab + 7), 4)])
    assert_same_greedy(model, [(5, vocab - 1)], [expected], [got])
    assert "outside the vocabulary" in caplog.text


def test_settings_it_refuses(tiny_smol, tiny_qwen3_5, smol_tokenizer):
    with pytest.raises(ValueError, match="power of two from 16 below max_len"):
        engine_for(tiny_smol, smol_tokenizer, max_prefill_length=100)
    with pytest.raises(ValueError, match="power of two from 16 below max_len"):
        engine_for(tiny_smol, smol_tokenizer, max_prefill_length=128)  # = max_len: no room
    with pytest.raises(ValueError, match="no BOS"):
        engine_for(tiny_qwen3_5.model, smol_tokenizer, add_bos=True)
    with pytest.raises(ValueError, match="top_p"):
        engine_for(tiny_smol, smol_tokenizer, top_p=0.0)


def test_sampling_draws_a_key_per_insert(tiny_smol, smol_tokenizer):
    """With a temperature, each request draws from its own key: the same prompt sampled twice
    differs, and a server with the same seed repeats them in the same order of inserts."""
    (prompt,) = prompts_for(tiny_smol, (6,))

    def sample_twice():
        engine = engine_for(tiny_smol, smol_tokenizer, temperature=1.0, seed=3, stop_ids=())
        with LocalServer([engine]) as server:
            return [server.decode([token_request(prompt, 12)])[0] for _ in range(2)]

    first = sample_twice()
    assert first[0] != first[1]
    assert sample_twice() == first


DISAGGREGATED = """
import jax, numpy as np
import whale_jax
from whale_jax.engine import Engine, EngineConfig, Request, Sampling
from whale_jax.engine.jetstream_engine import JetStreamEngine, LocalServer, token_request
from whale_jax.io.gguf import find_smollm2_gguf
from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf
from tests.engine.test_jetstream import SMOL_UNTIED, assert_same_greedy, prompts_for

model = whale_jax.random_model(whale_jax.ModelConfig.from_hf(SMOL_UNTIED), seed=0)
tok = tokenizer_from_gguf(find_smollm2_gguf())
prompts = prompts_for(model)
with Engine(model, EngineConfig(slots=4, max_len=128, prefill_batch=1)) as engine:
    g = Sampling(temperature=0.0, max_new_tokens=8)
    expected = [list(c.token_ids) for c in engine.generate([Request(prompt_ids=p, sampling=g) for p in prompts])]
d0, d1 = jax.devices()
pre, gen = (JetStreamEngine(model, tok, slots=4, max_len=128, steps=2, device=d) for d in (d0, d1))
assert pre.device == d0 and gen.device == d1
with LocalServer([pre, gen], prefill=1) as server:
    got = server.decode([token_request(p, 8) for p in prompts])
assert_same_greedy(model, prompts, expected, got)
# The prefill engine only prefilled; the generate engine only inserted and generated.
assert set(pre.compile_counts) == {"prefill"}, pre.compile_counts
assert set(gen.compile_counts) == {"insert", "generate"}, gen.compile_counts
print("ok", [len(g) for g in got])
"""


def test_disaggregated_prefill_and_generate_on_two_devices():
    proc = run_on_devices(DISAGGREGATED, devices=2, timeout=300)
    assert "ok" in proc.stdout


def _listening(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp*)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


def test_serve_answers_grpc_on_loopback(tiny_model_dir, smol_tokenizer):
    import grpc

    env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "whale_jax.serve", "--backend=jetstream", "--port=0",
            f"--model={tiny_model_dir}", "--slots=2", "--max_len=128"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            match = re.match(r"serving on (\S+):(\d+)", line)
            if match:
                break
        assert match, "".join(seen[-30:])
        host, port = match.group(1), int(match.group(2))
        assert host == "127.0.0.1"
        # 127.0.0.1 only (gRPC may listen on an IPv6 socket at its IPv4-mapped form).
        listening = _listening(port)
        assert listening and listening <= {"0100007F", "0000000000000000FFFF00000100007F"}, (
            listening
        )
        model = whale_jax.load_model(tiny_model_dir).model
        ids = tuple(smol_tokenizer.encode("Hello there", add_special_tokens=False))
        (expected,) = ours(model, [ids], 6)
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = js.jetstream_pb2_grpc.OrchestratorStub(channel)
            assert stub.HealthCheck(js.jetstream_pb2.HealthCheckRequest(), timeout=60).is_live
            got = [t for r in stub.Decode(token_request(ids, 6), timeout=120)
                   for s in r.stream_content.samples for t in s.token_ids]  # fmt: skip
            text = "".join(s.text for r in stub.Decode(text_request("Hello there", 6), timeout=120)
                           for s in r.stream_content.samples)  # fmt: skip
        assert_same_greedy(model, [ids], [expected], [got])
        assert text == smol_tokenizer.decode(got)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_names_the_flag_at_fault(tiny_model_dir):
    env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu")
    base = [sys.executable, "-m", "whale_jax.serve", f"--model={tiny_model_dir}", "--max_len=128"]
    for bad, says in (("--prefill_devices=1", "--prefill_devices=1"),
                      ("--devices=3", "--devices=3"),
                      ("--max_prefill_length=48", "max_prefill_length")):  # fmt: skip
        proc = subprocess.run([*base, bad], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
