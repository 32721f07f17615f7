"""The trusted side of a zygote (``harness.sandbox.zygote``): start its launcher as a fresh interpreter, hand
it work, hear when children start and end, kill, and clean up. Used by the executor (one zygote
per harness run) and by the math tool (one zygote per process, shared)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from harness.sandbox import ipc, jail, python_layer

_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the repository
_BOOT = "import sys; sys.path.insert(0, sys.argv[2]); from harness.sandbox.zygote import launcher_main; launcher_main()"
_UID_BLOCK = 1 << 12  # uids per zygote (root mode): distinct across every zygote of this process
_UID_BLOCKS = 1 << 12  # blocks in the reserved range (Policy.uid_base + 2**24 uids)
_uid_lock = threading.Lock()
_uid_blocks: set[int] = set()


class SandboxUnavailable(RuntimeError):
    """The sandbox policy asks for a protection this machine refuses (the message says which and
    which setting accepts the weaker mode)."""


class LoadError(Exception):
    def __init__(self, error: str, violation: str | None, protections: dict[str, str]):
        super().__init__(error)
        self.error, self.violation, self.protections = error, violation, protections


def distinct_uids(policy: jail.Policy) -> bool:
    """Episode processes get their own uid only when the executor is root."""
    return os.geteuid() == 0 and not policy.user_namespace


def check_policy(policy: jail.Policy) -> None:
    if policy.mode == "strict" and not distinct_uids(policy):
        raise SandboxUnavailable(
            "sandbox: a distinct uid per episode process needs the executor to run as root "
            "(unprivileged user namespaces map one uid); run as root, or accept shared uids "
            "with sandbox mode 'shared_uid' (WHALE_SANDBOX=shared_uid or ExecutorConfig.sandbox; "
            "siblings are still separated by seccomp and mount namespaces)"
        )


class Zygote:
    """One sandboxed process tree. ``on_event(kind, msg)`` is called from a reader thread for
    ``started`` and ``exited`` messages and once with ``("dead", {"reason": ...})`` at the end."""

    def __init__(
        self,
        program: str,
        *,
        policy: jail.Policy,
        limits: python_layer.Limits,
        max_children: int,
        on_event: Callable[[str, dict[str, Any]], None],
        source: str = "",
        allowed_imports: tuple[str, ...] = (),
        tools: tuple[str, ...] = (),
        python_layers: bool = True,
        max_frame_bytes: int = ipc.DEFAULT_MAX_FRAME,
        visible: tuple[str, ...] = (),
    ):
        check_policy(policy)
        self.on_event = on_event
        self.ready = threading.Event()
        self.result: dict[str, Any] = {}
        self.dead = False
        self.uid_block = self._take_uid_block() if distinct_uids(policy) else None
        self.workdir = tempfile.mkdtemp(prefix="whale-zygote-")
        os.chmod(self.workdir, 0o755)
        parent, child = socket.socketpair()
        log = open(os.path.join(self.workdir, "zygote.log"), "wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, str(child.fileno()), _ROOT],
                pass_fds=(child.fileno(),),
                cwd=self.workdir,
                env=python_layer.scrubbed_env(self.workdir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            child.close()
            log.close()
        self.chan = ipc.Channel(parent, max_frame=1 << 20)
        base = -1 if self.uid_block is None else policy.uid_base + self.uid_block * _UID_BLOCK
        init = ipc.make(
            "init",
            ipc.EXECUTOR_TO_ZYGOTE,
            program=program,
            source=source,
            allowed_imports=sorted(allowed_imports),
            tools=list(tools),
            limits=limits.to_dict(),
            policy=policy.to_dict(),
            python_layers=python_layers,
            max_frame_bytes=max_frame_bytes,
            uid_base=base,
            max_children=min(max_children, _UID_BLOCK - 1),
            visible=list(visible),
        )
        self.chan.send(init)
        threading.Thread(target=self._read, name=f"zygote-{program}", daemon=True).start()

    @staticmethod
    def _take_uid_block() -> int:
        """A block of uids no other zygote of this process holds; blocks start at a place that
        depends on the pid, so executors in different processes rarely meet (they could not reach
        each other anyway: separate pid and mount namespaces)."""
        with _uid_lock:
            first = (os.getpid() * 97) % _UID_BLOCKS
            block = next(
                b for i in range(_UID_BLOCKS) if (b := (first + i) % _UID_BLOCKS) not in _uid_blocks
            )
            _uid_blocks.add(block)
            return block

    def _read(self) -> None:
        reason = "zygote exited"
        try:
            while True:
                msg = self.chan.recv()
                kind = ipc.check(msg, ipc.ZYGOTE_TO_EXECUTOR)
                if kind in ("ready", "load_error", "jail_error"):
                    self.result = msg
                    self.ready.set()
                else:
                    self.on_event(kind, msg)
        except EOFError:
            pass
        except Exception as e:  # a zygote is trusted code, but its channel is still checked
            reason = f"zygote protocol: {type(e).__name__}: {e}"[:500]
            self.kill()
        finally:
            self.dead = True
            self.ready.set()
            self.on_event("dead", {"reason": reason})

    def wait_ready(self, timeout_s: float) -> dict[str, str]:
        """The protections report; raises LoadError (the harness does not load: probe failed),
        SandboxUnavailable (the machine refuses a protection) or TimeoutError."""
        if not self.ready.wait(timeout_s):
            self.kill()
            raise TimeoutError(f"not ready after {timeout_s:.0f}s")
        kind = self.result.get("t")
        if kind == "ready":
            return dict(self.result["protections"])
        if kind == "load_error":
            r = self.result
            raise LoadError(r["error"], r["violation"], dict(r["protections"]))
        if kind == "jail_error":
            raise SandboxUnavailable(self.result["error"])
        log = self.log_tail()
        raise SandboxUnavailable(f"sandbox process exited before it was ready{log}")

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.workdir, "zygote.log"), "rb") as f:
                text = f.read()[-1500:].decode("utf-8", "replace").strip()
        except OSError:
            return ""
        return f": {text}" if text else ""

    def start(self, key: str, payload: dict[str, Any], fds: tuple[int, ...]) -> None:
        self.chan.send(ipc.make("start", ipc.EXECUTOR_TO_ZYGOTE, key=key, payload=payload,
                                fds=len(fds)), fds=fds)  # fmt: skip

    def stop(self, key: str) -> None:
        try:
            self.chan.send(ipc.make("kill", ipc.EXECUTOR_TO_ZYGOTE, key=key))
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def close(self, grace_s: float = 1.0) -> None:
        try:
            self.chan.send(ipc.make("exit", ipc.EXECUTOR_TO_ZYGOTE))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.proc.wait()
        self.chan.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.uid_block is not None:
            with _uid_lock:
                _uid_blocks.discard(self.uid_block)
            self.uid_block = None
