"""RSFT steps and a harness iteration of the math flagfile on this machine's accelerator, with
a randomly initialised Qwen3.5 (nothing downloaded) and a loopback proposer; prints and saves the
timings of each part of the run.

    python benchmarks/loop_device.py --config=qwen3_5_2b      # on a GPU/TPU host
    python benchmarks/loop_device.py --config=tiny            # the same path in a minute on a CPU

What it runs: ``python -m whale_jax.main --flagfile=experiments/math.flags`` in this process, on the
offline math tasks, with the weights of ``--config`` (``benchmarks/bench_train.py``'s configs;
random, bf16) written as an HF checkpoint with a byte-level tokenizer made here (no tokenizer is
downloaded, so prompts are about four times as many tokens as with Qwen's), and the proposer an
OpenAI-compatible endpoint on 127.0.0.1 served by this program (``--proposer=openai``): it
writes one candidate, h0 with its system prompt extended, and submits. The schedule is cut to a
weight step, a harness phase of one proposal iteration, and a weight step, with
``--prompt_batch`` x ``--samples`` episodes and ``--max_new_tokens`` per call. No accelerator was
lent to the session that wrote this; the command above is the one to run when one is.
"""

from __future__ import annotations

import argparse
import http.server
import json
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, RESULTS, machine_info, save_results

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
ARGS.add_argument("--config", default="qwen3_5_2b", help="qwen3_5_2b, qwen3_5_4b or tiny")
ARGS.add_argument("--prompt_batch", type=int, default=32)
ARGS.add_argument("--samples", type=int, default=8)
ARGS.add_argument("--max_new_tokens", type=int, default=1024)
ARGS.add_argument("--engine_slots", type=int, default=256)
ARGS.add_argument("--out", default=str(RESULTS / "loop_device.json"))

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>"]  # fmt: skip


def write_checkpoint(config: str, out: Path) -> dict:
    """Random bf16 weights of ``config`` as an HF checkpoint, with a byte-level tokenizer."""
    import jax.numpy as jnp
    from bench_train import AOT_MODELS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from whale_jax.io.load import random_model
    from whale_jax.io.safetensors import save_hf
    from whale_jax.models.config import ModelConfig, tiny_qwen3_5_hf

    hf = dict(AOT_MODELS[config]) if config in AOT_MODELS else tiny_qwen3_5_hf(vocab_size=512)
    hf["eos_token_id"] = 2  # <|im_end|> below
    model = random_model(ModelConfig.from_hf(hf), seed=0, dtype=jnp.bfloat16)
    save_hf(model, out, hf)
    (out / "config.json").write_text(json.dumps(hf))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte_level, decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")  # fmt: skip
    fast.save_pretrained(str(out))
    return hf


def loopback_proposer() -> tuple[str, http.server.ThreadingHTTPServer]:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that writes one candidate (the math h0 with
    a longer system prompt) and submits: the LLM proposer's whole tool loop, without a model."""
    from harness.domains import get_domain

    h0 = get_domain("math").seed_harness()
    source = h0.replace('SYSTEM_PROMPT = "', 'SYSTEM_PROMPT = "Think step by step. ', 1)
    pending = [{"name": "step-by-step", "hypothesis": "a nudge to reason first",
                "changes": "system prompt"}]  # fmt: skip
    script = [
        ("write_file", {"path": "slots/step-by-step/harness.py", "content": source}),
        ("write_file", {"path": "slots/pending.json", "content": json.dumps(pending)}),
        ("submit", {}),
    ]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            turn = sum(m["role"] == "assistant" for m in body["messages"])
            name, args = script[min(turn, len(script) - 1)]
            call = {"id": f"c{turn}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip
            reply = {"id": f"r{turn}", "object": "chat.completion", "created": 0, "model": "loop",
                     "choices": [{"index": 0, "finish_reason": "tool_calls",
                                  "message": {"role": "assistant", "content": None,
                                              "tool_calls": [call]}}],
                     "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}  # fmt: skip
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1", server


def main() -> None:
    a = ARGS.parse_args()
    import jax
    from absl import flags

    from whale_jax import main as cli
    from whale_jax.loop.run import run

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        ckpt = Path(tmp) / "model"
        write_checkpoint(a.config, ckpt)
        made_s = time.monotonic() - t0
        url, server = loopback_proposer()
        run_dir = Path(tmp) / "run"
        argv = ["whale_jax.main", f"--flagfile={REPO / 'experiments' / 'math.flags'}",
                f"--model={ckpt}", f"--run_dir={run_dir}", "--data_dir=", "--proposer=openai",
                "--proposer_model=loopback", f"--proposer_base_url={url}", "--eval_test=false",
                "--eval_validation=false", "--eval_every_epochs=0",
                # A weight step, a harness phase of two iterations (the incoming harness's
                # evaluation and one proposal), a weight step: WHALE ends on a weight phase.
                f"--train_size={a.prompt_batch}", "--epochs=2", "--weight_epochs=1",
                f"--prompt_batch={a.prompt_batch}", f"--samples={a.samples}",
                f"--minibatch_episodes={a.prompt_batch * a.samples}",
                f"--max_new_tokens={a.max_new_tokens}", f"--engine_slots={a.engine_slots}",
                "--engine_cache_rows=0", "--search_size=16", "--harness_iterations=2",
                "--slots=1", "--audit_tasks=1", "--report=false", "--progress=false"]  # fmt: skip
        flags.FLAGS.unparse_flags()
        cli.parse_flags(argv)
        config = cli.config_from_flags()
        lines: list[tuple[float, str]] = []
        t1 = time.monotonic()
        run(config, log=lambda s: lines.append((time.monotonic() - t1, s)) or print(s, flush=True))
        server.shutdown()
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    results = {
        "benchmark": "WHALE loop on an accelerator: math flagfile, random weights, loopback proposer",
        "machine": machine_info(),
        "devices": [str(d) for d in jax.local_devices()],
        "args": vars(a),
        "checkpoint_written_s": round(made_s, 1),
        "log": [(round(t, 1), s) for t, s in lines],
        "rsft": [m for m in metrics if m["kind"] == "rsft"],
        "cost": metrics[-1].get("cost"),
    }
    save_results(results, a.out)
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
