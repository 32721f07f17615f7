"""The proposer interface, the output contract and the archive tools every LLM backend offers.

A proposer gets a ``ProposeRequest``: the archive (read-only), the skill text, the number of slots
to fill and a slot directory, the only place it may write. The output contract:

    <slot_dir>/<name>/harness.py     one directory per candidate (name: lowercase, digits, dashes)
    <slot_dir>/pending.json          [{"name": ..., "hypothesis": ..., "changes": ...}, ...]

``collect`` turns that into ``Proposal``s: at most ``slots``, only names listed in pending.json
whose harness.py exists, each source at most ``MAX_SOURCE`` bytes. Anything else is reported in the
returned problems and never evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any, Protocol

from harness.search.archive import Proposal

MAX_SOURCE = 64 << 10
_SLOT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")

CONTRACT = """Output contract. Write each candidate harness as <slot_dir>/<name>/harness.py (name:
lowercase letters, digits and dashes, at most 41 characters), at most {slots} candidates, then
write <slot_dir>/pending.json: a JSON list with one object per candidate: {{"name": "<name>",
"hypothesis": "<what you expect to improve and why, from the traces>", "changes": "<the one
mechanism you changed>"}}. Only files under <slot_dir> are read; everything else you write is
ignored. Each harness.py must define run(task, model, tools) as documented in the skill text."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProposeRequest:
    archive_dir: str  # every phase so far (read-only for the proposer)
    phase_dir: str  # the current phase, inside archive_dir
    slot_dir: str  # the only directory the proposer may write
    skill: str  # the domain's skill text
    domain: str
    slots: int  # candidates wanted (k)
    iteration: int
    prompt_only: bool = False  # Fast-Slow control: only prompt constants may change
    # Runs a draft harness (source) on a few logged search-split tasks with the current model;
    # returns a short summary (success rate, stop reasons, one trace excerpt). None: unavailable.
    trial: Callable[[str], dict[str, Any]] | None = None

    @property
    def contract(self) -> str:
        return CONTRACT.format(slots=self.slots)

    def task_text(self) -> str:
        """The instruction every LLM backend sends (with the skill text as its system prompt)."""
        mode = (
            "\nPrompt-only mode: change only the values of the harness's named prompt constants "
            "(module-level strings); any other change is rejected.\n"
            if self.prompt_only
            else ""
        )
        phase = os.path.relpath(self.phase_dir, self.archive_dir)
        return (
            f"Improve the {self.domain} harness. Iteration {self.iteration}. Your file tools see "
            f"the archive of every earlier harness, its scores and its full traces (paths "
            f"relative to the archive root; current phase: {phase}). Read the failing traces end "
            f"to end before proposing. Propose {self.slots} candidates, one mechanism each."
            f"{mode}\n{self.contract}\nslot_dir = slots (write it as 'slots/<name>/harness.py' "
            "and 'slots/pending.json')"
        )


@dataclasses.dataclass
class Usage:
    """What a proposer spent: model replies (``turns``) and their tokens, tool calls, retries."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    retries: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Proposer(Protocol):
    name: str
    # Everything this proposer has spent since it was made, added as it is spent: a proposal
    # that fails or raises has still spent its tokens (the loop counts the difference).
    usage: Usage

    def propose(self, request: ProposeRequest) -> tuple[list[Proposal], list[str]]:
        """(proposals, problems): problems are reasons a slot went unfilled (recorded)."""
        ...


def collect(request: ProposeRequest, proposer: str) -> tuple[list[Proposal], list[str]]:
    """Read the slot directory per the output contract."""
    problems: list[str] = []
    path = os.path.join(request.slot_dir, "pending.json")
    try:
        with open(path, encoding="utf-8") as f:
            pending = json.load(f)
    except FileNotFoundError:
        return [], ["no pending.json in the slot directory"]
    except (OSError, ValueError) as e:
        return [], [f"pending.json unreadable: {e}"[:300]]
    if not isinstance(pending, list):
        return [], ["pending.json is not a list"]
    out: list[Proposal] = []
    for item in pending:
        if len(out) >= request.slots:
            problems.append(f"more than {request.slots} candidates: the rest ignored")
            break
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            problems.append("pending entry without a name")
            continue
        name = item["name"]
        if not _SLOT_NAME.match(name):
            problems.append(f"bad candidate name {name[:60]!r}")
            continue
        src = os.path.join(request.slot_dir, name, "harness.py")
        if os.path.islink(src) or not os.path.isfile(src):
            problems.append(f"{name}: no harness.py")
            continue
        if os.path.getsize(src) > MAX_SOURCE:
            problems.append(f"{name}: harness.py over {MAX_SOURCE} bytes")
            continue
        with open(src, encoding="utf-8", errors="replace") as f:
            source = f.read()
        out.append(Proposal(
            name=name, source=source, proposer=proposer,
            hypothesis=str(item.get("hypothesis", ""))[:4000],
            changes=str(item.get("changes", ""))[:4000],
        ))  # fmt: skip
    return out, problems


class ArchiveTools:
    """The tools an LLM proposer calls: read anywhere in the archive, write only into the slots,
    try a draft, submit. Paths are relative to the archive root (the slot directory is reachable as
    ``slots/``); resolved paths that leave their root are refused (``..``, absolute, symlinks)."""

    def __init__(self, request: ProposeRequest, *, max_read: int = 60_000):
        self.req = request
        self.max_read = max_read
        self.submitted = False
        self.trials = 0

    def _resolve(self, path: str, *, write: bool) -> str:
        if not isinstance(path, str) or "\0" in path:
            raise ValueError("path must be a string")
        rel = path.strip().lstrip("/")
        if rel == "slots" or rel.startswith("slots/"):
            base, tail = os.path.realpath(self.req.slot_dir), rel[len("slots") :].lstrip("/")
        elif write:
            raise PermissionError("writes go into the slot directory only ('slots/...')")
        else:
            base, tail = os.path.realpath(self.req.archive_dir), rel
        full = os.path.realpath(os.path.join(base, tail))
        if full != base and not full.startswith(base + os.sep):
            raise PermissionError(f"{path!r} is outside the {'slots' if write else 'archive'}")
        return full

    def list_dir(self, path: str = "") -> list[str]:
        full = self._resolve(path, write=False)
        return sorted(n + ("/" if os.path.isdir(os.path.join(full, n)) else "")
                      for n in os.listdir(full))[:500]  # fmt: skip

    def read_file(self, path: str, offset: int = 0) -> str:
        full = self._resolve(path, write=False)
        with open(full, encoding="utf-8", errors="replace") as f:
            f.seek(max(0, int(offset)))
            text = f.read(self.max_read + 1)
        if len(text) > self.max_read:
            return (
                text[: self.max_read]
                + f"\n[... more: read again with offset={int(offset) + self.max_read}]"
            )
        return text

    def grep(self, pattern: str, path: str = "") -> list[str]:
        rx = re.compile(pattern)
        full = self._resolve(path, write=False)
        hits: list[str] = []
        files = [full] if os.path.isfile(full) else [
            os.path.join(d, n) for d, _, names in os.walk(full) for n in sorted(names)]  # fmt: skip
        root = os.path.realpath(self.req.archive_dir)
        for fp in files:
            try:
                with open(fp, encoding="utf-8", errors="replace") as f:
                    for i, line in enumerate(f, 1):
                        if rx.search(line):
                            hits.append(f"{os.path.relpath(fp, root)}:{i}: {line.rstrip()[:300]}")
                            if len(hits) >= 200:
                                return hits
            except OSError:
                continue
        return hits

    def write_file(self, path: str, content: str) -> str:
        full = self._resolve(path, write=True)
        if len(content.encode("utf-8")) > MAX_SOURCE:
            raise ValueError(f"file over {MAX_SOURCE} bytes")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(content)
        return f"wrote {os.path.relpath(full, os.path.realpath(self.req.slot_dir))}"

    def trial(self, name: str) -> dict[str, Any]:
        if self.req.trial is None:
            return {"error": "trial runs are not available in this phase"}
        src = self._resolve(os.path.join("slots", name, "harness.py"), write=False)
        with open(src, encoding="utf-8") as f:
            source = f.read()
        self.trials += 1
        return self.req.trial(source)

    def submit(self) -> str:
        self.submitted = True
        return "submitted"

    def call(self, name: str, args: dict[str, Any]) -> Any:
        """Dispatch a tool call by name (what the LLM backends use); errors come back as text."""
        fn = {"list_dir": self.list_dir, "read_file": self.read_file, "grep": self.grep,
              "write_file": self.write_file, "trial": self.trial, "submit": self.submit}.get(name)  # fmt: skip
        if fn is None:
            return {"error": f"unknown tool {name!r}"}
        try:
            return fn(**args)
        except TypeError as e:
            return {"error": f"bad arguments for {name}: {e}"}
        except (OSError, ValueError, PermissionError, re.error) as e:
            return {"error": f"{type(e).__name__}: {e}"}


TOOL_SPECS: list[dict[str, Any]] = [
    {"name": "list_dir", "description": "List a directory of the archive (paths relative to the "
     "archive root; 'slots' is your writable slot directory).",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    {"name": "read_file", "description": "Read a text file of the archive (60k characters at a "
     "time; pass offset to continue).",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                     "offset": {"type": "integer"}},
                    "required": ["path"]}},
    {"name": "grep", "description": "Lines matching a regular expression under a path.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                     "path": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "write_file", "description": "Write a file into the slot directory (e.g. "
     "'slots/<name>/harness.py' or 'slots/pending.json').",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                     "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "trial", "description": "Run the draft slots/<name>/harness.py on a few logged "
     "search tasks with the current model; returns its score and stop reasons.",
     "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                    "required": ["name"]}},
    {"name": "submit", "description": "Finish: the candidates in pending.json are evaluated.",
     "parameters": {"type": "object", "properties": {}}},
]  # fmt: skip
