"""The sandboxed worker process: loads one untrusted harness module and runs many episodes of it
concurrently, one thread per episode. Started fresh by the executor (never forked from the trainer,
never importing jax); everything it asks of the world travels over one JSON channel.

Everything above ``_load_harness`` is the trusted bootstrap; harness code runs with restricted
builtins, facade modules (public, non-module attributes only) and the audit hook installed.
"""

from __future__ import annotations

import builtins
import importlib
import itertools
import os
import queue
import socket
import sys
import threading
import traceback
import types
from typing import Any

from harness import sandbox
from harness.ipc import Channel

# Attributes a facade drops although they look harmless: they evaluate strings as code.
_FACADE_DENY = {
    "typing": {"get_type_hints", "ForwardRef"},
    "dataclasses": {"make_dataclass"},
    "functools": {"singledispatch", "singledispatchmethod"},
}
_BANNED_BUILTINS = (
    "eval", "exec", "compile", "open", "globals", "locals", "vars", "getattr", "setattr",
    "delattr", "dir", "breakpoint", "input", "memoryview", "help", "exit", "quit", "copyright",
    "credits", "license",
)  # fmt: skip


class BudgetExceeded(BaseException):
    """A trusted budget refused the call. Derives from BaseException so that a blanket
    ``except Exception`` in a harness does not silently keep the episode going."""


class ModelError(Exception):
    pass


class ToolError(Exception):
    pass


class EpisodeTerminated(BaseException):
    pass


class OutputLimit(BaseException):
    pass


class _Episode:
    def __init__(self, key: str):
        self.key = key
        self.out: list[str] = []
        self.out_bytes = 0
        self.output_over = False
        self.violation: str | None = None


class _Slot:
    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: dict[str, Any] = {}


class _Output:
    """sys.stdout/sys.stderr of the worker: each episode's prints go to its own capped buffer."""

    def __init__(self, worker: _Worker):
        self._worker = worker

    def write(self, s: str) -> int:
        ep = self._worker.by_thread.get(threading.get_ident())
        if ep is None:
            return len(s)
        s = str(s)
        ep.out_bytes += len(s)
        if ep.out_bytes > self._worker.output_cap:
            ep.output_over = True
            raise OutputLimit("episode output cap exceeded")
        ep.out.append(s)
        return len(s)

    def flush(self) -> None:
        pass


class Model:
    """What a harness holds as ``model``. ``chat`` returns the visible completion text."""

    BudgetExceeded = BudgetExceeded
    ModelError = ModelError

    def __init__(self, worker: _Worker, ep: _Episode):
        self._worker = worker
        self._ep = ep
        self.remaining: dict[str, int] = {}
        self.last: dict[str, Any] = {}

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        stop: list[str] | None = None,
        enable_thinking: bool | None = None,
        train: bool = True,
    ) -> str:
        settings = {
            k: v
            for k, v in (
                ("temperature", temperature),
                ("top_p", top_p),
                ("top_k", top_k),
                ("max_new_tokens", max_new_tokens),
                ("stop", list(stop) if stop is not None else None),
                ("enable_thinking", enable_thinking),
            )
            if v is not None
        }
        reply = self._worker.request(
            self._ep, {"t": "chat", "messages": messages, "settings": settings, "train": train}
        )
        self.remaining = reply.get("remaining", {})
        self.last = {k: reply.get(k) for k in ("finish_reason", "completion_tokens")}
        return reply["text"]


def _make_tools(worker: _Worker, ep: _Episode, names: list[str]) -> types.SimpleNamespace:
    def bind(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            msg = {"t": "tool", "name": name, "args": list(args), "kwargs": kwargs}
            return worker.request(ep, msg)["value"]

        call.__name__ = name
        return call

    return types.SimpleNamespace(ToolError=ToolError, **{n: bind(n) for n in names})


class _Worker:
    def __init__(self, chan: Channel, init: dict[str, Any]):
        self.chan = chan
        self.init = init
        self.output_cap = int(init["limits"]["output_bytes"])
        self.tool_names = list(init.get("tools", []))
        self.max_request = int(init["max_frame_bytes"]) // 2
        self.episodes: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.by_thread: dict[int, _Episode] = {}
        self.pending: dict[int, _Slot] = {}
        self.rids = itertools.count()
        self.run_fn: Any = None
        self.load_violation: str | None = None

    def note_violation(self, event: str) -> None:
        ep = self.by_thread.get(threading.get_ident())
        if ep is not None:
            if ep.violation is None:
                ep.violation = event
        elif self.load_violation is None:
            self.load_violation = event

    def request(self, ep: _Episode, msg: dict[str, Any]) -> dict[str, Any]:
        rid = next(self.rids)
        slot = _Slot()
        self.pending[rid] = slot
        msg["ep"] = ep.key
        msg["rid"] = rid
        try:
            self.chan.send(msg, max_bytes=self.max_request)
        except (TypeError, ValueError) as e:
            self.pending.pop(rid, None)
            raise ValueError(f"request refused: {e}") from None
        slot.event.wait()
        reply = slot.value
        if reply.get("ok"):
            return reply
        kind, error = reply.get("kind"), reply.get("error", "")
        if kind == "budget":
            raise BudgetExceeded(error)
        if kind == "tool":
            raise ToolError(error)
        if kind == "terminated":
            raise EpisodeTerminated(error)
        raise ModelError(error)

    def episode_loop(self) -> None:
        while True:
            msg = self.episodes.get()
            ep = _Episode(msg["ep"])
            self.by_thread[threading.get_ident()] = ep
            task = types.SimpleNamespace(**msg["task"])
            kind, error, answer = "ok", None, None
            try:
                answer = self.run_fn(task, Model(self, ep), _make_tools(self, ep, self.tool_names))
                if answer is not None and not isinstance(answer, str):
                    kind, error = "exception", f"run() returned {type(answer).__name__}, not str"
                    answer = None
                elif answer is not None and len(answer) > self.max_request:
                    kind, error, answer = (
                        "output_limit",
                        f"answer of {len(answer)} characters",
                        None,
                    )
            except MemoryError:  # no traceback: the frames it holds keep the memory in use
                kind, error = "memory", "MemoryError: over the worker's memory limit"
            except OutputLimit:
                kind = "output_limit"
            except BudgetExceeded as e:
                kind, error = "budget", str(e)
            except BaseException as e:  # the harness's failure, never the worker's
                kind = "exception"
                try:
                    error = "".join(traceback.format_exception(e, limit=-6))[-4000:]
                except BaseException:
                    error = f"{type(e).__name__} (traceback unavailable)"
            if ep.violation is not None:
                kind, error = "violation", ep.violation
            elif ep.output_over:
                kind, error = "output_limit", f"output over {self.output_cap} bytes"
            del self.by_thread[threading.get_ident()]
            self.chan.send(
                {
                    "t": "done",
                    "ep": ep.key,
                    "kind": kind,
                    "error": error,
                    "answer": answer if kind == "ok" else None,
                    "output": "".join(ep.out)[-self.output_cap :][: self.max_request // 2],
                }
            )

    def reader_loop(self) -> None:
        while True:
            try:
                msg = self.chan.recv()
            except Exception:
                os._exit(0)
            t = msg.get("t")
            if t == "reply":
                slot = self.pending.pop(msg["rid"], None)
                if slot is not None:
                    slot.value = msg
                    slot.event.set()
            elif t == "episode":
                self.episodes.put(msg)
            elif t == "exit":
                os._exit(0)


def _facade(name: str, allowed: set[str]) -> types.ModuleType:
    module = importlib.import_module(name)
    face = types.ModuleType(name)
    deny = _FACADE_DENY.get(name, set())
    for key, value in vars(module).items():
        if key.startswith("_") or key in deny or isinstance(value, types.ModuleType):
            continue
        setattr(face, key, value)
    for child in sorted(allowed):
        if child.startswith(name + ".") and "." not in child[len(name) + 1 :]:
            setattr(face, child[len(name) + 1 :], _facade(child, allowed))
    return face


def _restricted_builtins(allowed: list[str]) -> dict[str, Any]:
    allowed_set = set(allowed)
    faces = {name: _facade(name, allowed_set) for name in sorted(allowed_set)}

    def restricted_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
        if level or name not in faces:
            raise ImportError(f"import of {name!r} is not allowed in a harness")
        if fromlist:
            return faces[name]
        return faces[name.split(".")[0]] if name.split(".")[0] in faces else faces[name]

    table = {k: v for k, v in vars(builtins).items() if k not in _BANNED_BUILTINS}
    table["__import__"] = restricted_import
    return table


def _load_harness(source: str, table: dict[str, Any]) -> Any:
    scope: dict[str, Any] = {"__name__": "harness_candidate", "__builtins__": table}
    code = compile(source, "harness.py", "exec", dont_inherit=True)
    exec(code, scope)
    run = scope.get("run")
    if not callable(run):
        raise TypeError("harness defines no callable run(task, model, tools)")
    return run


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    chan = Channel(sock)
    init = chan.recv()
    limits = sandbox.Limits(**init["limits"])
    workdir = os.getcwd()
    table = _restricted_builtins(init["allowed_imports"])
    report = sandbox.enter(workdir, limits)
    worker = _Worker(chan, init)
    threading.stack_size(limits.thread_stack_bytes)
    for _ in range(int(init["concurrency"])):
        threading.Thread(target=worker.episode_loop, daemon=True).start()
    report["processes"] = sandbox.forbid_new_processes()
    sys.stdout = sys.stderr = _Output(worker)  # type: ignore[assignment]
    sandbox.install_audit_hook(workdir, worker.note_violation)
    report["audit_hook"] = "installed"
    try:
        worker.run_fn = _load_harness(init["source"], table)
        if worker.load_violation is not None:
            raise sandbox.SandboxViolation(worker.load_violation)
    except BaseException as e:
        text = "".join(traceback.format_exception(e, limit=-4))[-4000:]
        chan.send({"t": "load_error", "error": text, "violation": worker.load_violation})
        os._exit(0)
    chan.send({"t": "ready", "protections": report, "pid": os.getpid()})
    worker.reader_loop()


if __name__ == "__main__":
    main()
