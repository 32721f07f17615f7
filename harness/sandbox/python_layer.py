"""The Python-level layer of the sandbox and the limits it shares with the OS layer
(``harness.sandbox.jail``): resource limits, the scrubbed environment of a sandboxed process, and the audit
hook, an early and readable refusal of sockets, processes, native code and file access. The wall
that holds when this layer is bypassed is the OS one."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

# Set by the parent: the rest of the parent's environment never reaches a sandboxed process.
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    memory_bytes: int = 2 << 30  # RLIMIT_AS
    cpu_s: int = 600  # RLIMIT_CPU (the process's total; wall-clock timeouts are the parent's)
    open_files: int = 64  # RLIMIT_NOFILE
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    output_bytes: int = 64 << 10  # captured stdout+stderr kept per episode / tool call

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def scrubbed_env(workdir: str) -> dict[str, str]:
    """A minimal environment: no credentials, no PYTHON* variables, single-threaded numeric libs."""
    env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update(
        HOME=workdir,
        TMPDIR=workdir,
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONHASHSEED="0",
        OPENBLAS_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        MALLOC_ARENA_MAX="2",
    )
    return env


class SandboxViolation(PermissionError):
    pass


_BLOCKED_PREFIXES = (
    "socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn",
    "os.spawn", "os.kill", "os.killpg", "os.setuid", "os.chroot", "ctypes.", "pty.", "winreg.",
    "urllib.", "http.", "ftplib.", "smtplib.", "webbrowser.", "sys.setprofile", "sys.settrace",
    "sys.addaudithook", "resource.setrlimit", "resource.prlimit",
)  # fmt: skip
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.")  # fmt: skip
_CODE_SUFFIXES = (".py", ".pyc", ".so", ".pth")


def install_audit_hook(workdir: str, on_violation: Callable[[str], None] | None = None) -> None:
    """Sockets, processes, native code, writes outside the private directory and reads of
    anything but installed code are refused wherever they come from. The hook cannot be removed,
    and everything it consults is bound here, in its closure: rebinding this module's globals
    from harness code changes nothing."""
    workdir = os.path.realpath(workdir) + os.sep
    # Not filtered by existence: inside the jail the project's directories are absent, and a
    # traceback that looks for their source files should meet the OS's ENOENT, not a violation.
    code_roots = tuple(
        os.path.realpath(p) + os.sep
        for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}
        if p
    )
    blocked, path_events, code_suffixes = _BLOCKED_PREFIXES, _PATH_EVENTS, _CODE_SUFFIXES
    realpath, fsdecode, sep, pathlike = os.path.realpath, os.fsdecode, os.sep, os.PathLike
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    violation = SandboxViolation

    def inside(path: Any, roots: tuple[str, ...]) -> bool:
        if not isinstance(path, (str, bytes, pathlike)):
            return False
        p = realpath(fsdecode(path))
        return any((p + sep).startswith(r) for r in roots)

    def refuse(event: str) -> None:
        if on_violation is not None:
            on_violation(event)
        raise violation(f"sandbox: {event} is not allowed")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if inside(path, (workdir,)):
                return
            if writing:
                refuse(f"write to {path!r}")
            if not (inside(path, code_roots) and fsdecode(path).endswith(code_suffixes)):
                refuse(f"read of {path!r}")
        elif event.startswith(blocked):
            refuse(event)
        elif event.startswith(path_events) and not all(
            inside(a, (workdir,)) for a in args[:2] if isinstance(a, (str, bytes, pathlike))
        ):
            refuse(event)

    sys.addaudithook(hook)
