"""Compiling the engine's programs before the first request (``Engine.warm_up``).

Every jitted step of the engine is compiled once per shape it meets (``compile_counts``), and a
compile stops the engine thread, with every slot waiting on it. A warm-up compiles shapes ahead,
from abstract arguments (``DeviceEngine.compile_ahead``), on a pool of threads, before requests
need them or (``WarmUp``, in the background) while the first ones come; a later call with the
same shape runs at once. The shapes come from two places:

- the **record**: the shapes an engine met, saved as JSON (``write_record``). A resumed run reads
  its earlier self's record from the run directory and warms exactly those, in parallel, from
  the persistent compilation cache where it is on (a read per shape instead of a compile);
- the **flags**: ``Engine.shape_space`` enumerates every shape each step can meet under the
  engine's configuration; ``everything=True`` compiles all of it but the resumes, whose grid
  (prompt rows x new-token buckets x KV windows) runs to hundreds of shapes.

A record's shapes are checked against ``shape_space``: one another configuration met (other
slots, context length or buckets) is skipped, never compiled.

The record file, ``engine_shapes.json``::

    {"format": 1, "shapes": {"generate": [[64, 96], ...], "prefill": [[[8, 32]], ...], ...}}

each list entry one signature as ``DeviceEngine.note`` records it (tuples as lists).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from harness.files import write_json

log = logging.getLogger(__name__)

FORMAT = 1
RECORD_FILE = "engine_shapes.json"

Shapes = dict[str, set[tuple]]
# The engine's jitted steps, in the order a warm-up compiles them: decode first (every rollout
# meets it), then what prompts meet.
ORDER = ("generate", "prefill", "insert_stored", "park", "resume")


class RecordError(ValueError):
    """A record file that cannot be read (names the file and what is wrong)."""


def as_signature(value) -> tuple:
    """A signature from JSON (lists) back to the tuples ``DeviceEngine.note`` records; ints
    only."""
    if isinstance(value, list | tuple):
        return tuple(as_signature(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a shape holds ints, not {value!r}")
    return value


def read_record(path: str) -> Shapes | None:
    """The shapes a record file holds (None when there is no file); ``RecordError`` names the
    file and the entry at fault."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: not a shape record ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordError(f"{path}: expected {{'format': {FORMAT}, 'shapes': ...}}")
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        raise RecordError(f"{path}: 'shapes' must map step names to lists of shapes")
    out: Shapes = {}
    for name, sigs in shapes.items():
        if not isinstance(sigs, list):
            raise RecordError(f"{path}: shapes[{name!r}] must be a list")
        try:
            out[name] = {as_signature(s) for s in sigs}
        except TypeError as e:
            raise RecordError(f"{path}: shapes[{name!r}]: {e}") from None
    return out


def write_record(path: str, shapes: Mapping[str, Iterable[tuple]]) -> None:
    """Writes a record atomically (``harness.files``: a reader never sees half a file)."""
    write_json(path, {"format": FORMAT,
                      "shapes": {name: sorted(map(list, sigs)) for name, sigs in shapes.items()}})  # fmt: skip


def merge(*records: Mapping[str, Iterable[tuple]]) -> Shapes:
    """The records' shapes together, of the engine's steps only: a record from an older engine
    lists steps since folded into others (``insert`` and ``store_put``, now inside prefill and
    resume), which would otherwise stay in a run's file for good."""
    out: Shapes = {}
    for record in records:
        for name, sigs in record.items():
            if name in ORDER:
                out.setdefault(name, set()).update(sigs)
    return out


class WarmUp:
    """A warm-up under way: its compiles run on a pool of threads while the caller goes on (the
    executor starting its workers, the first requests queueing). An engine step that meets a
    shape still queued here compiles it itself and the queued compile is dropped; one that meets
    a shape being compiled here waits for it (``DeviceEngine.note``): nothing compiles twice, and
    what the engine needs now never waits behind what it may need later. A compile that fails
    is logged and counted, never raised: a warm-up only saves time.

    ``tasks`` are (DeviceEngine, step name, signature); ``on_done(counts)`` runs once the last
    one has finished (in the thread that finished it)."""

    def __init__(self, tasks: Sequence[tuple], *, workers: int, unfit: int = 0,
                 on_done: Callable[[dict], None] | None = None):  # fmt: skip
        self.total, self.unfit = len(tasks), unfit
        self._t0, self._end = time.perf_counter(), None
        self._lock = threading.Lock()
        self._left, self._failed, self._taken = len(tasks), 0, 0
        self._on_done = on_done
        self._all_done = threading.Event()  # set after on_done has run
        self._futures: list[Future] = []
        pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="whale-warm-up")
        for device, name, sig in tasks:
            future = pool.submit(self._compile, device, name, sig)
            device.ahead[(name, sig)] = future
            self._futures.append(future)
        pool.shutdown(wait=False)  # the threads end once the queue is empty
        for future in self._futures:
            future.add_done_callback(self._finished)
        if not tasks:
            self._complete()

    @staticmethod
    def _compile(device, name: str, sig: tuple) -> bool:
        try:
            device.compile_ahead(name, sig)
        except Exception as e:
            log.warning("warm-up: compiling %s %s failed: %r", name, sig, e)
            return False
        return True

    def _finished(self, future: Future) -> None:
        with self._lock:
            if future.cancelled():
                self._taken += 1
            elif not future.result():
                self._failed += 1
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        self._end = time.perf_counter()
        try:
            if self._on_done is not None:
                self._on_done(self.counts())
        finally:
            self._all_done.set()

    def counts(self) -> dict:
        """compiled (here), failed, taken (compiled by the engine as it met them, before their
        turn came here), unfit (record shapes the configuration cannot meet), left (still to
        compile) and seconds (until the last finished, or so far)."""
        with self._lock:
            left, failed, taken = self._left, self._failed, self._taken
        end = self._end or time.perf_counter()
        return {"compiled": self.total - left - failed - taken, "failed": failed,
                "taken": taken, "unfit": self.unfit, "left": left,
                "seconds": round(end - self._t0, 2)}  # fmt: skip

    def result(self, timeout: float | None = None) -> dict:
        """Waits for every compile and ``on_done`` (or ``timeout`` seconds); the counts."""
        self._all_done.wait(timeout)
        return self.counts()

    def cancel(self) -> None:
        """Drops the compiles not started yet (an engine that closes)."""
        for future in self._futures:
            future.cancel()


def warm(engines: Sequence, record=None, *, everything: bool = False, workers: int | None = None,
         background: bool = False, on_done: Callable[[dict], None] | None = None):  # fmt: skip
    """Every engine's ``warm_tasks`` on one pool of ``workers`` threads (default:
    ``default_workers``). Returns the counts (``WarmUp.counts``) once all are compiled, or with
    ``background`` the ``WarmUp`` at once."""
    tasks, unfit = [], 0
    for engine in engines:
        more, unfit = engine.warm_tasks(record, everything=everything)  # the same for each
        tasks += more
    handle = WarmUp(tasks, workers=workers or default_workers(), unfit=unfit, on_done=on_done)
    return handle if background else handle.result()


def default_workers() -> int:
    """Threads for a warm-up: half the host's cores (the run goes on beside it, and XLA:CPU's
    compiler uses threads of its own), at most 8, at least 1."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))
