"""``EnginePool``: one ``Engine`` per local device behind the interface of one.

Rollouts are data parallel over the host's chips: the slots are split evenly over the devices,
each device holds its own copy of the weights, its own decode state and its own prefix cache,
and each engine's thread drives its device on its own. A request that continues a session (its
``park`` name) goes to the engine that parked the session's state; any other request goes to the
engine with the fewest requests in flight. Which engine samples a request never changes its
tokens: a request's sampling is fixed by its identity and the engine seed, not by its slot or
its neighbours (tests/engine/test_pool.py checks it against one engine).

Why one engine per device rather than weights split over devices (tensor parallel): the decode
step of a 2B/4B model reads its weights once per step, and at WHALE's batch (256 prompts x 8
samples) the KV cache, not the weights, fills a chip; replicated weights need no collective per
layer, and every engine's program is the single-device one the rest of the engine is tested
with. The cost is a compile per device for each shape (XLA executables are bound to their
device) and a copy of the weights per device. docs/engine.md, "On every local device", has the
layouts for v4-8, v5e-8 and 8 x H100 and where tensor parallel would be needed instead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import jax
from flax import nnx

from whale_jax.engine import warmup
from whale_jax.engine.engine import Engine, EngineConfig
from whale_jax.engine.requests import Completion, Request
from whale_jax.models.transformer import Transformer


def split_evenly(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} does not split evenly over {parts} devices")
    return total // parts


class EnginePool:
    """``Engine``'s interface over one engine per device in ``devices``. ``config.slots`` and
    ``config.cache_rows`` are the pool's totals, split evenly (each must divide by the number of
    devices)."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        devices: Sequence[Any],
        *,
        eos_ids: Sequence[int] | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ):
        if not devices:
            raise ValueError("an engine pool needs at least one device")
        self.config, self.cfg, self.devices = config, model.cfg, tuple(devices)
        n = len(self.devices)
        # Simulated CPU devices share one XLA:CPU client and its host threads. With a call in
        # flight on each of several engines while the next was dispatched it deadlocked (every
        # engine thread waiting on a result that never came, 4 devices on 2 cores), and even with
        # each call read as it ends, engines running at once hung now and then (1 run in 3-6 of
        # the 4-device pool test). There the engines take turns: each reads its calls as they end,
        # under one lock held around an iteration's admission, call and read, so no program is
        # in flight outside it. Accelerators keep the pipeline and run freely.
        shares_cpu = n > 1 and self.devices[0].platform == "cpu"
        per = dataclasses.replace(
            config,
            slots=split_evenly(config.slots, n, "engine slots"),
            cache_rows=None
            if config.cache_rows is None
            else split_evenly(config.cache_rows, n, "engine cache rows"),
            cache_bytes=None if config.cache_bytes is None else config.cache_bytes // n,
            pipeline=config.pipeline and not shares_cpu,
        )
        turns = threading.Lock() if shares_cpu else None
        graphdef, state = nnx.split(model)
        self.engines = [
            Engine(nnx.merge(graphdef, jax.device_put(state, d)), per, eos_ids=eos_ids,
                   detokenize=detokenize, device_lock=turns)
            for d in self.devices
        ]  # fmt: skip
        # The pool's totals, with what each engine resolved for its backend and memory.
        resolved = self.engines[0].config
        self.config = dataclasses.replace(config, steps=resolved.steps,
                                          prefill_batch=resolved.prefill_batch,
                                          prompt_bytes=resolved.prompt_bytes)  # fmt: skip
        self.eos_ids = self.engines[0].eos_ids
        self._lock = threading.Lock()
        self._in_flight = [0] * n
        self._owner: dict[str, int] = {}  # park name -> the engine that holds its state

    # -- routing ---------------------------------------------------------------------------------
    def _route(self, request: Request) -> int:
        name = request.park
        if name is not None and name in self._owner:
            return self._owner[name]
        i = min(range(len(self.engines)), key=lambda k: (self._in_flight[k], k))
        if name is not None:
            self._owner[name] = i
        return i

    def _done(self, i: int) -> Callable[[Future], None]:
        def finished(_: Future) -> None:
            with self._lock:
                self._in_flight[i] -= 1

        return finished

    # -- Engine's interface ----------------------------------------------------------------------
    def submit(self, request: Request) -> Future:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        """Each request to its engine; those for one engine are queued together (as
        ``Engine.submit_many``: admitted in the same batches)."""
        with self._lock:
            chosen = []
            for r in requests:
                i = self._route(r)
                self._in_flight[i] += 1
                chosen.append(i)
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for k, i in enumerate(chosen):
            groups[i].append(k)
        futures: list[Future | None] = [None] * len(requests)
        for i, ks in groups.items():
            for k, f in zip(
                ks, self.engines[i].submit_many([requests[k] for k in ks]), strict=True
            ):
                f.add_done_callback(self._done(i))
                futures[k] = f
        return futures  # type: ignore[return-value]

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return [f.result() for f in self.submit_many(requests)]

    def set_params(self, params, *, wait: bool = True) -> int:
        """Every engine's ``set_params`` (each a barrier on its own device), at once; the pool's
        version is theirs (they move together). The weights are copied to each device here, one
        device after another: jax's move of one sharded array to several devices at once from
        several threads is not safe (jax 0.10: a shard count mismatch)."""
        if isinstance(params, nnx.Module):
            _, params = nnx.split(params)
        copies = [jax.device_put(params, e.device.shardings) for e in self.engines]
        with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
            versions = list(pool.map(lambda ec: ec[0].set_params(ec[1], wait=wait),
                                     zip(self.engines, copies, strict=True)))  # fmt: skip
        if len(set(versions)) != 1:
            raise RuntimeError(f"the engines' weight versions diverged: {versions}")
        return versions[0]

    @property
    def weights_version(self) -> int:
        return min(e.weights_version for e in self.engines)

    def forget(self, name: str) -> None:
        with self._lock:
            i = self._owner.pop(name, None)
        if i is not None:
            self.engines[i].forget(name)

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def compile_counts(self) -> dict[str, int]:
        return dict(sum((collections.Counter(e.compile_counts) for e in self.engines),
                        collections.Counter()))  # fmt: skip

    def shape_record(self) -> dict[str, set]:
        """The shapes the engines met (one record: each engine has the same configuration)."""
        return warmup.merge(*(e.shape_record() for e in self.engines))

    def warm_up(self, record=None, *, everything: bool = False, workers: int | None = None,
                background: bool = False, on_done=None):  # fmt: skip
        """``Engine.warm_up`` for every engine (a program compiles once per device), all on one
        pool of ``workers`` threads."""
        return warmup.warm(self.engines, record, everything=everything, workers=workers,
                           background=background, on_done=on_done)  # fmt: skip

    @property
    def stats(self) -> collections.Counter:
        return sum((e.stats for e in self.engines), collections.Counter())

    @property
    def memory(self) -> dict[str, Any]:
        """Engine 0's memory report (each device holds the same), with the device count."""
        return {**self.engines[0].memory, "devices": len(self.engines),
                "cache_rows": sum(e.memory["cache_rows"] for e in self.engines)}  # fmt: skip

    def cache_stats(self) -> dict[str, float]:
        each = [e.cache_stats() for e in self.engines]
        total = {k: sum(s[k] for s in each) for k in each[0] if k != "hit_rate"}
        requested = total["prompt_tokens"]
        total["hit_rate"] = total["cached_tokens"] / requested if requested else 0.0
        return total
