"""The benchmarks' thread sampler: samples land in the sampled thread's own frames, split between
where it ran and where it waited, and its CPU time is its own, not the process's."""

import sys
import threading
import time

import pytest

from benchmarks.thread_profile import ThreadSampler


def _spin(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def _idle(event):
    event.wait(10)


def _elsewhere(seconds):
    return _spin(seconds)


def _work(release):
    _spin(0.4)
    _idle(release)  # alive until released: its CPU clock is read before it ends


def test_sampler_splits_a_thread_between_running_and_waiting():
    release = threading.Event()
    worker = threading.Thread(target=_work, args=(release,))
    sampler = ThreadSampler(worker, interval=0.002)
    switch = sys.getswitchinterval()
    process0 = time.process_time()
    sampler.start()  # before the thread starts: it waits for it
    worker.start()
    # Another thread keeps busy meanwhile: none of its frames or CPU time may be counted.
    other = threading.Thread(target=_elsewhere, args=(0.8,))
    other.start()
    time.sleep(0.8)
    assert sys.getswitchinterval() < switch  # lowered while it samples, so it gets the GIL
    with pytest.raises(RuntimeError, match="already started"):
        sampler.start()  # a second start would save the lowered interval as the one to restore
    sampler.stop()
    assert sys.getswitchinterval() == switch
    process_cpu = time.process_time() - process0
    release.set()
    worker.join()
    other.join()
    spin, idle = (
        sampler.inclusive["benchmarks/test_thread_profile.py _spin"],
        sampler.inclusive["benchmarks/test_thread_profile.py _idle"],
    )
    assert sampler.samples > 50
    assert sampler.inclusive["benchmarks/test_thread_profile.py _work"] >= 0.9 * sampler.samples
    # Each half of the thread's wall time draws a good share of the samples (the sampler needs
    # the GIL to look, so the spinning half is undersampled on a busy machine, never absent).
    assert spin >= 0.1 * sampler.samples and idle >= 0.25 * sampler.samples
    assert "benchmarks/test_thread_profile.py _elsewhere" not in sampler.inclusive
    # Its CPU time is its own: at most its spinning half, which shared the GIL with the other
    # spinning thread (~0.2 s of the process's ~0.8 s), and not nothing.
    assert sampler.cpu_s is not None and 0.02 < sampler.cpu_s < 0.7 * process_cpu
    report = sampler.report()
    assert "samples over" in report and "_spin" in report and "_idle" in report
