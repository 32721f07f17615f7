"""OS-level containment for untrusted code: the trusted bootstrap that a fresh sandboxed process
runs before any untrusted code loads. Used by harness workers and by the math tool's executor.

Order matters: leave the network namespace while still root, chown the private directory, drop to
``nobody``, start every thread the process will need, then cap processes (RLIMIT_NPROC=0 also stops
new threads, which Linux counts as processes), and finally install the audit hook. Each step that
the OS refuses is reported, never silently skipped.
"""

from __future__ import annotations

import dataclasses
import os
import resource
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
    thread_stack_bytes: int = 256 << 10

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


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _leave_network() -> str:
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    if hasattr(os, "unshare"):  # Python 3.12+
        try:
            os.unshare(clone_newnet)
            return "isolated (new network namespace)"
        except OSError:
            pass
    try:
        import ctypes

        libc = _libc()
        if libc.unshare(clone_newnet) == 0:
            return "isolated (new network namespace)"
        if os.geteuid() != 0 and libc.unshare(clone_newuser | clone_newnet) == 0:
            return "isolated (new user+network namespace)"
        return f"not isolated: unshare failed ({os.strerror(ctypes.get_errno())})"
    except (OSError, AttributeError) as e:
        return f"not isolated: {e}"


def _drop_privileges(workdir: str) -> str:
    if os.geteuid() != 0:
        return f"unprivileged already (uid {os.geteuid()})"
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return "root kept: no 'nobody' user"
    os.chown(workdir, nobody.pw_uid, nobody.pw_gid)
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
    return f"dropped to nobody (uid {nobody.pw_uid})"


def _no_new_privs() -> str:
    try:
        pr_set_no_new_privs = 38
        return "set" if _libc().prctl(pr_set_no_new_privs, 1, 0, 0, 0) == 0 else "refused"
    except (OSError, AttributeError):
        return "unavailable"


def _set_limit(which: int, value: int, headroom: int = 0) -> None:
    soft, hard = resource.getrlimit(which)
    new_hard = value + headroom
    if hard != resource.RLIM_INFINITY:
        value, new_hard = min(value, hard), min(new_hard, hard)
    resource.setrlimit(which, (value, new_hard))


def enter(workdir: str, limits: Limits) -> dict[str, str]:
    """Contain this process, except RLIMIT_NPROC (``forbid_new_processes``); report what applied."""
    report = {"network": _leave_network()}
    os.chdir(workdir)
    report["privileges"] = _drop_privileges(workdir)
    report["no_new_privs"] = _no_new_privs()
    _set_limit(resource.RLIMIT_CORE, 0)
    # The CPU soft limit sends SIGXCPU (a recognisable death); the hard one a second later SIGKILL.
    for name, which, value, headroom in (
        ("memory", resource.RLIMIT_AS, limits.memory_bytes, 0),
        ("cpu", resource.RLIMIT_CPU, limits.cpu_s, 1),
        ("open_files", resource.RLIMIT_NOFILE, limits.open_files, 0),
        ("file_size", resource.RLIMIT_FSIZE, limits.file_bytes, 0),
    ):
        try:
            _set_limit(which, value, headroom)
            report[name] = str(value)
        except (ValueError, OSError) as e:
            report[name] = f"not set: {e}"
    return report


def forbid_new_processes() -> str:
    """RLIMIT_NPROC=0: no fork and no new thread from here on (root would be exempt)."""
    try:
        _set_limit(resource.RLIMIT_NPROC, 0)
    except (ValueError, OSError) as e:
        return f"not set: {e}"
    return "0" if os.geteuid() != 0 else "0 (ineffective as root)"


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
    """Second line behind the static check: sockets, processes, native code, writes outside the
    private directory and reads of anything but installed code are refused wherever they come
    from. The hook cannot be removed once added."""
    workdir = os.path.realpath(workdir) + os.sep
    code_roots = tuple(
        os.path.realpath(p) + os.sep
        for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}
        if p and os.path.isdir(p)
    )

    def inside(path: Any, roots: tuple[str, ...]) -> bool:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False
        p = os.path.realpath(os.fsdecode(path))
        return any((p + os.sep).startswith(r) for r in roots)

    def refuse(event: str) -> None:
        if on_violation is not None:
            on_violation(event)
        raise SandboxViolation(f"sandbox: {event} is not allowed")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if inside(path, (workdir,)):
                return
            if writing:
                refuse(f"write to {path!r}")
            if not (inside(path, code_roots) and os.fsdecode(path).endswith(_CODE_SUFFIXES)):
                refuse(f"read of {path!r}")
        elif event.startswith(_BLOCKED_PREFIXES):
            refuse(event)
        elif event.startswith(_PATH_EVENTS) and not all(
            inside(a, (workdir,)) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))
        ):
            refuse(event)

    sys.addaudithook(hook)


_PREIMPORT = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "random",
    "statistics", "re", "json", "heapq", "bisect", "string", "operator", "traceback",
)  # fmt: skip


def pyexec_main() -> None:
    """Entry of the math tool's short-lived process: argv = [workdir, limits-json]. Runs workdir's
    code.py with stdout/stderr already redirected to files by the parent; exit code 0 = ran."""
    import json
    import traceback

    workdir, limits_json = sys.argv[1], sys.argv[2]
    limits = Limits(**json.loads(limits_json))
    with open(os.path.join(workdir, "code.py"), encoding="utf-8") as f:
        source = f.read()
    # Import before privileges drop: the interpreter's own files may be unreadable to nobody.
    for name in _PREIMPORT + tuple(n for n in ("numpy", "sympy") if n in source):
        try:
            __import__(name)
        except ImportError:
            pass
    enter(workdir, limits)
    forbid_new_processes()
    install_audit_hook(workdir)
    scope: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(source, "<tool>", "exec"), scope)
    except SystemExit as e:
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        traceback.print_exc(limit=-4)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
