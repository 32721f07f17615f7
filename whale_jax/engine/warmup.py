"""Compiling the engine's programs before the first request (``Engine.warm_up``).

Every jitted step of the engine is compiled once per shape it meets (``compile_counts``), and a
compile stops the engine thread, with every slot waiting on it. A warm-up compiles shapes ahead,
from abstract arguments (``DeviceEngine.compile_ahead``), on a pool of threads, before the run
sends anything; a later call with the same shape runs at once. The shapes come from two places:

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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

FORMAT = 1
RECORD_FILE = "engine_shapes.json"

Shapes = dict[str, set[tuple]]
# The engine's jitted steps, in the order a warm-up compiles them: decode first (every rollout
# meets it), then what prompts meet.
ORDER = ("generate", "prefill", "insert", "store_put", "insert_stored", "park", "resume")


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
    """Writes a record atomically (a reader never sees half a file)."""
    body = {"format": FORMAT,
            "shapes": {name: sorted(map(list, sigs)) for name, sigs in sorted(shapes.items())}}  # fmt: skip
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def merge(*records: Mapping[str, Iterable[tuple]]) -> Shapes:
    out: Shapes = {}
    for record in records:
        for name, sigs in record.items():
            out.setdefault(name, set()).update(sigs)
    return out


def compile_all(
    tasks: Sequence[tuple[Callable[[str, tuple], None], str, tuple]],
    *,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Runs ``compile(name, signature)`` for every task on ``workers`` threads (XLA compiles
    outside the GIL; tracing and lowering hold it). A compile that fails is logged and counted,
    never raised: a warm-up only saves time. ``progress(done, total)`` after each."""
    t0 = time.perf_counter()
    failed, done = [], 0

    def one(task):
        compile_, name, sig = task
        try:
            compile_(name, sig)
        except Exception as e:
            log.warning("warm-up: compiling %s %s failed: %r", name, sig, e)
            return (name, sig)
        return None

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="whale-warm-up") as pool:
        for result in pool.map(one, tasks):
            done += 1
            if result is not None:
                failed.append(result)
            if progress is not None:
                progress(done, len(tasks))
    return {"compiled": len(tasks) - len(failed), "failed": len(failed),
            "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip


def warm(engines: Sequence, record=None, *, everything: bool = False, workers: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> dict:  # fmt: skip
    """Every engine's ``warm_tasks`` on one pool of ``workers`` threads (default: the host's
    cores, at most 8); the counts of ``compile_all`` and the record's shapes the engines'
    configuration cannot meet (``unfit``)."""
    tasks, unfit = [], 0
    for engine in engines:
        more, unfit = engine.warm_tasks(record, everything=everything)  # the same for each
        tasks += more
    result = compile_all(tasks, workers=workers or default_workers(), progress=progress)
    return {**result, "unfit": unfit}


def default_workers() -> int:
    """Threads for a warm-up: the host's cores, at most 8 (each compile also uses threads of
    its own)."""
    return max(1, min(8, os.cpu_count() or 1))
