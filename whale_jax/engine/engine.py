"""Continuous batching: a queue of requests, N decode slots, one engine thread.

Callers (any number of threads) ``submit`` a ``Request`` and block on their own future. The engine
thread loops: admit queued requests into the free slots, dispatch a ``generate`` call of up to
``steps`` tokens for all slots, then read the call before it (stop ids, budgets, stop strings) and
park finished session states while the new one runs: pipelined, the host learns of a call's
tokens one call late (``EngineConfig.pipeline``; without it each call is read as it ends). A
finished slot is refilled on the next iteration.

Admission goes through the prefix cache (``prefix_cache.PrefixIndex`` over the device store): each
request continues from the longest kept state its prompt starts with (on attention-only models,
from any prefix of a kept state its prompt runs along) and prefills only the rest, in rounds that
stop at snapshot points (the caller's message boundaries; the branch points of the prompts
admitted together; the depth a prompt shares with a kept one) so the state there is kept for
later requests. A segment that several requests share is computed once; a whole prompt is
kept with its logits, so a later identical prompt (another sample, another vote) samples at once.

Shapes are static: prompt lengths are padded to power-of-two buckets (at least ``min_bucket``, or
``min_resume_bucket`` for a resume's new tokens, at most ``max_len``), prefill and resume batches
to powers of two up to ``prefill_batch`` (split where that would pad over a quarter, or where
the call would take more than ``prompt_bytes``); row moves (insert, park, keeping prefill rows)
always take one size of index arrays, padded past the real entries (padding costs nothing on
device), so they compile once per state shape, not per count. A prefill or resume keeps its
rows in the store and fills slots from them in the same call (``DeviceEngine.prefill``).
``compile_counts`` says how many shapes each jitted function has seen.

A bad request (empty prompt, prompt that does not fit, max_new_tokens <= 0, ids outside the
vocabulary) completes at once with ``finish_reason`` "error" or "prompt_too_long"; nothing else
notices it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future

import jax
import numpy as np

from whale_jax.engine import warmup
from whale_jax.engine.device import (
    DeviceEngine,
    SlotInit,
    cache_bytes_per_slot,
    free_device_bytes,
    max_slots,
    prompt_call_bytes,
)
from whale_jax.engine.prefix_cache import Entry, PrefixIndex, Tokens, branch_points
from whale_jax.engine.requests import Completion, Request, RequestError
from whale_jax.engine.sampling import request_key
from whale_jax.models.transformer import Transformer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    slots: int = 8
    max_len: int = 1024
    # Decode steps per generate call and most rows per prefill or resume call; None: by backend
    # (``BACKEND_DEFAULTS``, resolved by ``resolve``).
    steps: int | None = None
    prefill_batch: int | None = None
    # Device memory one prefill or resume call may take (``device.prompt_call_bytes``): a call
    # whose rows would need more takes fewer (at least one). None: ``PROMPT_SHARE`` of the
    # memory free once the engine's decode state and store are allocated.
    prompt_bytes: int | None = None
    min_bucket: int = 16  # smallest prompt-length bucket of a prefill
    # smallest new-token bucket of a resume (a vote's or a sample's few tokens past a kept prefix)
    min_resume_bucket: int = 4
    min_kv_bucket: int = 64  # smallest KV window a decode call reads
    # KV windows (decode and resume) per doubling: 1 = powers of two (64, 128, 256, ...); 2 adds
    # the halfway sizes (64, 96, 128, 192, 256, ...). A decode step reads every slot's KV up to
    # the window the longest slot needs, so the padding it reads recurs every step (SmolLM2, 64
    # slots, on a CPU: 200 ms a step at 128, 286 at 256); each size is one more shape to compile.
    kv_buckets_per_octave: int = 2
    # New-token buckets of a prefill or resume per doubling, above ``min_bucket`` (below it:
    # powers of two from ``min_resume_bucket``): 2 = 16, 24, 32, 48, 64, 96, ... Every padded
    # position costs what a real one does, and a session turn's ~20 new tokens would pad to 32;
    # each size is one more prefill / resume shape to compile.
    length_buckets_per_octave: int = 2
    max_top_k: int = 64  # width of the exact top-k path (wider top-k falls back to a full sort)
    max_stop_ids: int = 8
    # Decode states kept on device (sessions, prompt prefixes, whole prompts): a row count, or a
    # byte budget (rows = cache_bytes // cache_bytes_per_slot); default: as many rows as slots.
    cache_rows: int | None = None
    cache_bytes: int | None = None
    prefix_cache: bool = True  # False: keep only parked sessions (no snapshots, no whole prompts)
    share_block: int = 16  # shared prefixes found among prompts are cut to whole blocks of this
    # A kept state must save at least this many tokens: a finished session state is parked only
    # if it holds this many beyond the deepest kept state serving it (a vote's few-token reply
    # after its kept prompt is not); a snapshot point is made only this far past where its
    # request starts (a turn's message end just past its parked reply is not, nor a short system
    # prompt); a request resumes from a kept prefix only this long (else it prefills whole: a
    # resume reads a KV window and costs more per token than a fresh prefill). Whole prompts
    # (repeats: no prefill at all) are always kept and served.
    min_kept_tokens: int = 16
    seed: int = 0
    # Decode over per-layer weights (prefill and resume always scan); None = on CPU (DeviceEngine).
    unroll_layers: bool | None = None
    # How decode-state rows move between slots and the store: "loop" (a row at a time, the
    # CPU's), "scatter" (all at once, the accelerators'); None = by backend (DeviceEngine).
    row_moves: str | None = None
    # Read each generate call's tokens one call late: the next call is dispatched first, so the
    # device decodes while the host finishes, parks and admits (JetStream's orchestrator overlaps
    # its threads the same way). False: dispatch, wait, read (the device idles during host work).
    pipeline: bool = True
    # Wait for each call's device work where it is made (admission, decode), so ``timings`` split
    # host from device time; implies no pipelining.
    sync_timings: bool = False


# The engine's defaults that depend on where it runs, in one place. On the CPU (measured: docs/
# benchmarks.md, "Rollouts end to end") prefill batches of 8 and 16 made no difference and a
# call costs little beside its work. On an accelerator a call's fixed cost is what counts (one
# H200, SmolLM2 at 64 slots: ~7.5 ms a generate call of a few steps, ~3.5 ms a prefill of <= 16
# prompts; a prefill batch of 64 took h0 from 21 to 35 % of the bare engine and the vote from
# 7-12 to 14 %): larger prefill calls, and twice the decode steps per call. The accelerators'
# steps are reasoned from that profile, not measured; ``benchmarks/bench_device.py --parts
# knobs`` sweeps both on a lent device.
BACKEND_DEFAULTS = {"cpu": {"steps": 8, "prefill_batch": 8}}
ACCELERATOR_DEFAULTS = {"steps": 16, "prefill_batch": 64}
PROMPT_SHARE = 0.5  # of the free memory, for one prefill or resume call (``prompt_bytes`` None)


def resolve(config: EngineConfig, backend: str | None = None) -> EngineConfig:
    """``config`` with the fields it leaves to the backend (``steps``, ``prefill_batch``) set for
    ``backend`` (default: jax's default backend); ``prompt_bytes`` is set by the ``Engine``,
    which knows the memory left."""
    backend = backend or jax.default_backend()
    defaults = BACKEND_DEFAULTS.get(backend, ACCELERATOR_DEFAULTS)
    fill = {k: v for k, v in defaults.items() if getattr(config, k) is None}
    config = dataclasses.replace(config, **fill)
    for name in ("steps", "prefill_batch"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.prompt_bytes is not None and config.prompt_bytes <= 0:
        raise ValueError(f"prompt_bytes must be positive, got {config.prompt_bytes}")
    return config


@dataclasses.dataclass
class _Job:
    request: Request
    future: Future
    prompt: tuple[int, ...]
    max_new: int
    stop_ids: tuple[int, ...]
    key: np.ndarray
    tokens: list[int] = dataclasses.field(default_factory=list)
    device_tokens: int = 0  # tokens the device sampled (may run past a stop-string cut)
    reused: int = 0
    inflight: int = 0  # generate calls dispatched with this job whose tokens are not read yet
    done: bool = False  # finished (its future is set); later calls' tokens for it are dropped


@dataclasses.dataclass
class _Call:
    """A dispatched generate call: its [slots, steps] tokens (on device until read) and the job
    each slot held when it was dispatched."""

    out: jax.Array
    owners: list[_Job | None]


@dataclasses.dataclass
class _Plan:
    """A request's way through admission: the kept state it continues from (pinned), how many of
    its prompt tokens that state serves (its whole key, or a prefix of it: ``partial``) and the
    token counts where its prefill stops next; the last is the whole prompt."""

    job: _Job
    start: Entry | None
    points: list[int]
    have: int = 0


@dataclasses.dataclass
class _Segment:
    """Tokens ``have:len(key)`` of one or more requests' prompts, computed once from the first
    ``have`` positions of ``start`` (None: from scratch)."""

    key: Tokens
    start: Entry | None
    have: int
    plans: list[_Plan]
    row: int | None = None  # store row to keep the state in
    entry: Entry | None = None

    @property
    def continuing(self) -> bool:
        return any(len(p.job.prompt) > len(self.key) for p in self.plans)


def _bucket(n: int, lo: int, hi: int, per_octave: int = 1) -> int:
    """The smallest size >= n (at most ``hi``) among ``lo * 2**k`` and, with ``per_octave`` p,
    the p - 1 evenly spaced sizes inside each doubling (p = 2: 64, 96, 128, 192, ...)."""
    b = lo
    while True:
        for j in range(per_octave):
            size = b + b * j // per_octave
            if size >= n:
                return min(size, hi)
        b *= 2


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _batches(n: int, most: int) -> list[int]:
    """Sizes of the calls that compute ``n`` segments, at most ``most`` each: a call's rows are
    padded to a power of two, and every padding row costs as much as a real one, so where that
    would pad more than a quarter of the rows the rest goes in smaller calls (10 -> 8 + 2, 5 -> 4
    + 1; 15 -> one call of 16). Each call also reads every weight once, hence not all the way
    down to single rows."""
    sizes = []
    while n:
        size = min(n, most)
        P = _pow2(size)
        if 4 * (P - size) > P:
            size = P // 2
        sizes.append(size)
        n -= size
    return sizes


class Engine:
    """The rollout engine. ``detokenize`` (ids -> text) is needed only for stop strings;
    ``device_lock``, where given, is held around each loop iteration's device work."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig = EngineConfig(),
        *,
        eos_ids: Sequence[int] | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        device_lock: threading.Lock | None = None,
    ):
        self.config = c = resolve(config)
        self.cfg = model.cfg
        self.eos_ids = tuple(self.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.detokenize = detokenize
        # Held around each iteration's device work: an EnginePool over simulated CPU devices
        # gives its engines one lock to take turns (see pool.py).
        self.device_lock = device_lock or contextlib.nullcontext()
        slot_bytes = cache_bytes_per_slot(self.cfg, c.max_len, model.dtype)
        if c.cache_rows is not None and c.cache_bytes is not None:
            raise ValueError("give cache_rows or cache_bytes, not both")
        if c.cache_bytes is not None:
            cache_rows = int(c.cache_bytes // slot_bytes)
        else:
            cache_rows = c.slots if c.cache_rows is None else c.cache_rows
        if cache_rows < 0:
            raise ValueError(f"cache_rows must be >= 0, got {cache_rows}")
        if not 1 <= c.length_buckets_per_octave <= c.min_bucket:
            raise ValueError(f"length_buckets_per_octave must be in 1..min_bucket "
                             f"({c.min_bucket}), got {c.length_buckets_per_octave}")  # fmt: skip
        if not 1 <= c.kv_buckets_per_octave <= c.min_kv_bucket:
            raise ValueError(f"kv_buckets_per_octave must be in 1..min_kv_bucket "
                             f"({c.min_kv_bucket}), got {c.kv_buckets_per_octave}")  # fmt: skip
        self.device = DeviceEngine(
            model,
            slots=c.slots,
            max_len=c.max_len,
            cache_rows=cache_rows,
            steps=c.steps,
            max_top_k=c.max_top_k,
            max_stop_ids=c.max_stop_ids,
            unroll=c.unroll_layers,
            row_moves=c.row_moves,
        )
        self._index = PrefixIndex(
            cache_rows, block=c.share_block, partial=c.prefix_cache and self.device.partial_resume
        )
        self._forgotten: list[str] = []
        self._superseding: list[tuple[str, Tokens]] = []  # (session, its newest prompt)
        self._cv = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: list[_Job | None] = [None] * c.slots
        self._calls: collections.deque[_Call] = collections.deque()  # dispatched, not yet read
        self._pending_params = None
        self._params_requested = 0  # set_params calls so far
        self._params_done = 0  # of them, how many the engine thread has dealt with
        self._swap_error: Exception | None = None
        self.weights_version = 0  # weight swaps that took effect; completions carry it
        self._closed = False
        self._thread: threading.Thread | None = None
        free = free_device_bytes(self.device.home_device)
        if c.prompt_bytes is None:
            # Without a memory figure: room for the biggest call the flags allow.
            budget = (int(free * PROMPT_SHARE) if free is not None else
                      self._call_bytes(_pow2(c.prefill_batch), c.max_len, c.max_len, True))  # fmt: skip
            self.config = c = dataclasses.replace(c, prompt_bytes=max(1, budget))
        self._fits: dict[tuple[int, int, bool], int] = {}
        longest = self._call_bytes(1, c.max_len, c.max_len, False)
        if longest > c.prompt_bytes:
            log.warning("engine: a prefill of one %d-token prompt needs about %.1f MiB, more than "
                        "the %.1f MiB a call may take: the longest prompts may not fit the "
                        "device's memory (lower max_len)", c.max_len, longest / 2**20,
                        c.prompt_bytes / 2**20)  # fmt: skip
        cache_ratio = cache_rows / max(c.slots, 1)
        self.memory = {
            "slot_bytes": slot_bytes,
            "cache_rows": cache_rows,
            "cache_bytes": cache_rows * slot_bytes,
            "free_bytes_after_state": free,
            "more_slots_that_fit": None
            if free is None
            else max_slots(
                self.cfg, c.max_len, free_bytes=free, dtype=model.dtype, cache_ratio=cache_ratio
            ),  # fmt: skip
        }
        log.info("engine: %d slots x %.1f MiB decode state, %d steps a call, prompt calls of at "
                 "most %d rows and %.0f MiB; memory bound %s", c.slots, slot_bytes / 2**20,
                 c.steps, c.prefill_batch, c.prompt_bytes / 2**20, self.memory)  # fmt: skip
        self.stats = collections.Counter()
        self.timings = collections.defaultdict(float)

    # -- public API ------------------------------------------------------------------------------
    def submit(self, request: Request) -> Future:
        """Queues a request; the future resolves to its ``Completion`` (never raises for a bad
        request: the completion carries the error)."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        """Queues several requests at once: the engine thread sees all of them together, so they
        are admitted (and prefilled) in the same batches whatever the thread timing."""
        futures, jobs = [], []
        for request in requests:
            future: Future = Future()
            futures.append(future)
            try:
                jobs.append(self._validate(request, future))
            except RequestError as e:
                future.set_result(Completion(token_ids=(), finish_reason=e.reason, error=str(e),
                                             prompt_tokens=len(request.prompt_ids)))  # fmt: skip
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.extend(jobs)
            self._superseding.extend((j.request.park, j.prompt) for j in jobs if j.request.park)
            self._ensure_thread()
            self._cv.notify_all()
        return futures

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Submits all requests and waits for all completions (in request order)."""
        return [f.result() for f in self.submit_many(requests)]

    def set_params(self, params, *, wait: bool = True) -> int:
        """New weights (an ``nnx.State`` or a model), as a barrier: requests already admitted
        finish on the old weights, nothing new is admitted until they have, then the weights are
        swapped, every parked session state (computed with the old weights) is dropped, and
        ``weights_version`` goes up by one. Queued and later requests run on the new weights only;
        no request ever samples with a mix. Arrays in another layout or dtype (a trainer's fp32
        FSDP shards) are moved device to device into the engine's. Returns the new version (with
        ``wait``, after the swap; else at once, the version it will have)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._pending_params = params
            self._ensure_thread()
            self._cv.notify_all()
            self._params_requested += 1
            target = self._params_requested
            if not wait:
                return self.weights_version + 1
            while self._params_done < target and not self._closed:
                self._cv.wait()
            if self._params_done < target:
                raise RuntimeError("engine closed before the new weights took effect")
            if self._swap_error is not None:
                raise RuntimeError(f"new weights were refused: {self._swap_error}")
            return self.weights_version

    def close(self) -> None:
        for future in self.device.ahead.values():  # a warm-up's compiles not started yet
            future.cancel()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        # The decode state and the store are the engine's big arrays: free them now, not when
        # the last reference to the engine goes (stats and cache_stats stay readable).
        self.device.state = self.device.store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def compile_counts(self) -> dict[str, int]:
        return self.device.compile_counts

    # -- compiling ahead (warmup.py) -------------------------------------------------------------
    def shape_space(self) -> warmup.Shapes:
        """Every signature each jitted step can meet under this engine's configuration, as
        ``DeviceEngine.note`` records it: the buckets ``_compute``, ``_insert_stored``,
        ``_dispatch`` and ``_read`` pad to, over every prompt length the context allows."""
        c, L, B = self.config, self.config.max_len, self.config.slots
        rows = sorted({_pow2(size) for size in range(1, c.prefill_batch + 1)})
        prompt = sorted({self._length_bucket(n, False) for n in range(1, L)})
        new = sorted({self._length_bucket(n, True) for n in range(1, L)})
        kv = sorted({_bucket(n, c.min_kv_bucket, L, c.kv_buckets_per_octave)
                     for n in range(1, L + 1)})  # fmt: skip
        windows = sorted({_bucket(n, c.min_kv_bucket, L) for n in range(1, L)})
        prefill = {((P, T),) for T in prompt for P in rows if P <= self._rows_fit(T, T, False)}
        resume = {((P, T), n) for T in new for n in kv for P in rows
                  if P <= self._rows_fit(T, n, True)}  # fmt: skip
        return {
            "generate": {(B, n) for n in kv},
            "prefill": prefill,
            "resume": resume,
            "insert_stored": {(w, B) for w in windows},
            "park": {(B, w) for w in windows},
        }

    def shape_record(self) -> warmup.Shapes:
        """The shapes this engine's calls met (not those it only compiled ahead): a record for
        a later warm-up."""
        return {name: set(sigs) for name, sigs in self.device.signatures.items()}

    def warm_tasks(self, record: Mapping[str, Iterable] | None = None, *,
                   everything: bool = False) -> tuple[list, int]:  # fmt: skip
        """(compile tasks, shapes of ``record`` outside ``shape_space``) for ``warm_up``: the
        record's shapes, and with ``everything`` all of ``shape_space`` but the resumes (and
        the prefix cache's own steps where it is off); shapes met or warmed before are left
        out."""
        space = self.shape_space()
        wanted: list[tuple[str, tuple]] = []
        unfit = 0
        for name, sigs in (record or {}).items():
            for sig in sigs:
                sig = warmup.as_signature(sig)
                if sig in space.get(name, ()):
                    wanted.append((name, sig))
                else:
                    unfit += 1
        if everything:
            skip = {"resume"} | (set() if self.config.prefix_cache else {"insert_stored"})
            wanted += [(n, sig) for n in warmup.ORDER if n not in skip for sig in space[n]]
        dev = self.device
        tasks, seen = [], set()
        # Decode first (every rollout meets it), then by size: the small shapes come first.
        for name, sig in sorted(wanted, key=lambda w: (warmup.ORDER.index(w[0]), w[1])):
            if (
                (name, sig) in seen
                or sig in dev.signatures.get(name, ())
                or (name, sig) in dev.ahead
            ):
                continue
            seen.add((name, sig))
            tasks.append((dev, name, sig))
        return tasks, unfit

    def warm_up(self, record: Mapping[str, Iterable] | None = None, *, everything: bool = False,
                workers: int | None = None, background: bool = False, on_done=None):  # fmt: skip
        """Compiles ahead the shapes of ``record`` (a run's earlier ``shape_record``) and with
        ``everything`` every shape the configuration allows but the resumes, on ``workers``
        threads (default: half the host's cores, at most 8). Returns the counts once done
        (``warmup.WarmUp.counts``), or with ``background`` a ``warmup.WarmUp`` at once: requests
        may come meanwhile (a shape they need first is compiled for them, never twice)."""
        return warmup.warm([self], record, everything=everything, workers=workers,
                           background=background, on_done=on_done)  # fmt: skip

    def forget(self, name: str) -> None:
        """Drops the state a session parked under ``name`` (the session is over)."""
        with self._cv:
            self._forgotten.append(name)

    def cache_stats(self) -> dict[str, float]:
        """Prefix cache counters so far: prompt tokens requested, computed (prefilled from
        scratch or on top of a kept state) and served from kept states; requests that hit; whole
        prompts served without any prefill; rows and bytes in use; evictions."""
        st = self.stats
        requested = st["prompt_tokens"]
        rows = self._index.rows_in_use()
        return {
            "prompt_tokens": requested,
            "computed_tokens": st["prefill_tokens"] + st["resume_tokens"],
            "cached_tokens": st["cached_tokens"],
            "hit_rate": st["cached_tokens"] / requested if requested else 0.0,
            "requests": st["admitted"],
            "hits": st["cache_hits"],
            "full_hits": st["full_hits"],
            "entries": len(self._index),
            "rows": self._index.rows,
            "rows_in_use": rows,
            "bytes_in_use": rows * self.memory["slot_bytes"],
            "evictions": self._index.evictions,
        }

    # -- validation ------------------------------------------------------------------------------
    def _validate(self, request: Request, future: Future) -> _Job:
        c, s = self.config, request.sampling
        prompt = tuple(map(int, request.prompt_ids))
        if not prompt:
            raise RequestError("empty prompt")
        if s.max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be positive, got {s.max_new_tokens}")
        if len(prompt) >= c.max_len:
            raise RequestError(
                f"prompt of {len(prompt)} tokens does not fit the context of {c.max_len} "
                "(at least one new token must fit)",
                reason="prompt_too_long",
            )
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise RequestError(f"prompt ids outside the vocabulary [0, {self.cfg.vocab_size})")
        stop_ids = tuple(dict.fromkeys((*self.eos_ids, *s.stop_ids)))
        if len(stop_ids) > c.max_stop_ids:
            raise RequestError(f"at most {c.max_stop_ids} stop ids (EOS included)")
        if s.stop_strings and self.detokenize is None:
            raise RequestError("stop strings need an engine built with a detokenizer")
        if not (s.top_p > 0.0 and s.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {s.top_p}")
        max_new = min(s.max_new_tokens, c.max_len - len(prompt))
        key = request_key(c.seed, request.identity)
        return _Job(request, future, prompt, max_new, stop_ids, key)

    # -- the engine thread -----------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="whale-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        depth = 0 if self.config.sync_timings or not self.config.pipeline else 1
        while True:
            with self._cv:
                while not (self._closed or self._queue or self._pending_params is not None
                           or any(self._running) or self._calls):  # fmt: skip
                    self._cv.wait()
                if self._closed:
                    self._fail_all("engine closed")
                    return
                params, requested = None, 0
                idle = not any(self._running) and not self._calls
                if self._pending_params is not None and idle:
                    params, self._pending_params = self._pending_params, None
                    requested = self._params_requested  # later calls overwrote earlier ones
                for name in self._forgotten:
                    self._index.forget(name)
                self._forgotten.clear()
                # A session's next prompt that does not continue its parked state (another vote
                # of the same messages, a rewritten conversation) makes that state useless:
                # drop it now rather than let it push out states that will be read.
                for name, prompt in self._superseding:
                    self._index.supersede(name, prompt)
                self._superseding.clear()
                free = [i for i, j in enumerate(self._running) if j is None]
                if self._pending_params is not None:
                    free = []  # the barrier: drain the running requests on the old weights first
                admitted = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
            try:
                with self.device_lock:
                    if params is not None:
                        self._swap_params(params, requested)
                    if admitted:
                        self._admit(admitted, free)
                    dispatched = self._dispatch()
                    # Pipelined: the call dispatched just now runs while the one before is read.
                    while self._calls and (len(self._calls) > depth or not dispatched):
                        self.stats["late_reads"] += len(self._calls) > 1
                        self._read(self._calls.popleft())
            except Exception as e:  # a device failure fails the requests in flight, not the engine
                log.exception("engine step failed")
                self._calls.clear()
                self._fail_running(f"engine failure: {e!r}", also=admitted)

    def _swap_params(self, params, requested: int) -> None:
        """Runs with no request in a slot. A failed swap (wrong structure or shapes) keeps the old
        weights and version, and the waiting ``set_params`` raises; the engine goes on."""
        try:
            self.device.set_params(params)
            error = None
        except Exception as e:
            log.exception("set_params failed")
            error = e
        with self._cv:
            self._swap_error = error
            if error is None:
                # Every kept state was computed by the old weights.
                self.stats["cache_dropped_on_update"] += self._index.clear()
                self.weights_version += 1
            self._params_done = requested
            self._cv.notify_all()

    def _finish(self, job: _Job, reason: str, *, stop_text_at: int | None = None) -> None:
        job.done = True
        self.stats["completions"] += 1
        self.stats["generated_tokens"] += len(job.tokens)
        job.future.set_result(
            Completion(
                token_ids=tuple(job.tokens),
                finish_reason=reason,
                prompt_tokens=len(job.prompt),
                reused_tokens=job.reused,
                stop_text_at=stop_text_at,
                weights_version=self.weights_version,
            )
        )

    def _fail_running(self, message: str, also: Sequence[_Job] = (), *, fresh: bool = True) -> None:
        """Fails every running job and ``also`` (jobs taken from the queue whose admission may
        not have reached a slot), after starting (``fresh``) from an empty decode state and an
        empty store: a failed call may have consumed the donated store, and left pins behind."""
        failed = [job for job in [*self._running, *also] if job is not None]
        for i in range(len(self._running)):
            self._running[i] = None
        if fresh:
            self.device.state = self.device.empty_state()
            evictions = self._index.evictions
            old = self._index
            self._index = PrefixIndex(old.rows, block=old.block, partial=old.partial)
            self._index.evictions = evictions
            self.device.store = self.device.empty_store()
        for job in failed:
            if not job.future.done():
                job.future.set_result(
                    Completion(
                        token_ids=(),
                        finish_reason="error",
                        error=message,
                        prompt_tokens=len(job.prompt),
                    )  # fmt: skip
                )

    def _fail_all(self, message: str) -> None:
        self._fail_running(message, fresh=False)  # closing: nothing will run again
        while self._queue:
            job = self._queue.popleft()
            job.future.set_result(Completion(token_ids=(), finish_reason="error", error=message))

    # -- admission -------------------------------------------------------------------------------
    def _admit(self, jobs: list[_Job], free: list[int]) -> None:
        """Fills free slots with ``jobs``: through the prefix cache, in rounds (module docstring)."""
        t0 = time.perf_counter()
        c, index = self.config, self._index
        plans: list[_Plan] = []
        for job in jobs:
            start, have = index.lookup(job.prompt) if job.request.cache else (None, 0)
            if have < min(c.min_kept_tokens, len(job.prompt)):  # not worth a resume: prefill
                start, have = None, 0
            if start is not None:
                index.pin(start)
                job.reused = have
            plans.append(_Plan(job, start, [], have))
            self.stats["admitted"] += 1
            self.stats["prompt_tokens"] += len(job.prompt)
        shared = (
            branch_points([p.job.prompt for p in plans if p.job.request.cache], c.share_block)
            if c.prefix_cache else {}
        )  # fmt: skip
        for p in plans:
            prompt, n = p.job.prompt, len(p.job.prompt)
            points: set[int] = set()
            if c.prefix_cache and p.job.request.cache:
                points.update(p.job.request.snapshots)
                points.update(shared.get(prompt, ()))
                points.add(index.shared_depth(prompt))
            # A point only a few tokens past where the request starts (a session turn's end of
            # message just past its parked reply, a short system prompt) is not worth a round
            # and a row of its own: the prompt goes on to its next point in the same call.
            first = p.have + max(1, c.min_kept_tokens)
            p.points = sorted(x for x in points if first <= x < n) + ([n] if p.have < n else [])
        slots = iter(free)
        while plans:
            for p in plans:
                self._catch_up(p)
            ready = [p for p in plans if not p.points]
            if ready:
                self._insert_stored(ready, slots)
            plans = [p for p in plans if p.points]
            if not plans:
                break
            segments = self._segments(plans)
            by_start: dict[bool, list[_Segment]] = {False: [], True: []}
            for seg in segments:
                by_start[seg.start is not None].append(seg)
            for resumed, group in by_start.items():
                group.sort(key=lambda seg: len(seg.key) - seg.have)
                at = 0
                while at < len(group):
                    size = self._call_size(group[at:], resumed)
                    self._compute(group[at : at + size], resumed, slots)
                    at += size
            plans = []
            for seg in segments:
                for p in seg.plans:
                    if p.start is not None:
                        index.unpin(p.start)
                    p.start, p.have = None, 0
                    if len(p.job.prompt) > len(seg.key):
                        assert seg.entry is not None
                        p.start, p.have = seg.entry, len(seg.key)
                        index.pin(seg.entry)
                        p.points.pop(0)
                        plans.append(p)
        if c.sync_timings:
            jax.block_until_ready(self.device.state)
        self.timings["admit_s"] += time.perf_counter() - t0

    def _catch_up(self, p: _Plan) -> None:
        """Moves a plan's start to a kept state at its next point, if one exists by now (made by
        another request of this admission, or already there)."""
        prompt, index = p.job.prompt, self._index
        while p.points and p.job.request.cache:
            key = prompt if p.points[0] == len(prompt) else prompt[: p.points[0]]
            entry = index.get(key)
            if entry is None or (len(key) == len(prompt) and not entry.logits):
                return
            index.pin(entry)
            index.touch(entry)
            if p.start is not None:
                index.unpin(p.start)
            p.start, p.have = entry, len(key)
            p.points.pop(0)
            p.job.reused = max(p.job.reused, len(key))

    def _segments(self, plans: list[_Plan]) -> list[_Segment]:
        """This round's prefills, one per distinct (start, tokens), each with a store row where
        its state is to be kept. A state some request must continue from that gets no row (every
        row pinned) is not kept: those requests skip that point and go further this round."""
        c, index = self.config, self._index
        rows: dict[tuple, int | None] = {}
        while True:
            segments: dict[tuple, _Segment] = {}
            for p in plans:
                end = p.points[0]
                key = p.job.prompt if end == len(p.job.prompt) else p.job.prompt[:end]
                start = None if p.start is None else p.start.row
                ident = (start, p.have, key, p.job.request.cache)
                seg = segments.get(ident)
                if seg is None:
                    seg = segments[ident] = _Segment(key, p.start, p.have, [])
                seg.plans.append(p)
            retry = False
            for ident, seg in segments.items():
                if ident not in rows:
                    if seg.continuing:  # needed now: may displace any unpinned entry
                        rows[ident] = index.alloc()
                    elif c.prefix_cache and seg.plans[0].job.request.cache:  # speculative
                        rows[ident] = index.alloc(evict_hot=False)
                    else:
                        rows[ident] = None
                seg.row = rows[ident]
                if seg.row is None and seg.continuing:
                    for p in seg.plans:
                        if len(p.job.prompt) > len(seg.key):
                            p.points.pop(0)
                    retry = True
            if not retry:
                break
        for ident, row in rows.items():
            if ident not in segments and row is not None:
                index.release(row)
        return list(segments.values())

    def _call_bytes(self, rows: int, new: int, window: int, resumed: bool) -> int:
        # Scatter row moves gather what they keep (the call's rows) and insert (every slot
        # entry) at once; the loop moves a row at a time.
        moved = 0 if self.device.loop_moves else rows + self.config.slots
        return prompt_call_bytes(self.cfg, rows, new, window, self.device.dtype, resume=resumed,
                                 moved=moved)  # fmt: skip

    def _rows_fit(self, new: int, window: int, resumed: bool) -> int:
        """The most rows (a power of two, at most ``prefill_batch``'s, at least one) a call of
        ``new`` padded new tokens over a window of ``window`` may take within ``prompt_bytes``."""
        key = (new, window, resumed)
        if key not in self._fits:
            P = _pow2(self.config.prefill_batch)  # a call's rows pad to a power of two
            while P > 1 and self._call_bytes(P, new, window, resumed) > self.config.prompt_bytes:
                P //= 2
            self._fits[key] = P
        return self._fits[key]

    def _call_shape(self, group: Sequence[_Segment], resumed: bool) -> tuple[int, int]:
        """(padded new tokens, KV window) of the call that computes ``group``: a prefill's
        window is its new tokens."""
        c = self.config
        T = self._length_bucket(max(len(seg.key) - seg.have for seg in group), resumed)
        if not resumed:
            return T, T
        longest = max(len(seg.key) for seg in group)
        return T, _bucket(longest, c.min_kv_bucket, c.max_len, c.kv_buckets_per_octave)

    def _call_size(self, rest: list[_Segment], resumed: bool) -> int:
        """How many of ``rest`` (shortest first) the next call computes: ``_batches``' first
        size under ``prefill_batch``, or the largest smaller one whose call fits
        ``prompt_bytes`` (fewer rows also pad to fewer new tokens, so the short prompts go
        together; a resume's window follows its longest row, which that order does not sort)."""
        most = self.config.prefill_batch
        while True:
            size = _batches(len(rest), most)[0]
            if size == 1 or _pow2(size) <= self._rows_fit(
                *self._call_shape(rest[:size], resumed), resumed
            ):
                return size
            most = size - 1

    def _compute(self, group: list[_Segment], resumed: bool, slots) -> None:
        """One prefill (from scratch) or resume (from kept states) call for a group of segments;
        keeps their states where they have rows and fills the slots of the requests they end."""
        T, kv_len = self._call_shape(group, resumed)
        P = _pow2(len(group))
        tokens = np.zeros((P, T), np.int32)
        n_new = np.zeros((P,), np.int32)
        rows = np.zeros((P,), np.int32)
        start = np.zeros((P,), np.int32)
        for i, seg in enumerate(group):
            tokens[i, : len(seg.key) - seg.have] = seg.key[seg.have :]
            n_new[i] = len(seg.key) - seg.have
            rows[i] = 0 if seg.start is None else seg.start.row
            start[i] = seg.have
        # Where the rows go, in the same call: kept states into their store rows (one size of
        # index arrays per call shape: padding entries cost nothing, compiles do) and the
        # requests the segments end into slots.
        src = np.zeros(P, np.int32)
        dst = np.full(P, self.device.store.logits.shape[0], np.int32)  # past the end: dropped
        kept = [(i, seg) for i, seg in enumerate(group) if seg.row is not None]
        for m, (i, seg) in enumerate(kept):
            src[m], dst[m] = i, seg.row
        ends = [(i, p.job) for i, seg in enumerate(group) for p in seg.plans
                if len(p.job.prompt) == len(seg.key)]  # fmt: skip
        init = self._slot_init(ends, slots)
        if resumed:
            self.device.resume(rows, start, tokens, n_new, kv_len, (src, dst), init)
            self.stats["resumes"] += len(group)
            self.stats["resume_tokens"] += int(n_new.sum())
        else:
            self.device.prefill(tokens, n_new, (src, dst), init)
            self.stats["prefills"] += len(group)
            self.stats["prefill_tokens"] += int(n_new.sum())
        for _, seg in kept:
            assert seg.row is not None
            # A snapshot point (a boundary, a branch point) is kept for prompts to come; a
            # whole prompt only in case it comes again.
            entry = self._index.add(seg.key, seg.row, logits=True, hot=seg.continuing)
            seg.entry = entry or self._index.get(seg.key)

    def _length_bucket(self, n: int, resumed: bool) -> int:
        """The padded new-token length of a prefill or resume of at most ``n`` new tokens."""
        c = self.config
        if n <= c.min_bucket:
            return _bucket(n, c.min_resume_bucket if resumed else c.min_bucket, c.max_len)
        return _bucket(n, c.min_bucket, c.max_len, c.length_buckets_per_octave)

    def _insert_stored(self, ready: list[_Plan], slots) -> None:
        """Requests whose whole prompt is kept with its logits: straight from the store, all in
        one call (an insert always takes ``slots`` entries; these are at most that many)."""
        c = self.config
        window = _bucket(max(len(p.job.prompt) for p in ready), c.min_kv_bucket, c.max_len)
        pairs = []
        for p in ready:
            assert p.start is not None
            pairs.append((p.start.row, p.job))
        self.device.insert(self._slot_init(pairs, slots), window)
        self.stats["full_hits"] += len(ready)
        for p in ready:
            assert p.start is not None
            self._index.unpin(p.start)

    def _slot_init(self, pairs: list[tuple[int, _Job]], slots) -> SlotInit:
        """Slots for ``pairs`` (source row, job), taken from ``slots``: the jobs run there from
        now on. One size for every insert, the slot count (padding is free, compiles not)."""
        E = self.config.max_stop_ids
        B = M = self.config.slots
        init = dict(
            rows=np.zeros(M, np.int32),
            slots=np.full(M, B, np.int32),  # padding entries point past the end: dropped
            max_new=np.zeros(M, np.int32),
            stop_ids=np.full((M, E), -1, np.int32),
            temperature=np.zeros(M, np.float32),
            top_k=np.zeros(M, np.int32),
            top_p=np.ones(M, np.float32),
            key=np.zeros((M, 2), np.uint32),
        )
        for m, (row, job) in enumerate(pairs):
            s = job.request.sampling
            slot = next(slots)
            init["rows"][m], init["slots"][m] = row, slot
            init["max_new"][m] = job.max_new
            init["stop_ids"][m, : len(job.stop_ids)] = job.stop_ids
            init["temperature"][m], init["top_k"][m], init["top_p"][m] = (
                s.temperature, s.top_k, s.top_p,
            )  # fmt: skip
            init["key"][m] = job.key
            self._running[slot] = job
            self.stats["cached_tokens"] += job.reused
            self.stats["cache_hits"] += job.reused > 0
        return SlotInit(**init)

    # -- decode ----------------------------------------------------------------------------------
    def _dispatch(self) -> bool:
        """Dispatches one generate call over the running jobs, unless every one of them is done
        for certain once the calls in flight are (their budget met by those calls' steps)."""
        c = self.config
        jobs = [j for j in self._running if j is not None]
        if not any(j.device_tokens + c.steps * j.inflight < j.max_new for j in jobs):
            return False
        t0 = time.perf_counter()
        # Every running job stays occupied: the device stops a slot on its own (a stop id, its
        # budget), and a call that returned early (requests waiting) drew fewer than its steps.
        occupied = np.array([j is not None for j in self._running])
        # Every slot's length after this call is bounded by its budget and by the steps of the
        # calls in flight and of this one.
        longest = max(len(j.prompt) + min(j.max_new, j.device_tokens + c.steps * (j.inflight + 1))
                      for j in jobs)  # fmt: skip
        kv_len = _bucket(longest, c.min_kv_bucket, c.max_len, c.kv_buckets_per_octave)
        # Requests are waiting: come back as soon as enough slots are free for them (or a
        # fraction of the slots), instead of decoding the rest of the steps with slots idle.
        waiting = 0 if self._pending_params is not None else len(self._queue)
        want = min(waiting, max(1, c.slots // 8))
        min_active = max(0, int(occupied.sum()) - want) if want else 0
        out = self.device.generate(occupied, kv_len, min_active)
        out.copy_to_host_async()
        for j in jobs:
            j.inflight += 1
        self._calls.append(_Call(out, list(self._running)))
        self.stats["generate_calls"] += 1
        self.timings["dispatch_s"] += time.perf_counter() - t0
        return True

    def _read(self, call: _Call) -> None:
        """A generate call's tokens to their jobs (waiting for the device if it is not done):
        stop ids, budgets and stop strings end jobs; finished session states are parked."""
        t0 = time.perf_counter()
        out = np.asarray(call.out)
        t1 = time.perf_counter()
        self.timings["generate_s"] += t1 - t0
        c = self.config
        self.stats["decode_steps"] += int((out >= 0).any(axis=0).sum())  # loop iterations run
        to_park: list[tuple[int, int, str, tuple[int, ...]]] = []
        for slot, job in enumerate(call.owners):
            if job is None:
                continue
            job.inflight -= 1
            if job.done:  # ended by a stop string read from an earlier call
                continue
            drawn = out[slot]
            drawn = drawn[drawn >= 0].tolist()
            self.stats["decode_slot_steps"] += len(drawn)
            job.device_tokens += len(drawn)
            job.tokens.extend(drawn)
            reason, cut_at = None, None
            if job.tokens and job.tokens[-1] in job.stop_ids:
                reason = "stop"
            elif len(job.tokens) >= job.max_new:
                reason = "length"
            if job.request.sampling.stop_strings:
                cut = self._stop_string_cut(job)
                if cut is not None:
                    n_keep, cut_at = cut
                    del job.tokens[n_keep:]
                    reason = "stop"
            if reason is None:
                continue
            self._running[slot] = None
            if job.request.park is not None and job.request.cache:
                # The device fed every drawn token but the last; park only an exact state, and
                # only one that holds enough tokens no kept state serves: a few are cheaper to
                # recompute inside the next turn's resume than a whole row is to copy. (A call
                # dispatched after this one leaves a stopped slot's state as it is.)
                key = job.prompt + tuple(job.tokens[:-1])
                exact = job.device_tokens == len(job.tokens)
                short = exact and len(key) - self._index.served(key) < c.min_kept_tokens
                if short:
                    self.stats["parks_skipped"] += 1
                elif exact and (row := self._index.alloc()) is not None:
                    to_park.append((slot, row, job.request.park, key))
            self._finish(job, reason, stop_text_at=cut_at)
        if to_park:
            M = c.slots  # one size for every park
            slots = np.full(M, 0, np.int32)
            rows = np.full(M, self.device.store.logits.shape[0], np.int32)  # padding: dropped
            for m, (slot, row, _, _) in enumerate(to_park):
                slots[m], rows[m] = slot, row
            window = _bucket(max(len(k) for *_, k in to_park), c.min_kv_bucket, c.max_len)
            self.device.park(slots, rows, window)
            for _, row, name, key in to_park:
                self._index.add(key, row, logits=False, owner=name)
            self.stats["parked"] += len(to_park)
        self.timings["host_s"] += time.perf_counter() - t1

    def _stop_string_cut(self, job: _Job) -> tuple[int, int] | None:
        """(tokens to keep, character offset of the stop string) when a stop string appeared."""
        assert self.detokenize is not None
        text = self.detokenize(job.tokens)
        hits = [(text.find(s), s) for s in job.request.sampling.stop_strings if s]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return None
        at, s = min(hits)
        # The fewest tokens whose text contains the whole stop string.
        lo, hi = 1, len(job.tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if s in self.detokenize(job.tokens[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo, at
