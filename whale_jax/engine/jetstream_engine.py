"""JetStream's ``engine_api.Engine`` over our model and device functions (the ``jetstream`` extra).

Users who serve with JetStream's orchestrator (its prefill, transfer, generate and detokenize
threads, its gRPC ``Decode`` service) plug our models in here; ``python -m whale_jax.serve
--backend=jetstream`` runs that server. The WHALE loop never uses it: its own ``Engine`` does the
rollouts (prefix cache, sessions, per-request sampling and stop strings, which JetStream's
interface has no room for).

The mapping:
- ``prefill(padded_tokens, true_length)``: one prompt through ``device._prefill`` (padded again to
  our length buckets) -> a ``JetPrefix`` (last-token logits, a small cache, the prompt length).
- ``insert(prefix, state, slot)``: ``device._insert`` of that one row into the slot, with the
  engine's sampling settings, its stop ids and the budget the context leaves.
- ``generate(weights, state)``: ``steps`` decode steps for every slot in one call (``device
  ._generate``) -> ``ResultTokens`` holding per slot its ``steps`` tokens, their validity (a slot
  that stopped draws nothing) and its count of sampled tokens, in one int32 array: one copy to
  the host.

JetStream 0.2.2 is archived, and these are the places where it meets today's stack
(``import_jetstream`` handles them; docs/engine.md, "JetStream"):
- ``jetstream.engine.token_utils`` imports seqio (and with it TensorFlow) for two type names.
  Where seqio is not installed, a module that names them stands in; nothing of seqio's is ever
  called (the tokenizer is ours, through ``build_tokenizer``).
- The orchestrator deletes each inserted prefix with ``jax.tree_map``, which current jax no longer
  has; the generate thread would die and JetStream would kill the process. Its ``delete_pytree``
  is replaced with the same function over ``jax.tree.map``.
- A token request with a ``session_cache`` (so no BOS) reaches ``token_utils.pad_tokens`` as a
  list, which it reads ``.shape`` of: the prefill thread dies and the process with it. The
  function is wrapped to take an array.
- Importing the orchestrator sets the root logger to DEBUG with a stdout handler; both are undone.
- The Driver prepends a BOS id to token requests that carry no ``session_cache``. Our models take
  prompts as token ids exactly as given (a chat template has no BOS), so the tokenizer reports a
  BOS id of -1 and ``prefill`` drops a leading -1: the prompt the model sees is the one sent.
  ``add_bos=True`` uses the model's BOS instead (JetStream's convention).
- Prompt lengths are bucketed by JetStream as powers of two from 16 up to ``max_prefill_length``;
  a longer prompt is cut from the front (with ``true_length`` still its uncut length). ``prefill``
  notices the cut, logs it and continues from the tokens it was given.
- A ``DecodeRequest`` carries no sampling settings: the engine's (``temperature``, ``top_k``,
  ``top_p``) hold for every request; each insert draws from its own RNG key (engine seed, insert
  count).
- ``insert`` is not told a request's ``max_tokens``: the device stops a slot at a stop id or when
  the context is full, and JetStream's detokenize thread ends a request once the slot's count
  passes ``max_tokens``. With ``steps`` > 1 it checks once per call, so a request ends at the last
  whole call within its ``max_tokens`` (a stop id ends it at once); ``steps=1`` returns exactly
  ``max_tokens`` tokens.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import importlib.util
import logging
import sys
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from whale_jax.engine.device import DeviceEngine, Prefix, _generate, _insert, _prefill
from whale_jax.engine.engine import EngineConfig, _bucket
from whale_jax.engine.sampling import request_key
from whale_jax.models.transformer import Transformer
from whale_jax.sharding import on_device

log = logging.getLogger(__name__)

INSTALL = "pip install -e '.[jetstream]' && pip install --no-deps 'google-jetstream==0.2.2'"
NO_BOS = -1  # the BOS id our tokenizer reports unless add_bos: prefill drops it again
PREFILL_LENGTHS = tuple(16 << k for k in range(12))  # JetStream's buckets (token_utils)
BUCKETS = EngineConfig()  # our prompt-length and KV-window buckets: the WHALE engine's defaults


def _seqio_names() -> None:
    """Stand-in ``seqio.vocabularies`` with the two class names JetStream's modules import."""

    class Vocabulary(abc.ABC):  # noqa: B024 (a name to subclass, nothing more)
        """seqio is not installed; JetStream's seqio tokenizers are not available."""

    class SentencePieceVocabulary(Vocabulary):
        def __init__(self, *args, **kwargs):
            raise ImportError("seqio is not installed: whale_jax supplies its own tokenizer")

    package = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    package.vocabularies = vocabularies
    sys.modules.setdefault("seqio", package)
    sys.modules.setdefault("seqio.vocabularies", vocabularies)


def _delete_pytree(tree) -> None:
    """JetStream's ``orchestrator.delete_pytree`` over ``jax.tree.map``."""

    def delete(leaf):
        if isinstance(leaf, jax.Array):
            leaf.delete()

    jax.tree.map(delete, tree)


def _array_tokens(pad_tokens):
    """JetStream's ``pad_tokens`` with its tokens as an array: it reads ``tokens.shape``, which
    the list of a token request with a ``session_cache`` (no BOS to prepend) does not have."""

    def pad(tokens, *args, **kwargs):
        return pad_tokens(np.asarray(tokens, np.int64), *args, **kwargs)

    pad.whale_jax = True
    return pad


def import_jetstream() -> types.SimpleNamespace:
    """JetStream's ``engine_api``, ``orchestrator``, ``token_utils``, ``tokenizer_api``,
    ``tokenizer_pb2`` and gRPC modules, made to run on today's jax without seqio (see the module docstring)."""
    if importlib.util.find_spec("jetstream") is None:
        raise ImportError(f"JetStream is not installed; install the extra: {INSTALL}")
    if importlib.util.find_spec("seqio") is None:
        _seqio_names()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from jetstream.core import orchestrator
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
        from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    orchestrator.delete_pytree = _delete_pytree
    token_utils = orchestrator.token_utils
    if not getattr(token_utils.pad_tokens, "whale_jax", False):
        token_utils.pad_tokens = _array_tokens(token_utils.pad_tokens)
    return types.SimpleNamespace(
        engine_api=engine_api,
        orchestrator=orchestrator,
        token_utils=token_utils,
        tokenizer_api=tokenizer_api,
        tokenizer_pb2=tokenizer_pb2,
        jetstream_pb2=jetstream_pb2,
        jetstream_pb2_grpc=jetstream_pb2_grpc,
    )


js = import_jetstream()


@struct.dataclass
class JetPrefix:
    """A prefill's result: one row (logits [1, V], cache of the padded capacity) and the prompt's
    length (host-side: ``insert`` sets the slot's budget from it without a device read)."""

    prefix: Prefix
    length: int = struct.field(pytree_node=False)


class Weights(NamedTuple):
    """What ``load_params`` returns: the weights, and (``unroll``) their per-group copy that the
    decode loop runs over (``DeviceEngine``)."""

    params: Any
    groups: Any


class Tokenizer(js.tokenizer_api.Tokenizer):
    """JetStream's tokenizer interface over a Hugging Face-style tokenizer (``encode`` /
    ``decode``, as ``whale_jax.load_model`` returns). Text is encoded without special tokens;
    ``stop_tokens`` are the engine's stop ids."""

    def __init__(self, tokenizer, *, stop_ids, bos_id: int, max_prefill_length: int):
        self._tok, self._stop = tokenizer, frozenset(int(i) for i in stop_ids)
        self._bos, self._max_prefill = bos_id, max_prefill_length

    def encode(self, s: str, **kwargs):
        """Padded like a token request (JetStream's ``pad_tokens``), BOS rule included."""
        ids = np.asarray(self._tok.encode(s, add_special_tokens=False), np.int64)
        return js.token_utils.pad_tokens(
            ids, self._bos, self.pad_id, is_bos=kwargs.get("is_bos", True),
            max_prefill_length=self._max_prefill, jax_padding=kwargs.get("jax_padding", True),
        )  # fmt: skip

    def decode(self, token_ids, **kwargs) -> str:
        return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=False)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return min(self._stop) if self._stop else -1

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def stop_tokens(self) -> frozenset[int]:  # read once per slot per call: not copied
        return self._stop


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=7)
def _generate_tokens(graphdef, kv, steps, max_top_k, kv_len, params, groups, state):
    """``device._generate`` for every slot, its [B, steps] ids (-1: none drawn) and the slots'
    counts in JetStream's one array (tokens, validity, length): one call, one copy to the host."""
    occupied_B = jnp.ones(state.count.shape, bool)
    state, out_BS = _generate(graphdef, kv, steps, max_top_k, kv_len, params, groups, state,
                              occupied_B, jnp.int32(0))  # fmt: skip
    valid_BS = (out_BS >= 0).astype(jnp.int32)
    data = jnp.concatenate([jnp.maximum(out_BS, 0), valid_BS, state.count[:, None]], axis=1)
    return state, data


class JetStreamEngine(js.engine_api.Engine):
    """``engine_api.Engine`` for one model on one device (``device``; default: the model's).

    ``slots`` decode slots of ``max_len`` tokens (prompt and completion); ``steps`` decode steps
    per ``generate`` call; sampling (``temperature`` <= 0: greedy) and ``seed`` hold for every
    request; ``stop_ids`` default to the model's EOS ids."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        *,
        slots: int = 8,
        max_len: int = 1024,
        steps: int = 1,
        max_prefill_length: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids=None,
        add_bos: bool = False,
        device=None,
    ):
        if device is not None:
            graphdef, state = nnx.split(model)
            model = nnx.merge(graphdef, jax.device_put(state, device))
        self._dev = DeviceEngine(model, slots=slots, max_len=max_len, cache_rows=0, steps=steps,
                                 hold_state=False)  # fmt: skip
        devices = {d for s in jax.tree.leaves(self._dev.shardings) for d in s.device_set}
        if len(devices) != 1:
            raise ValueError(
                f"a JetStreamEngine runs on one device; the model's weights are on {len(devices)}"
            )
        self.device = devices.pop()
        self.cfg = model.cfg
        longest = max(b for b in PREFILL_LENGTHS if b < max_len)
        if max_prefill_length is None:
            max_prefill_length = longest
        if max_prefill_length not in PREFILL_LENGTHS or max_prefill_length >= max_len:
            raise ValueError(
                f"max_prefill_length must be a power of two from 16 below max_len ({max_len}), "
                f"the lengths JetStream pads prompts to; got {max_prefill_length}"
            )
        if add_bos and self.cfg.bos_token_id is None:
            raise ValueError("add_bos: the model has no BOS token (config bos_token_id)")
        stop = tuple(dict.fromkeys(self.cfg.eos_token_ids if stop_ids is None else stop_ids))
        if len(stop) > self._dev.max_stop_ids:
            raise ValueError(f"at most {self._dev.max_stop_ids} stop ids, got {len(stop)}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self._stop = np.full((1, self._dev.max_stop_ids), -1, np.int32)
        self._stop[0, : len(stop)] = stop
        self._sampling = (np.float32(temperature), np.int32(top_k), np.float32(top_p))
        self._seed, self._inserts = seed, 0
        self._max_prefill = max_prefill_length
        self._tokenizer = Tokenizer(
            tokenizer,
            stop_ids=stop,
            bos_id=self.cfg.bos_token_id if add_bos else NO_BOS,
            max_prefill_length=max_prefill_length,
        )
        self._mesh = Mesh(np.array([self.device]), ("slots",))
        # Host-side bound on each slot's length after the calls so far (prompt + steps per call,
        # at most max_len): each generate call's KV window. Only the generate thread touches it.
        self._bound = np.zeros(slots, np.int64)

    # -- weights, state, shapes ------------------------------------------------------------------
    def load_params(self, *args, **kwargs) -> Weights:
        return Weights(self._dev.params, self._dev.groups)

    def init_decode_state(self, *args, **kwargs):
        self._bound[:] = 0
        return self._dev.empty_state()

    def get_prefix_destination_sharding(self) -> Any:
        return on_device(self.device)

    def get_tokenizer(self):
        return js.tokenizer_pb2.TokenizerParameters(path="whale_jax")

    def build_tokenizer(self, metadata) -> Tokenizer:
        return self._tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self._dev.slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    @property
    def compile_counts(self) -> dict[str, int]:
        return self._dev.compile_counts

    @property
    def signatures(self) -> dict[str, set]:
        """The distinct shapes each step was called with (``DeviceEngine.signatures``)."""
        return self._dev.signatures

    # -- the three steps -------------------------------------------------------------------------
    def prefill(self, *, params: Weights, existing_prefix=None, padded_tokens, true_length: int):
        if existing_prefix is not None:
            raise NotImplementedError("prefill on top of an existing prefix")
        tokens = np.asarray(padded_tokens, np.int64)
        if true_length > tokens.shape[0]:
            log.warning("JetStream cut a prompt of %d tokens to its last %d (max_prefill_length)",
                        true_length, tokens.shape[0])  # fmt: skip
            true_length = tokens.shape[0]
        tokens = tokens[:true_length]
        if tokens.size and tokens[0] == NO_BOS:
            tokens = tokens[1:]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            # JetStream gives an engine no way to refuse a request (an exception in its threads
            # kills the process): out-of-vocabulary ids are logged and clipped into range.
            log.error("a prompt has ids outside the vocabulary [0, %d); clipped",
                      self.cfg.vocab_size)  # fmt: skip
            tokens = np.clip(tokens, 0, self.cfg.vocab_size - 1)
        n = max(int(tokens.size), 1)  # an empty prompt: one pad token (JetStream allows it)
        T = _bucket(n, BUCKETS.min_bucket, self._dev.max_len, BUCKETS.length_buckets_per_octave)
        padded = np.zeros((1, T), np.int32)
        padded[0, : tokens.size] = tokens
        self._dev.note("prefill", padded.shape)
        prefix = _prefill(self._dev.graphdef, params.params, None, padded, np.array([n], np.int32))
        return JetPrefix(prefix, n)

    def insert(self, prefix: JetPrefix, decode_state, slot: int):
        temperature, top_k, top_p = self._sampling
        key = request_key(self._seed, ("jetstream", self._inserts))
        self._inserts += 1
        arrays = {
            "rows": np.zeros(1, np.int32),
            "slots": np.array([slot], np.int32),
            "max_new": np.array([self._dev.max_len - prefix.length], np.int32),
            "stop_ids": self._stop,
            "temperature": np.array([temperature]),
            "top_k": np.array([top_k]),
            "top_p": np.array([top_p]),
            "key": key[None],
        }
        self._bound[slot] = prefix.length
        self._dev.note("insert", 1, prefix.prefix.cache.capacity, 1)
        return _insert(self._dev.kv, self._dev.loop_moves, decode_state, prefix.prefix, arrays)

    def generate(self, params: Weights, decode_state):
        dev = self._dev
        self._bound = np.minimum(self._bound + dev.steps, dev.max_len)
        kv_len = _bucket(int(self._bound.max()), BUCKETS.min_kv_bucket, dev.max_len,
                         BUCKETS.kv_buckets_per_octave)  # fmt: skip
        dev.note("generate", dev.slots, kv_len)
        state, data = _generate_tokens(
            dev.graphdef, dev.kv, dev.steps, dev.max_top_k, kv_len, params.params, params.groups,
            decode_state,
        )  # fmt: skip
        S = dev.steps
        result = js.engine_api.ResultTokens(
            data=data,
            tokens_idx=(0, S),
            valid_idx=(S, 2 * S),
            length_idx=(2 * S, 2 * S + 1),
            samples_per_slot=1,
        )
        return state, result


def make_driver(engines, *, prefill: int = 0, jax_padding: bool = False):
    """JetStream's ``Driver`` over ``engines``: ``prefill`` = 0 runs each interleaved (prefill and
    generate on one engine); otherwise the first ``prefill`` engines prefill and the rest generate
    (disaggregated: prefixes are moved device to device by its transfer threads)."""
    engines = list(engines)
    if prefill:
        if not 0 < prefill < len(engines):
            raise ValueError(
                f"prefill engines: {prefill} of {len(engines)}; need at least one of each"
            )
        prefills, generates = engines[:prefill], engines[prefill:]
    else:
        prefills = generates = engines
    return js.orchestrator.Driver(
        prefill_engines=prefills,
        generate_engines=generates,
        prefill_params=[e.load_params() for e in prefills],
        generate_params=[e.load_params() for e in generates],
        interleaved_mode=not prefill,
        jax_padding=jax_padding,
    )


class _OfflineNote(logging.Filter):
    """Drops the warning JetStream's service logs on every request made without gRPC."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "offline test mode" not in record.getMessage()


class LocalServer:
    """JetStream's Driver and ``Orchestrator`` service in this process, without gRPC (tests,
    benchmarks): ``decode`` sends ``DecodeRequest`` s straight to the service's ``Decode``. One
    event loop lives as long as the server: JetStream's threads post results to the loop a request
    was made on, and a loop closed under them would end the process."""

    def __init__(self, engines, *, prefill: int = 0):
        self.engines = list(engines)
        self.driver = make_driver(self.engines, prefill=prefill)
        self.service = js.orchestrator.LLMOrchestrator(driver=self.driver)
        self._loop = asyncio.new_event_loop()
        self._filter = _OfflineNote()
        logging.getLogger().addFilter(self._filter)

    def decode(self, requests) -> list[list[int]]:
        """Each request's token ids, in order (every request is in flight at once)."""

        async def one(request):
            ids: list[int] = []
            async for response in self.service.Decode(request):
                for sample in response.stream_content.samples:
                    ids.extend(sample.token_ids)
            return ids

        async def every():
            return await asyncio.gather(*(one(r) for r in requests))

        return self._loop.run_until_complete(every())

    def close(self) -> None:
        self.driver.stop()
        self._loop.close()
        logging.getLogger().removeFilter(self._filter)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def token_request(ids, max_tokens: int, session_cache: str = ""):
    """A ``DecodeRequest`` of token ids (the client tokenized)."""
    pb = js.jetstream_pb2
    return pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=list(map(int, ids))),
        max_tokens=max_tokens,
        session_cache=session_cache,
    )


def text_request(text: str, max_tokens: int, session_cache: str = ""):
    """A ``DecodeRequest`` of text (the server tokenizes)."""
    pb = js.jetstream_pb2
    return pb.DecodeRequest(
        text_content=pb.DecodeRequest.TextContent(text=text),
        max_tokens=max_tokens,
        session_cache=session_cache,
    )
