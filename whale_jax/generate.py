"""Prints a model's completion of one prompt.

    python -m whale_jax.generate --model=smollm2 --prompt="What is the capital of France?"

--model is a checkpoint directory, a .gguf file, a Hugging Face hub id, or ``smollm2`` (the
offline SmolLM2-135M-Instruct). The tokenizer's chat template is applied when it has one.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2", "Checkpoint directory, .gguf file, hub id, or 'smollm2'.")
flags.DEFINE_string("prompt", None, "The user message (or raw text with --raw).")
flags.DEFINE_string("system", None, "Optional system message.")
flags.DEFINE_bool("raw", False, "Feed the prompt as plain text, without the chat template.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 decodes greedily; > 0 samples.", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).", lower_bound=0)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations dtype.")


def prompt_ids(tokenizer, prompt: str, system: str | None, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def complete(
    jitted,
    ids: list[int],
    *,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """Greedy or sampled continuation of one prompt (prefill, then one token per step)."""
    max_len = len(ids) + max_new_tokens
    logits, cache = jitted.prefill(
        jnp.asarray([ids]), jnp.asarray([len(ids)]), max_len=max_len, last_only=True
    )
    key = jax.random.key(seed)
    out: list[int] = []
    for step in range(max_new_tokens):
        row = logits[0]
        if temperature > 0:
            row = row / temperature
            if top_k:
                kth = jnp.sort(row)[-top_k]
                row = jnp.where(row < kth, -jnp.inf, row)
            token = int(jax.random.categorical(jax.random.fold_in(key, step), row))
        else:
            token = int(jnp.argmax(row))
        out.append(token)
        if token in eos_ids or step == max_new_tokens - 1:
            break
        logits, cache = jitted.extend(
            cache, jnp.asarray([[token]]), jnp.asarray([1]), last_only=True
        )
    return out


def main(argv):
    del argv
    if FLAGS.prompt is None:
        raise app.UsageError("--prompt is required")
    from whale_jax.loading import load_model
    from whale_jax.models.transformer import Jitted

    t0 = time.time()
    model, cfg, tokenizer = load_model(FLAGS.model, dtype=jnp.dtype(FLAGS.dtype))
    if tokenizer is None:
        raise app.UsageError(f"--model={FLAGS.model}: the checkpoint ships no tokenizer")
    ids = prompt_ids(tokenizer, FLAGS.prompt, FLAGS.system, FLAGS.raw)
    eos = tuple(cfg.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    t1 = time.time()
    out = complete(
        Jitted(model),
        ids,
        max_new_tokens=FLAGS.max_new_tokens,
        eos_ids=eos,
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        seed=FLAGS.seed,
    )
    t2 = time.time()
    print(tokenizer.decode(out, skip_special_tokens=True).strip())
    print(
        f"[{len(ids)} prompt + {len(out)} new tokens; load {t1 - t0:.1f}s, "
        f"generate {t2 - t1:.1f}s ({len(out) / max(t2 - t1, 1e-9):.1f} tok/s incl. compile)]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    app.run(main)
