"""Where a run's numbers go: ``metrics.jsonl`` (always; one JSON object per line), TensorBoard
event files (scalars; written here without TensorFlow) and progress bars on stderr.

On resume the JSONL file is cut back to the line count the checkpoint recorded, so no line
appears twice or goes missing; TensorBoard gets a new event file that starts with a restart
marker at the resumed step (TensorBoard then drops the earlier file's later points).
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
from typing import Any

from harness.files import write_atomic

# ---- JSONL -------------------------------------------------------------------------------------


class MetricsLog:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.lines = _count_lines(path)

    def truncate(self, lines: int) -> int:
        """Keep the first ``lines`` complete lines (the checkpointed point); returns how many
        were dropped. A torn last line (a crash mid-write) is dropped too."""
        if not os.path.exists(self.path):
            if lines:
                raise FileNotFoundError(
                    f"{self.path}: missing, the checkpoint expects {lines} lines"
                )
            return 0
        with open(self.path, "rb") as f:
            data = f.read()
        parts = data.split(b"\n")
        complete = parts[:-1]  # the bytes after the last newline are a torn line
        if len(complete) < lines:
            raise ValueError(
                f"{self.path}: {len(complete)} lines, fewer than the {lines} the checkpoint "
                "recorded (the metrics file was edited or lost)"
            )
        write_atomic(self.path, b"".join(p + b"\n" for p in complete[:lines]))
        self.lines = lines
        return len(complete) - lines

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, default=jsonable) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1


def jsonable(x: Any) -> Any:
    """``json.dumps``'s ``default`` for metric values: numpy scalars, sets and tuples, else str."""
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, set | tuple):
        return list(x)
    return str(x)


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- TensorBoard -------------------------------------------------------------------------------
# An event file is a sequence of records: uint64 length, masked CRC-32C of the length, the
# serialized Event protocol buffer, masked CRC-32C of the data. Event: wall_time (1, double),
# step (2, int64), file_version (3, string), summary (5, Summary), session_log (6: status 1 START);
# Summary: repeated value (1), Value: tag (1, string), simple_value (2, float).

_CRC_TABLE: list[int] = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint((number << 3) | wire)
    if wire == 2:
        return key + _varint(len(payload)) + payload
    return key + payload


def _event(
    step: int, wall: float, *, summary: bytes = b"", version: str = "", start=False
) -> bytes:
    e = _field(1, 1, struct.pack("<d", wall)) + _field(2, 0, _varint(step))
    if version:
        e += _field(3, 2, version.encode())
    if summary:
        e += _field(5, 2, summary)
    if start:
        e += _field(6, 2, _field(1, 0, _varint(1)))  # SessionLog{status: START}
    return e


class TensorBoard:
    """Scalars to ``<dir>/events.out.tfevents.<time>.<host>``; one file per process start."""

    def __init__(self, directory: str, *, resumed_step: int | None = None):
        os.makedirs(directory, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(directory, name)
        self._write(_event(0, time.time(), version="brain.Event:2"))
        if resumed_step is not None:
            self._write(_event(resumed_step, time.time(), start=True))

    def _write(self, event: bytes) -> None:
        header = struct.pack("<Q", len(event))
        record = header + struct.pack("<I", _masked(crc32c(header)))
        record += event + struct.pack("<I", _masked(crc32c(event)))
        with open(self.path, "ab") as f:
            f.write(record)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = b"".join(
            _field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
            for tag, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        )
        if summary:
            self._write(_event(step, time.time(), summary=summary))


def read_events(path: str) -> list[tuple[int, dict[str, float]]]:
    """(step, {tag: value}) of each summary event; checks every CRC (for tests and the report)."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        (hcrc,) = struct.unpack_from("<I", data, i + 8)
        if hcrc != _masked(crc32c(data[i : i + 8])):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        body = data[i + 12 : i + 12 + n]
        (dcrc,) = struct.unpack_from("<I", data, i + 12 + n)
        if dcrc != _masked(crc32c(body)):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + n
        fields = _parse_all(body)
        if 5 in fields:
            values = {}
            for v in _parse_all(fields[5][-1]).get(1, []):
                vf = _parse_all(v)
                values[vf[1][-1].decode()] = struct.unpack("<f", vf[2][-1])[0]
            out.append((fields.get(2, [0])[-1], values))
    return out


def _parse_all(buf: bytes) -> dict[int, list]:
    fields: dict[int, list] = {}
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            n, i = _read_varint(buf, i)
            value, i = buf[i : i + n], i + n
        fields.setdefault(number, []).append(value)
    return fields


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


# ---- progress ------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on stderr (``--progress``); ``update`` takes the finished units and a postfix
    (reward, episodes); tqdm shows the rate and the ETA."""

    def __init__(self, total: int | None, desc: str, *, enabled: bool, unit: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True,
                            dynamic_ncols=True, mininterval=1.0)  # fmt: skip

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
