"""Length-prefixed JSON frames over a stream socket. JSON only: the main process never unpickles
anything a sandboxed process wrote."""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 8 << 20


class FrameError(Exception):
    """The peer sent something that is not a well-formed frame (too large, not JSON, not a dict)."""


class Channel:
    """One end of a worker connection. ``send`` is thread-safe; ``recv`` belongs to one reader."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME):
        self.sock = sock
        self.max_frame = max_frame
        self._rfile = sock.makefile("rb", buffering=1 << 16)
        self._lock = threading.Lock()

    def send(self, obj: dict[str, Any], max_bytes: int | None = None) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode("ascii")
        if max_bytes is not None and len(data) > max_bytes:
            raise ValueError(f"message of {len(data)} bytes is over the {max_bytes}-byte cap")
        frame = _HEADER.pack(len(data)) + data
        with self._lock:
            self.sock.sendall(frame)

    def recv(self) -> dict[str, Any]:
        """Next frame; EOFError when the peer is gone, FrameError when it misbehaved."""
        header = self._rfile.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise EOFError("peer closed the connection")
        (n,) = _HEADER.unpack(header)
        if n > self.max_frame:
            raise FrameError(f"frame of {n} bytes exceeds the {self.max_frame}-byte cap")
        data = self._rfile.read(n)
        if len(data) < n:
            raise EOFError("peer closed the connection mid-frame")
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise FrameError(f"frame is not JSON: {type(e).__name__}") from None
        if not isinstance(obj, dict):
            raise FrameError("frame is not a JSON object")
        return obj

    def close(self) -> None:
        for closer in (self._rfile.close, self.sock.close):
            try:
                closer()
            except OSError:
                pass
