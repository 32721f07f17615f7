"""The math tool: model-written Python (numpy and sympy allowed) run in a fresh jailed process per
call, with a wall-clock timeout. No static check applies to it: it is model output, not harness
code, so only the OS layer (``harness.sandbox.jail``) stands between it and the machine.

Calls are forked from one tool zygote per process (``harness.sandbox.zygote``, program ``pytool``) that has
numpy and sympy imported already: a call costs a fork, not an interpreter start and a sympy import.
The jailed process sees the standard library and those packages read-only, a private tmpfs /tmp,
no network, no other process; its stdout and stderr are pipes read here, each capped.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import selectors
import threading
import time
from typing import Any

from harness.sandbox import jail, python_layer
from harness.sandbox.supervisor import Zygote


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonToolConfig:
    timeout_s: float = 30.0  # the reference's code_interpreter: 30 s
    limits: python_layer.Limits = python_layer.Limits(
        memory_bytes=2 << 30, cpu_s=30, output_bytes=8 << 10
    )
    max_parallel: int = 2  # processes at once, whatever the number of episodes
    sandbox: jail.Policy = dataclasses.field(default_factory=jail.Policy)  # mode read when made
    start_timeout_s: float = 120.0  # the tool zygote's start (imports sympy once)


class _Pool:
    """One tool zygote per configuration, restarted if it dies; calls wait for their exit."""

    def __init__(self, config: PythonToolConfig):
        self.config = config
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(config.max_parallel)
        self.zygote: Zygote | None = None
        self.exits: dict[str, tuple[threading.Event, list[str]]] = {}
        self.keys = itertools.count()
        self.protections: dict[str, str] = {}

    def _on_event(self, z: Zygote, kind: str, msg: dict[str, Any]) -> None:
        if kind == "exited":
            waiter = self.exits.get(msg["key"])
            if waiter is not None:
                waiter[1].append(str(msg["status"]))
                waiter[0].set()
        elif kind == "dead":
            for event, box in list(self.exits.values()):
                box.append("dead")
                event.set()

    def zygote_ready(self) -> Zygote:
        with self.lock:
            if self.zygote is None or self.zygote.dead:
                if self.zygote is not None:
                    self.zygote.close(grace_s=0.0)
                box: list[Zygote] = []
                z = Zygote(
                    "pytool",
                    policy=self.config.sandbox,
                    limits=self.config.limits,
                    max_children=self.config.max_parallel,
                    on_event=lambda kind, msg: self._on_event(box[0], kind, msg),
                )
                box.append(z)
                try:
                    self.protections = z.wait_ready(self.config.start_timeout_s)
                except BaseException:
                    z.close(grace_s=0.0)
                    raise
                self.zygote = z
            return self.zygote

    def run(self, code: str) -> dict[str, str]:
        cfg = self.config
        with self.slots:
            z = self.zygote_ready()
            key = f"c{next(self.keys)}"
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            event, box = threading.Event(), []
            self.exits[key] = (event, box)
            try:
                try:
                    z.start(key, {"code": code}, (out_w, err_w))
                finally:
                    os.close(out_w)
                    os.close(err_w)
                outputs, timed_out = _read_pipes(
                    (out_r, err_r), cfg.limits.output_bytes, cfg.timeout_s
                )
                if timed_out:
                    z.stop(key)
                event.wait(5.0 if not timed_out else 10.0)
            finally:
                self.exits.pop(key, None)
                os.close(out_r)
                os.close(err_r)
        stdout, stderr = outputs
        status = box[0] if box else "unknown"
        if timed_out:
            return {"status": "timeout", "stdout": stdout, "stderr": stderr}
        if status.lstrip("-").isdigit():
            raw = int(status)
            if os.WIFEXITED(raw) and os.WEXITSTATUS(raw) == 0:
                return {"status": "ok", "stdout": stdout, "stderr": stderr}
            if os.WIFSIGNALED(raw):
                import signal

                name = signal.Signals(os.WTERMSIG(raw)).name
                return {
                    "status": "killed",
                    "stdout": stdout,
                    "stderr": stderr + f"\n[killed by {name}]",
                }
            return {"status": "error", "stdout": stdout, "stderr": stderr}
        return {"status": "killed", "stdout": stdout, "stderr": stderr + "\n[sandbox restarted]"}

    def close(self) -> None:
        with self.lock:
            if self.zygote is not None:
                self.zygote.close()
                self.zygote = None


def _read_pipes(fds: tuple[int, int], cap: int, timeout_s: float) -> tuple[tuple[str, str], bool]:
    """Read both pipes to EOF (or the deadline), keeping ``cap`` bytes of each."""
    bufs = {fd: bytearray() for fd in fds}
    over = {fd: False for fd in fds}
    sel = selectors.DefaultSelector()
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    open_fds = set(fds)
    timed_out = False
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(left):
            data = os.read(key.fd, 1 << 16)
            if not data:
                sel.unregister(key.fd)
                open_fds.discard(key.fd)
            elif len(bufs[key.fd]) <= cap:
                bufs[key.fd] += data
            else:
                over[key.fd] = True
    sel.close()

    def text(fd: int) -> str:
        t = bytes(bufs[fd][:cap]).decode("utf-8", errors="replace")
        return t + ("\n[output truncated]" if over[fd] or len(bufs[fd]) > cap else "")

    return (text(fds[0]), text(fds[1])), timed_out


_pools: dict[PythonToolConfig, _Pool] = {}
_pools_lock = threading.Lock()


@atexit.register
def _close_pools() -> None:
    with _pools_lock:
        for p in _pools.values():
            p.close()


def pool(config: PythonToolConfig) -> _Pool:
    with _pools_lock:
        if config not in _pools:
            _pools[config] = _Pool(config)
        return _pools[config]


def run_python(code: str, config: PythonToolConfig | None = None) -> dict[str, str]:
    """Returns {"status": ok | error | timeout | killed, "stdout", "stderr"}."""
    return pool(config or PythonToolConfig()).run(code)
