"""The episode side of the sandbox: what runs inside one jailed episode process (forked from the
candidate's zygote, ``harness.sandbox.zygote``). It loads the harness module, runs ``run(task, model,
tools)`` once, reports, and exits: no state survives an episode.

``model`` and ``tools`` are thin proxies: every call is one request over the episode's own channel
to the executor, which counts budgets, calls the model and the tools, and answers. With the Python
layers on (the default), harness code sees restricted builtins and module facades (public,
non-module attributes only) and the audit hook refuses what it can recognise; these are readable
early refusals, the wall is the OS (``harness.sandbox.jail``)."""

from __future__ import annotations

import builtins
import importlib
import itertools
import os
import sys
import traceback
import types
from typing import Any

from harness.sandbox import ipc, python_layer
from harness.sandbox.ipc import Channel

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


class _Output:
    """sys.stdout/sys.stderr of an episode process: prints go to one capped buffer."""

    def __init__(self, cap: int):
        self.cap = cap
        self.parts: list[str] = []
        self.size = 0
        self.over = False

    def write(self, s: str) -> int:
        s = str(s)
        self.size += len(s)
        if self.size > self.cap:
            self.over = True
            raise OutputLimit("episode output cap exceeded")
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def text(self, limit: int) -> str:
        return "".join(self.parts)[-self.cap :][:limit]


class _Link:
    """The episode's one connection to the executor: one request at a time, answered in order."""

    def __init__(self, chan: Channel, max_request: int):
        self._chan = chan
        self._max_request = max_request
        self._rids = itertools.count()

    def request(self, kind: str, **fields: Any) -> dict[str, Any]:
        rid = next(self._rids)
        try:
            msg = ipc.make(kind, ipc.EPISODE_TO_EXECUTOR, rid=rid, **fields)
            self._chan.send(msg, max_bytes=self._max_request)
        except (TypeError, ValueError, ipc.FrameError) as e:
            raise ValueError(f"request refused: {e}") from None
        while True:
            reply = self._chan.recv()
            if reply.get("rid") == rid:
                break
        if reply.get("ok"):
            return reply
        kind, error = reply.get("kind"), str(reply.get("error", ""))
        if kind == "budget":
            raise BudgetExceeded(error)
        if kind == "tool":
            raise ToolError(error)
        if kind == "terminated":
            raise EpisodeTerminated(error)
        raise ModelError(error)


class Model:
    """What a harness holds as ``model``. ``chat`` returns the visible completion text."""

    BudgetExceeded = BudgetExceeded
    ModelError = ModelError

    def __init__(self, link: _Link):
        self._link = link
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
        tools: list[dict[str, Any]] | None = None,
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
        if not isinstance(train, bool):
            raise TypeError("train must be True or False")
        if tools is not None and not isinstance(tools, list):
            raise TypeError("tools must be a list of function schemas")
        extra = {} if tools is None else {"tools": tools}
        reply = self._link.request(
            "chat", messages=messages, settings=settings, train=train, **extra
        )
        self.remaining = dict(reply.get("remaining", {}))
        self.last = {k: reply.get(k) for k in ("finish_reason", "completion_tokens")}
        self.last["tool_calls"] = list(reply.get("tool_calls") or [])
        return str(reply.get("text", ""))


def _make_tools(link: _Link, names: list[str]) -> types.SimpleNamespace:
    def bind(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            return link.request("tool", name=name, args=list(args), kwargs=kwargs).get("value")

        call.__name__ = name
        return call

    return types.SimpleNamespace(ToolError=ToolError, **{n: bind(n) for n in names})


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


def prepare(init: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """In the zygote (trusted, before any fork): compile the harness and build the restricted
    builtins and module facades every episode starts from. Nothing untrusted runs here."""
    code = compile(init["source"], "harness.py", "exec", dont_inherit=True)
    table = _restricted_builtins(init["allowed_imports"]) if init["python_layers"] else None
    return code, table


def load(code: Any, table: dict[str, Any] | None) -> Any:
    """Run the harness module's body (in the episode's own process) and return its ``run``."""
    scope: dict[str, Any] = {"__name__": "harness_candidate"}
    scope["__builtins__"] = table if table is not None else vars(builtins)
    exec(code, scope)
    run = scope.get("run")
    if not callable(run):
        raise TypeError("harness defines no callable run(task, model, tools)")
    return run


def _violations() -> tuple[list[str], Any]:
    seen: list[str] = []
    return seen, seen.append


def probe_main(code: Any, table: dict[str, Any] | None, python_layers: bool) -> None:
    """The load check, in a jailed child of the zygote: exit 0 = loads; otherwise the reason goes
    to fd 1 (a pipe the zygote reads) and the exit code says which (3 load error, 4 violation)."""
    seen, note = _violations()
    out = _Output(64 << 10)
    sys.stdout = sys.stderr = out  # type: ignore[assignment]
    if python_layers:
        python_layer.install_audit_hook(os.getcwd(), note)
    try:
        load(code, table)
        if seen:
            raise python_layer.SandboxViolation(seen[0])
        rc, text = 0, ""
    except BaseException as e:
        rc = 4 if seen else 3
        try:
            text = "".join(traceback.format_exception(e, limit=-4))[-4000:]
        except BaseException:
            text = f"{type(e).__name__} (traceback unavailable)"
        if seen:
            text = f"{seen[0]}\n{text}"
    os.write(1, text.encode("utf-8", "replace")[:8000])
    os._exit(rc)


def episode_main(
    chan: Channel, code: Any, table: dict[str, Any] | None, init: dict[str, Any],
    payload: dict[str, Any],
) -> None:  # fmt: skip
    """One episode, in its own jailed process: load the harness, run it, report, exit."""
    cap = int(init["limits"]["output_bytes"])
    max_request = int(init["max_frame_bytes"]) // 2
    link = _Link(chan, max_request)
    seen, note = _violations()
    out = _Output(cap)
    sys.stdout = sys.stderr = out  # type: ignore[assignment]
    if init["python_layers"]:
        python_layer.install_audit_hook(os.getcwd(), note)
    task = types.SimpleNamespace(**dict(payload.get("task", {})))
    kind, error, answer = "ok", None, None
    try:
        run = load(code, table)
        answer = run(task, Model(link), _make_tools(link, list(init["tools"])))
        if answer is not None and not isinstance(answer, str):
            kind, error, answer = (
                "exception",
                f"run() returned {type(answer).__name__}, not str",
                None,
            )
        elif answer is not None and len(answer) > max_request // 2:
            kind, error, answer = "output_limit", f"answer of {len(answer)} characters", None
    except MemoryError:  # no traceback: the frames it holds keep the memory in use
        kind, error = "memory", "MemoryError: over the episode's memory limit"
    except OutputLimit:
        kind = "output_limit"
    except BudgetExceeded as e:
        kind, error = "budget", str(e)[:4000]
    except BaseException as e:  # the harness's failure
        kind = "exception"
        try:
            error = "".join(traceback.format_exception(e, limit=-6))[-4000:]
        except BaseException:
            error = f"{type(e).__name__} (traceback unavailable)"
    if seen:
        kind, error = "violation", seen[0][:4000]
    elif out.over:
        kind, error = "output_limit", f"output over {cap} bytes"
    done = {"kind": kind, "error": error, "answer": answer if kind == "ok" else None,
            "output": out.text(max_request // 4)}  # fmt: skip
    chan.send(ipc.make("done", ipc.EPISODE_TO_EXECUTOR, **done))
    os._exit(0)
