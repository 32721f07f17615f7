"""The sandboxed process tree of one harness candidate (or of the math tool): a launcher, a zygote
and one jailed child per episode (or per tool call).

    executor ──socketpair──▶ launcher (fresh ``python -I``; enters the namespaces; waits)
                                └─ zygote (pid 1 of the new pid namespace; trusted code only)
                                     ├─ probe child (loads the harness once: the load check)
                                     ├─ episode child ──own socketpair──▶ executor
                                     └─ ...

The zygote never runs untrusted code: it compiles the harness, builds the restricted builtins,
imports what episodes need, builds the read-only root and then only forks. Each child enters its
own mount namespace with a private tmpfs ``/tmp``, takes its own uid, sets rlimits, loads seccomp
and only then runs untrusted code; it exits when its episode (or tool call) ends. The zygote tells
the executor when each child started and how it ended; if the zygote dies, the kernel kills every
child with it (pid 1 of their namespace).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

from harness.sandbox import ipc, jail, python_layer

_PYTOOL_PREIMPORT = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "random",
    "statistics", "re", "json", "heapq", "bisect", "string", "operator", "traceback",
    "numpy", "mpmath", "sympy",
)  # fmt: skip


def _send(chan: ipc.Channel, kind: str, **fields: Any) -> None:
    chan.send(ipc.make(kind, ipc.ZYGOTE_TO_EXECUTOR, **fields))


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            return f"killed by signal {sig}"
        meaning = {"SIGXCPU": " (CPU-time limit)", "SIGXFSZ": " (file-size limit)",
                   "SIGSEGV": " (crash)", "SIGABRT": " (abort)", "SIGSYS": " (seccomp)"}  # fmt: skip
        return f"killed by {name}" + meaning.get(name, "")
    return f"exit code {os.WEXITSTATUS(status)}"


def launcher_main() -> None:
    """The process the executor starts. Reads ``init``, enters the namespaces, forks the zygote
    (pid 1 of the new pid namespace) and mirrors its exit."""
    jail.die_with_parent()
    chan = ipc.Channel(socket.socket(fileno=int(sys.argv[1])))
    init = chan.recv()
    if ipc.check(init, ipc.EXECUTOR_TO_ZYGOTE) != "init":
        os._exit(2)
    policy = jail.Policy(**init["policy"])
    try:
        report = jail.enter_namespaces(policy)
    except (jail.JailError, OSError) as e:
        _send(chan, "jail_error", error=str(e)[:2000])
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        try:
            _Zygote(chan, init, policy, report).serve()
        except BaseException as e:  # trusted code failed: say so, then go (children die with us)
            try:
                _send(chan, "jail_error", error=f"zygote: {type(e).__name__}: {e}"[:2000])
            finally:
                os._exit(1)
        os._exit(0)
    chan.close()
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0x7F)


class _Zygote:
    def __init__(self, chan: ipc.Channel, init: dict[str, Any], policy: jail.Policy,
                 report: dict[str, str]):  # fmt: skip
        jail.die_with_parent()
        self.chan, self.init, self.policy = chan, init, policy
        self.limits = python_layer.Limits(**init["limits"])
        self.report = dict(report)
        self.children: dict[int, tuple[str, int | None, str | None]] = {}  # pid -> key, uid, dir
        self.by_key: dict[str, int] = {}
        self.uid_base = int(init["uid_base"])
        # uids are reused only once their process is reaped; starts wait for a free one
        self.free_uids = list(range(2 * int(init["max_children"]) + 2))[::-1]
        self.waiting: list[tuple[str, dict[str, Any], list[int]]] = []
        self.program = init["program"]
        self.code: Any = None
        self.table: Any = None
        self.read_paths: list[str] = []
        self.compile_error: str | None = None

    # ---- setup (trusted) -----------------------------------------------------------------------

    def prepare(self) -> None:
        extra = [str(p) for p in self.init["visible"]]
        if self.program == "harness":
            from harness.sandbox import worker

            try:
                self.code, self.table = worker.prepare(self.init)
            except (SyntaxError, ValueError, TypeError) as e:  # the source does not compile
                self.compile_error = "".join(traceback.format_exception_only(e))[-4000:]
        else:
            import importlib

            for name in _PYTOOL_PREIMPORT:
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                path = getattr(module, "__file__", None) or ""
                if os.path.basename(path) == "__init__.py":
                    extra.append(os.path.dirname(path))
                    libs = os.path.dirname(path) + ".libs"  # wheels' vendored shared libraries
                    if os.path.isdir(libs):
                        extra.append(libs)
        self.read_paths = jail.stdlib_paths() + extra
        if self.policy.mode == "landlock":
            self.report["filesystem"] = "landlock per process (see landlock)"
        else:
            self.report.update(jail.build_root(os.path.join(os.getcwd(), "root"), extra))

    def serve(self) -> None:
        self.prepare()
        signal.signal(signal.SIGCHLD, lambda *_: None)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        self.wake = (wake_r, wake_w)
        if self.compile_error is not None:
            _send(self.chan, "load_error", error=self.compile_error, violation=None,
                  protections=self.report)  # fmt: skip
            return
        if self.program == "harness":
            ok, text, child_report = self.probe()
            self.report.update(child_report)
            if not ok:
                _send(self.chan, "load_error", error=text[-8000:] or "load failed",
                      violation=text.split("\n", 1)[0][:2000] if ok is None else None,
                      protections=self.report)  # fmt: skip
                return
        else:
            self.report.update(self.child_report_only())
        _send(self.chan, "ready", protections=self.report, pid=os.getpid())
        sel = selectors.DefaultSelector()
        sel.register(self.chan.sock, selectors.EVENT_READ, "control")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        while True:
            for key, _ in sel.select():
                if key.data == "wake":
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    try:
                        self.handle(self.chan.recv())
                        while self.chan.buffered:
                            self.handle(self.chan.recv())
                    except EOFError:
                        return
            self.reap()

    def handle(self, msg: Any) -> None:
        kind = ipc.check(msg, ipc.EXECUTOR_TO_ZYGOTE)
        if kind == "start":
            fds = [self.chan.fds.popleft() for _ in range(msg["fds"])]
            self.waiting.append((msg["key"], msg["payload"], fds))
            self.start_waiting()
        elif kind == "kill":
            pid = self.by_key.get(msg["key"])
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            for item in [w for w in self.waiting if w[0] == msg["key"]]:
                self.waiting.remove(item)
                for fd in item[2]:
                    os.close(fd)
        elif kind == "exit":
            for pid in list(self.children):
                os.kill(pid, signal.SIGKILL)
            os._exit(0)

    def start_waiting(self) -> None:
        while self.waiting and self.free_uids:
            key, payload, fds = self.waiting.pop(0)
            try:
                self.start(key, payload, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            key, uid, workdir = entry
            self.by_key.pop(key, None)
            if uid is not None:
                self.free_uids.append(uid - self.uid_base)
            if workdir is not None:
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
            _send(self.chan, "exited", key=key, status=status, reason=_describe(status))
        self.start_waiting()

    # ---- children ------------------------------------------------------------------------------

    def _fork(self, key: str) -> tuple[int, int | None, str | None]:
        """Fork a child with its own uid (root) and, in landlock mode, its own directory.
        Returns (pid, uid, workdir); pid 0 in the child, which then calls ``_enter``."""
        uid = self.uid_base + self.free_uids.pop() if self.uid_base >= 0 else None
        workdir = None
        if self.policy.mode == "landlock":
            workdir = os.path.join(os.getcwd(), "ep-" + key.replace("/", "_"))
            os.mkdir(workdir, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
        pid = os.fork()
        if pid:
            self.children[pid] = (key, uid, workdir)
            self.by_key[key] = pid
            return pid, uid, workdir
        return 0, uid, workdir

    def _enter(self, uid: int | None, workdir: str | None, keep: dict[int, int]) -> dict[str, str]:
        """In the child, before untrusted code: file descriptors, then the jail (last: seccomp)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open("/dev/null", os.O_RDWR)
        for target in (0, 1, 2):
            if target not in keep.values():
                os.dup2(null, target)
        for fd, target in keep.items():
            if fd != target:
                os.dup2(fd, target, inheritable=True)
        top = max([2, *keep.values()])
        os.closerange(top + 1, 1 << 16)
        landlocked = None
        if self.policy.mode == "landlock":  # the rules open the paths: before the uid changes
            jail.no_new_privs()  # restrict_self needs it
            landlocked = jail.landlock(self.read_paths, [workdir or "/nonexistent", "/dev/null"])
        report = jail.enter_episode(self.policy, uid, workdir)
        if landlocked is not None:
            report["filesystem"] = landlocked
        tmpfs = self.policy.tmp_bytes if self.policy.mode != "landlock" else 0
        report.update(jail.set_limits(self.limits, reserved_bytes=tmpfs))
        report["seccomp"] = jail.install_seccomp()
        return report

    def probe(self) -> tuple[bool | None, str, dict[str, str]]:
        """Load the harness once in a jailed child. (True, "", report) when it loads; (False,
        error) for a load error; (None, violation + error) for a sandbox violation."""
        from harness.sandbox import worker

        r, w = os.pipe()
        pid, uid, workdir = self._fork("probe")
        if pid == 0:
            try:
                report = self._enter(uid, workdir, {w: 1})
                os.write(1, (json.dumps(report) + "\n").encode())
            except BaseException as e:
                os.write(1, (json.dumps({"jail": f"{type(e).__name__}: {e}"}) + "\n").encode())
                os._exit(5)
            worker.probe_main(self.code, self.table, bool(self.init["python_layers"]))
        os.close(w)
        chunks = []
        while True:
            data = os.read(r, 1 << 16)
            if not data or sum(map(len, chunks)) > 1 << 16:
                break
            chunks.append(data)
        os.close(r)
        status = self._wait(pid)
        head, _, text = b"".join(chunks).decode("utf-8", "replace").partition("\n")
        try:
            report = {str(k): str(v) for k, v in json.loads(head).items()}
        except (ValueError, AttributeError):
            report = {}
        code = os.waitstatus_to_exitcode(status)
        if code == 5:
            raise jail.JailError(1, report.get("jail", "jail setup failed in the probe"))
        if code == 0:
            return True, "", report
        if code == 4:
            return None, text, report
        return False, text or _describe(status), report

    def _wait(self, pid: int) -> int:
        """Wait for a setup child (probe) and release its uid and directory."""
        _, status = os.waitpid(pid, 0)
        key, uid, workdir = self.children.pop(pid)
        self.by_key.pop(key, None)
        if uid is not None:
            self.free_uids.append(uid - self.uid_base)
        if workdir is not None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        return status

    def child_report_only(self) -> dict[str, str]:
        """The tool zygote's protections: one jailed child that reports and exits."""
        r, w = os.pipe()
        pid, uid, workdir = self._fork("probe")
        if pid == 0:
            try:
                report = self._enter(uid, workdir, {w: 1})
                os.write(1, json.dumps(report).encode())
                os._exit(0)
            except BaseException as e:
                os.write(1, json.dumps({"jail": f"{type(e).__name__}: {e}"}).encode())
                os._exit(5)
        os.close(w)
        data = os.read(r, 1 << 16)
        os.close(r)
        status = self._wait(pid)
        report = {str(k): str(v) for k, v in json.loads(data or b"{}").items()}
        if os.waitstatus_to_exitcode(status) != 0:
            raise jail.JailError(1, report.get("jail", "jail setup failed"))
        return report

    def start(self, key: str, payload: dict[str, Any], fds: list[int]) -> None:
        keep = {fds[0]: 3} if self.program == "harness" else {fds[0]: 1, fds[1]: 2}
        pid, uid, workdir = self._fork(key)
        if pid == 0:
            try:
                self._enter(uid, workdir, keep)
            except BaseException:
                os._exit(70)
            try:
                if self.program == "harness":
                    from harness.sandbox import worker

                    chan = ipc.Channel(socket.socket(fileno=3), int(self.init["max_frame_bytes"]))
                    worker.episode_main(chan, self.code, self.table, self.init, payload)
                else:
                    _pytool_child(str(payload.get("code", "")))
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(71)  # a child never returns into the zygote's loop
        _send(self.chan, "started", key=key, pid=pid, uid=-1 if uid is None else uid)


def _pytool_child(source: str) -> None:
    """Model-written code (the math tool): runs as __main__ with stdout/stderr on the pipes."""
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
