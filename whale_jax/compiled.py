"""Keeping a long process under the kernel's limit on memory mappings.

Each program XLA:CPU compiles maps its machine code into the process as a few small memory regions
(SmolLM2-135M's forward: about 80 per compiled shape), and jax's caches keep every compiled program
alive. Linux lets a process hold at most ``vm.max_map_count`` mappings (65530 by default); past it
the next compile's ``mmap`` fails and XLA dies with a segmentation fault, losing whatever the
process had not saved. A WHALE run compiles new engine programs as harnesses bring new prompt
lengths, and the test suite compiles thousands in one process, so both check between units of work
and drop jax's caches once the process holds half its allowance; programs needed again are
recompiled (seconds).

A check reads ``/proc/self/maps`` (~40 ms at 30k mappings) and acts only when the count is high,
whatever the backend; where ``/proc`` does not exist (not Linux) the guard does nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import jax


def mappings() -> tuple[int, int] | None:
    """(mappings this process holds, the most it may hold); None where /proc is absent."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


class MappingGuard:
    """Drops jax's compiled programs once the process holds more than ``fraction`` of its mapping
    allowance. Mappings a clear cannot free (programs that live objects still hold) raise the next
    trigger by an eighth of the allowance, so a process that stays full is not cleared every time.
    """

    def __init__(self, fraction: float = 0.5, log: Callable[[str], None] | None = None):
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        self.fraction = fraction
        self.log = log
        self.trigger: int | None = None
        self.clears = 0

    def check(self) -> bool:
        """Clear jax's caches if the process is over its trigger; True when it cleared."""
        counts = mappings()
        if counts is None:
            return False
        held, limit = counts
        floor = int(limit * self.fraction)
        if self.trigger is None:
            self.trigger = floor
        if held <= self.trigger:
            return False
        jax.clear_caches()
        gc.collect()
        after = mappings()
        after_held = after[0] if after else held
        self.trigger = max(floor, after_held + limit // 8)
        self.clears += 1
        if self.log is not None:
            self.log(
                f"dropped jax's compiled programs: the process held {held} of {limit} memory "
                f"mappings (vm.max_map_count), {after_held} after; they recompile when next used"
            )
        return True
