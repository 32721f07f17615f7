"""Serve a model over gRPC: ``python -m whale_jax.serve --backend=jetstream --model=DIR``.

``--backend=jetstream`` runs JetStream's orchestrator (prefill, transfer, generate and detokenize
threads) and its ``Orchestrator`` gRPC service (``Decode``, ``HealthCheck``) over our model and
device functions (``whale_jax.engine.jetstream_engine``); it needs the ``jetstream`` extra. The
server listens on ``--host`` (loopback by default: JetStream's own server binds every interface)
and prints ``serving on HOST:PORT`` once it accepts requests (``--port=0`` picks a free port).
SIGINT or SIGTERM stop it: requests in flight get a few seconds to finish, then the
orchestrator's threads are stopped.

Layouts (``--devices`` local devices, one engine on each): ``--prefill_devices=0`` runs every
engine interleaved (prefill and generate on one device); ``--prefill_devices=K`` prefills on the
first K devices and generates on the rest (disaggregated; prefixes move device to device).
Every request is sampled with the server's settings (``--temperature``, ``--top_k``,
``--top_p``, ``--seed``): JetStream's ``DecodeRequest`` has no sampling fields. docs/engine.md,
"JetStream", has the mapping and when to choose it over the WHALE engine.
"""

from __future__ import annotations

import asyncio
import signal

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("backend", "jetstream", ["jetstream"], "Server: jetstream (JetStream's "
                  "orchestrator and gRPC service; the `jetstream` extra).")  # fmt: skip
flags.DEFINE_string("model", "smollm2", "Checkpoint: directory, .gguf, hub id, or smollm2. It "
                    "must ship its tokenizer (text requests are tokenized by the server).")  # fmt: skip
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations.")
flags.DEFINE_integer("slots", 8, "Decode slots per generate engine (requests decoded at once).")
flags.DEFINE_integer("max_len", 1024, "Tokens per slot: prompt and completion.")
flags.DEFINE_integer("steps", 1, "Decode steps per generate call; with more than 1, a request "
                     "ends at the last whole call within its max_tokens.")  # fmt: skip
flags.DEFINE_integer("max_prefill_length", 0, "Longest prompt, a power of two from 16 below "
                     "--max_len (0: the largest); longer prompts lose their first tokens.")  # fmt: skip
flags.DEFINE_float("temperature", 0.0, "Sampling temperature for every request (<= 0: greedy).")
flags.DEFINE_integer("top_k", 0, "Top-k for every request (0: off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling for every request (1: off).")
flags.DEFINE_integer("seed", 0, "Sampling seed (each insert draws from its own key).")
flags.DEFINE_bool("add_bos", False, "Prepend the model's BOS to requests without a "
                  "session_cache (JetStream's convention); off: prompts as sent.")  # fmt: skip
flags.DEFINE_integer("devices", 1, "Local devices to use, one engine on each.")
flags.DEFINE_integer("prefill_devices", 0, "0: every engine interleaved; K: the first K devices "
                     "prefill, the rest generate.")  # fmt: skip
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 or [::]: every interface).")
flags.DEFINE_integer("port", 9000, "Port to listen on (0: a free one, printed at start).")


async def serve(driver, host: str, port: int) -> None:
    """JetStream's ``Orchestrator`` service over ``driver`` on ``host:port`` until SIGINT or
    SIGTERM."""
    import grpc

    from whale_jax.engine.jetstream_engine import js

    server = grpc.aio.server()
    js.jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
        js.orchestrator.LLMOrchestrator(driver=driver), server
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpc raises where the address cannot be bound
        raise SystemExit(f"--host/--port: cannot listen on {host}:{port} ({e})") from None
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving on {host}:{bound}", flush=True)
    await stop.wait()
    await server.stop(grace=5)
    driver.stop()  # inside the loop: the driver's last results still reach their channels


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax
    import jax.numpy as jnp

    from whale_jax.engine.jetstream_engine import JetStreamEngine, make_driver
    from whale_jax.io.load import load_model

    local = jax.local_devices()
    if not 1 <= FLAGS.devices <= len(local):
        raise app.UsageError(f"--devices={FLAGS.devices}: this host has {len(local)}")
    if not 0 <= FLAGS.prefill_devices < FLAGS.devices:
        raise app.UsageError(f"--prefill_devices={FLAGS.prefill_devices}: must leave at least one "
                             f"of --devices={FLAGS.devices} to generate")  # fmt: skip
    dtype = jnp.bfloat16 if FLAGS.dtype == "bfloat16" else jnp.float32
    model, cfg, tokenizer = load_model(FLAGS.model, dtype)
    if tokenizer is None:
        raise app.UsageError(f"--model={FLAGS.model}: the checkpoint ships no tokenizer; the "
                             "server needs one to answer text requests")  # fmt: skip
    if len(tokenizer) > cfg.vocab_size:
        raise app.UsageError(f"--model={FLAGS.model}: its tokenizer has {len(tokenizer)} ids, "
                             f"more than the model's vocabulary of {cfg.vocab_size}")  # fmt: skip
    try:
        # One engine per device, each with its own copy of the weights.
        engines = [JetStreamEngine(
            model, tokenizer, device=device, slots=FLAGS.slots, max_len=FLAGS.max_len,
            steps=FLAGS.steps, max_prefill_length=FLAGS.max_prefill_length or None,
            temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
            seed=FLAGS.seed, add_bos=FLAGS.add_bos,
        ) for device in local[: FLAGS.devices]]  # fmt: skip
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    driver = make_driver(engines, prefill=FLAGS.prefill_devices)
    asyncio.run(serve(driver, FLAGS.host, FLAGS.port))


if __name__ == "__main__":
    app.run(main)
