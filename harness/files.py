"""Files that are never seen half-written: every write goes to a temporary file in the same
directory, is flushed to disk, then replaces the target in one step (``os.replace``), so a crash
or a preemption leaves the old file or the new one. Used by the search archive, the run directory
and the data fetcher."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_atomic(path: str, data: str | bytes) -> None:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(
            fd,
            "wb" if isinstance(data, bytes) else "w",
            **({} if isinstance(data, bytes) else {"encoding": "utf-8"}),
        ) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
