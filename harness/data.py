"""Reading published dataset layouts with loud errors. A bad row is reported with its file, row and
column, then skipped (``on_bad="skip"``, the report is returned) or refused (``on_bad="raise"``)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class BadRow:
    file: str
    row: int  # 0-based data row (header excluded)
    column: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: row {self.row}, column {self.column!r}: {self.message}"


class DataError(ValueError):
    """Bad or missing input data: a message naming the file, the flag or the key at fault, or the
    bad rows (``bad``), each with its file, row and column."""

    def __init__(self, bad: list[BadRow] | str):
        if isinstance(bad, str):
            self.bad: list[BadRow] = []
            super().__init__(bad)
            return
        self.bad = list(bad)
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        super().__init__("; ".join(str(b) for b in bad[:5]) + more)


class BadRowLog:
    """Collects bad rows; ``finish`` raises if any were found and the policy is ``raise``."""

    def __init__(self, on_bad: str):
        if on_bad not in ("skip", "raise"):
            raise ValueError("on_bad must be 'skip' or 'raise'")
        self.on_bad = on_bad
        self.bad: list[BadRow] = []

    def add(self, file: str, row: int, column: str, message: str) -> None:
        self.bad.append(BadRow(os.fspath(file), row, column, message))

    def finish(self) -> list[BadRow]:
        if self.bad and self.on_bad == "raise":
            raise DataError(self.bad)
        return self.bad


def read_rows(
    path: str | os.PathLike[str], required: tuple[str, ...] = ()
) -> Iterator[dict[str, Any]]:
    """Rows of a .parquet, .jsonl/.json or .csv file as dicts. A missing required column is an
    error naming the file and the column (the whole file is unusable, not one row)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow's own types (ArrowInvalid, ...) for a truncated file
            raise DataError(
                f"{path}: not a readable parquet file ({type(e).__name__}: {e})"
            ) from None
        columns = set(table.column_names)
        rows: Iterator[dict[str, Any]] = iter(table.to_pylist())
    elif path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json") and text.lstrip().startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not JSON ({e})") from None
        else:
            data = []
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    try:
                        data.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError([BadRow(path, i, "*", f"not JSON: {e}")]) from None
        columns = set().union(*(d.keys() for d in data)) if data else set()
        rows = iter(data)
    elif path.endswith(".csv"):
        f = open(path, encoding="utf-8", newline="")
        reader = csv.DictReader(f)
        columns = set(reader.fieldnames or ())

        def gen() -> Iterator[dict[str, Any]]:
            with f:
                yield from reader

        rows = gen()
    else:
        raise ValueError(f"{path}: unsupported file type (parquet, jsonl, json, csv)")
    missing = [c for c in required if c not in columns]
    if missing:
        raise DataError([BadRow(path, -1, c, "column missing from the file") for c in missing])
    return rows
