"""Where one thread's wall time goes, by sampling its stack, and how much of it the thread ran.

cProfile cannot say this for one thread of many: on Python 3.12+ it hooks ``sys.monitoring``,
which fires in every thread, and its timer then mixes the threads' clocks (negative times). A
sampler reads the thread's current frame (``sys._current_frames``) every ``interval`` seconds from
a thread of its own: a sample lands where the thread runs *or waits* (a blocking call, the GIL,
the device), so the counts split its wall time. The thread's CPU time, read from its own clock
(``time.pthread_getcpuclockid``, Linux and macOS), says how much of that wall it ran.

The sampler needs the GIL to look. While it samples it lowers the interpreter's switch interval
(``sys.setswitchinterval``, 5 ms by default) to a quarter of the sampling interval and restores it
on ``stop``: at 5 ms, threads that keep the GIL busy (the sampled one, or any other) starve the
sampler, so a running thread draws far fewer samples than its wall time and the split is biased.

    sampler = ThreadSampler(thread)      # before or after the thread starts
    sampler.start(); ...; sampler.stop()
    print(sampler.report())
"""

from __future__ import annotations

import collections
import sys
import threading
import time


class ThreadSampler:
    def __init__(self, thread: threading.Thread, interval: float = 0.001):
        self.thread, self.interval = thread, interval
        self.samples = 0
        self.own: collections.Counter[str] = collections.Counter()  # the innermost frame
        self.inclusive: collections.Counter[str] = collections.Counter()  # any frame of a stack
        self.cpu_s: float | None = None
        self.wall_s = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._clock: int | None = None
        self._cpu0 = 0.0
        self._switch: float | None = None  # the switch interval to restore on stop

    def start(self) -> None:
        if self._sampler is not None:
            raise RuntimeError("ThreadSampler.start: already started (one sampler, one run)")
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, self.interval / 4))
        self._sampler = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self._sampler.start()

    def stop(self) -> None:
        """Stops sampling and reads the thread's CPU time (call while the thread still lives:
        its clock goes with it)."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
        if self._clock is not None:
            try:
                self.cpu_s = time.clock_gettime(self._clock) - self._cpu0
            except OSError:  # the thread has ended
                self.cpu_s = None

    def _run(self) -> None:
        while self.thread.ident is None and not self._stop.is_set():  # not started yet
            time.sleep(self.interval)
        ident = self.thread.ident
        if ident is not None and hasattr(time, "pthread_getcpuclockid"):
            try:
                self._clock = time.pthread_getcpuclockid(ident)
                self._cpu0 = time.clock_gettime(self._clock)
            except OSError:
                self._clock = None
        t0 = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(ident)
            if frame is None:
                if not self.thread.is_alive():
                    break
                continue
            self.samples += 1
            self.own[_where(frame, line=True)] += 1
            seen = set()
            while frame is not None:
                name = _where(frame, line=False)
                if name not in seen:  # recursion counts a function once per sample
                    seen.add(name)
                    self.inclusive[name] += 1
                frame = frame.f_back
        self.wall_s = time.perf_counter() - t0

    def report(self, top: int = 25) -> str:
        n = max(self.samples, 1)
        cpu = "unknown" if self.cpu_s is None else f"{self.cpu_s:.2f} s"
        lines = [f"{self.samples} samples over {self.wall_s:.2f} s; the thread's CPU time {cpu}",
                 f"innermost frame (where it ran or waited), top {top}:"]  # fmt: skip
        lines += [f"  {c / n:6.1%}  {where}" for where, c in self.own.most_common(top)]
        lines.append(f"on the stack (inclusive), top {top}:")
        lines += [f"  {c / n:6.1%}  {where}" for where, c in self.inclusive.most_common(top)]
        return "\n".join(lines)


def _where(frame, line: bool) -> str:
    code = frame.f_code
    parts = code.co_filename.replace("\\", "/").split("/")
    short = "/".join(parts[-2:])
    name = getattr(code, "co_qualname", code.co_name)
    return f"{short}:{frame.f_lineno} {name}" if line else f"{short} {name}"
