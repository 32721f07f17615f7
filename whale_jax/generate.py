"""Prints a model's completion of one prompt.

    python -m whale_jax.generate --model=smollm2 --prompt="What is the capital of France?"

--model is a checkpoint directory, a .gguf file, a Hugging Face hub id, or ``smollm2`` (the
offline SmolLM2-135M-Instruct). The tokenizer's chat template is applied when it has one.
"""

from __future__ import annotations

import sys
import time

import jax.numpy as jnp
from absl import app, flags

from harness.api import SamplingSettings

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2", "Checkpoint directory, .gguf file, hub id, or 'smollm2'.")
flags.DEFINE_string("prompt", None, "The user message (or raw text with --raw).")
flags.DEFINE_string("system", None, "Optional system message.")
flags.DEFINE_bool("raw", False, "Feed the prompt as plain text, without the chat template.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 decodes greedily; > 0 samples.", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set of tokens with this mass.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations dtype.")
flags.DEFINE_bool(
    "unroll_layers",
    False,
    "Run the decode loop's layers unrolled over per-layer weights (faster steps on CPU, but a "
    "several times longer decode compile: worth it for long generations, not for one short "
    "answer; the prompt's prefill scans either way).",
)


def prompt_ids(tokenizer, prompt: str, system: str | None, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def main(argv):
    del argv
    if FLAGS.prompt is None:
        raise app.UsageError("--prompt is required")
    from whale_jax.engine.engine import Engine, EngineConfig
    from whale_jax.engine.requests import Request, Sampling
    from whale_jax.io.load import load_model

    t0 = time.time()
    model, cfg, tokenizer = load_model(FLAGS.model, dtype=jnp.dtype(FLAGS.dtype))
    if tokenizer is None:
        raise app.UsageError(f"--model={FLAGS.model}: the checkpoint ships no tokenizer")
    ids = prompt_ids(tokenizer, FLAGS.prompt, FLAGS.system, FLAGS.raw)
    eos = tuple(cfg.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    t1 = time.time()
    engine = Engine(
        model,
        EngineConfig(
            slots=1,
            max_len=len(ids) + FLAGS.max_new_tokens,
            seed=FLAGS.seed,
            unroll_layers=FLAGS.unroll_layers,
        ),
        eos_ids=eos,
        detokenize=tokenizer.decode,
    )
    sampling = Sampling.from_settings(
        SamplingSettings(
            temperature=FLAGS.temperature,
            top_k=FLAGS.top_k,
            top_p=FLAGS.top_p,
            max_new_tokens=FLAGS.max_new_tokens,
        )
    )
    try:
        (done,) = engine.generate([Request(prompt_ids=tuple(ids), sampling=sampling)])
    finally:
        engine.close()
    if done.error:
        raise app.UsageError(f"generation failed: {done.error}")
    out = list(done.token_ids)
    t2 = time.time()
    print(tokenizer.decode(out, skip_special_tokens=True).strip())
    print(
        f"[{len(ids)} prompt + {len(out)} new tokens; load {t1 - t0:.1f}s, "
        f"generate {t2 - t1:.1f}s ({len(out) / max(t2 - t1, 1e-9):.1f} tok/s incl. compile)]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    app.run(main)
