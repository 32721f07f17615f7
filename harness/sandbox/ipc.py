"""The wire between trusted and sandboxed processes: length-prefixed JSON frames over stream sockets,
and the one definition of every message kind with its fields, used by both sides.

JSON only: the trusted side never unpickles anything a sandboxed process wrote. Frames a sandboxed
process sends are hostile: ``check`` validates kind, field names, types, ranges and sizes, and
raises ``FrameError`` naming the field; unknown kinds and unknown keys are errors.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 8 << 20
MAX_TEXT = 4 << 20  # any one string field


class FrameError(Exception):
    """The peer sent something that is not a well-formed message (size, JSON, kind or a field)."""


# ---- field checks ---------------------------------------------------------------------------------


def _text(limit: int = MAX_TEXT, optional: bool = False) -> Callable[[Any], bool]:
    return lambda v: (optional and v is None) or (isinstance(v, str) and len(v) <= limit)


def _int(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and lo <= v <= hi


def _bool(v: Any) -> bool:
    return type(v) is bool


def _obj(v: Any) -> bool:
    return isinstance(v, dict)


def _list(v: Any) -> bool:
    return isinstance(v, list)


def _str_map(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and len(v) <= 64
        and all(isinstance(k, str) and isinstance(x, str) and len(x) <= 4000 for k, x in v.items())
    )


def _any(v: Any) -> bool:
    return True


_RID = _int(0, 1 << 40)
_KEY = _text(64)
_DONE_KINDS = ("ok", "exception", "budget", "memory", "output_limit", "violation")

# kind -> {field: (required, check)}. "t" (the kind) is implicit in every frame.
EPISODE_TO_EXECUTOR: dict[str, dict[str, tuple[bool, Callable[[Any], bool]]]] = {
    "chat": {"rid": (True, _RID), "messages": (True, _list), "settings": (True, _obj),
             "train": (True, _bool), "tools": (False, _list)},
    "tool": {"rid": (True, _RID), "name": (True, _text(64)), "args": (True, _list),
             "kwargs": (True, _obj)},
    "done": {"kind": (True, lambda v: v in _DONE_KINDS), "error": (True, _text(8000, True)),
             "answer": (True, _text(MAX_TEXT, True)), "output": (True, _text(1 << 20))},
}  # fmt: skip
EXECUTOR_TO_EPISODE = {
    "reply": {"rid": (True, _RID), "ok": (True, _bool), "text": (False, _text()),
              "finish_reason": (False, _text(64, True)), "completion_tokens": (False, _int(0, 1 << 40)),
              "remaining": (False, _obj), "tool_calls": (False, _list), "value": (False, _any),
              "kind": (False, _text(32)),
              "error": (False, _text(8000))},
}  # fmt: skip
ZYGOTE_TO_EXECUTOR = {
    "ready": {"protections": (True, _str_map), "pid": (True, _int(0, 1 << 31))},
    "load_error": {"error": (True, _text(8000)), "violation": (True, _text(2000, True)),
                   "protections": (True, _str_map)},
    "jail_error": {"error": (True, _text(2000))},
    "started": {"key": (True, _KEY), "pid": (True, _int(0, 1 << 31)), "uid": (True, _int(-1, 1 << 32))},
    "exited": {"key": (True, _KEY), "status": (True, _int(-(1 << 31), 1 << 31)),
               "reason": (True, _text(2000))},
}  # fmt: skip
EXECUTOR_TO_ZYGOTE = {
    "init": {"program": (True, lambda v: v in ("harness", "pytool")), "source": (True, _text()),
             "allowed_imports": (True, _list), "tools": (True, _list), "limits": (True, _obj),
             "policy": (True, _obj), "python_layers": (True, _bool), "max_frame_bytes":
             (True, _int(1 << 10, 1 << 30)), "uid_base": (True, _int(-1, 1 << 32)),
             "max_children": (True, _int(1, 1 << 16)), "visible": (True, _list)},
    "start": {"key": (True, _KEY), "payload": (True, _obj), "fds": (True, _int(0, 4))},
    "kill": {"key": (True, _KEY)},
    "exit": {},
}  # fmt: skip


def check(msg: Any, table: dict[str, dict[str, tuple[bool, Callable[[Any], bool]]]]) -> str:
    """Validate one decoded frame against a direction's table; returns its kind."""
    if not isinstance(msg, dict):
        raise FrameError("frame is not a JSON object")
    kind = msg.get("t")
    fields = table.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise FrameError(f"unknown message kind {str(kind)[:40]!r}")
    for key, value in msg.items():
        if key == "t":
            continue
        spec = fields.get(key)
        if spec is None:
            raise FrameError(f"{kind}: unknown field {str(key)[:40]!r}")
        if not spec[1](value):
            raise FrameError(f"{kind}: bad value for {key!r} ({type(value).__name__})")
    for key, (required, _) in fields.items():
        if required and key not in msg:
            raise FrameError(f"{kind}: missing field {key!r}")
    return kind


def make(kind: str, table: dict[str, Any], /, **fields: Any) -> dict[str, Any]:
    """A message of ``kind``, checked against the table both sides share."""
    msg = {"t": kind, **fields}
    check(msg, table)
    return msg


# ---- framing --------------------------------------------------------------------------------------


def encode(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii")
    return _HEADER.pack(len(data)) + data


def _decode(data: bytes) -> Any:
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise FrameError(f"frame is not JSON: {type(e).__name__}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class FrameDecoder:
    """Incremental decoder for a non-blocking reader: ``feed`` bytes, get whole frames."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameError(f"frame of {n} bytes exceeds the {self.max_frame}-byte cap")
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(_decode(bytes(self._buf[_HEADER.size : _HEADER.size + n])))
            del self._buf[: _HEADER.size + n]
        return out

    @property
    def partial(self) -> bool:
        return bool(self._buf)


class Channel:
    """A blocking end of a connection. ``send`` is thread-safe; ``recv`` belongs to one reader.
    File descriptors travel with a frame (SCM_RIGHTS) and queue up on the receiving side."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME):
        self.sock = sock
        self.max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)
        self._frames: collections.deque[Any] = collections.deque()
        self.fds: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    def send(
        self, obj: dict[str, Any], fds: tuple[int, ...] = (), max_bytes: int | None = None
    ) -> None:
        frame = encode(obj)
        if max_bytes is not None and len(frame) > max_bytes:
            raise ValueError(f"message of {len(frame)} bytes is over the {max_bytes}-byte cap")
        with self._lock:
            if fds:
                sent = socket.send_fds(self.sock, [frame], list(fds))
                frame = frame[sent:]
            if frame:
                self.sock.sendall(frame)

    def recv(self) -> Any:
        """Next decoded frame (not yet checked against a table); EOFError when the peer is gone."""
        while not self._frames:
            data, ancdata, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 8))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    n = len(payload) // 4
                    self.fds.extend(struct.unpack(f"{n}i", payload[: 4 * n]))
            if not data:
                raise EOFError(
                    "peer closed the connection" + (" mid-frame" if self._decoder.partial else "")
                )
            self._frames.extend(self._decoder.feed(data))
        return self._frames.popleft()

    @property
    def buffered(self) -> bool:
        """Whole frames already read from the socket but not yet returned by ``recv`` (a
        selector watching the socket would not wake for them)."""
        return bool(self._frames)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        while self.fds:
            try:
                os.close(self.fds.popleft())
            except OSError:
                pass
