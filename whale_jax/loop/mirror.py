"""The run directory mirrored to a bucket, so a run whose VM (and disk) is gone resumes elsewhere.

A preemptible TPU VM loses its disk with it. The checkpoints can live in a bucket (Orbax writes
``gs://`` itself), but a resume also needs the run directory: ``config.json``, the metrics the
checkpoint counts, the harness archive holding the accepted harness's source. ``--run_dir_mirror``
keeps a copy of the run directory at a URL (``gs://bucket/path``, or any local path):

- **push** at every checkpoint save, *before* the save, and when the run ends: the files that
  changed since the last push are copied, the ones gone locally (phases moved aside on a resume)
  are deleted, and the manifest (``.whale-mirror.json``: each file's size and mtime) is written
  last. A save is therefore only ever made when the mirror holds everything it refers to; a push
  cut short leaves the previous checkpoint standing with a mirror that holds at least what it
  needs (files only grow or are added between saves; a resume cuts back the metrics and moves
  aside phases past its checkpoint). A destination is claimed with an empty manifest before
  its first file is copied, so a first push cut short leaves a mirror this run recognises.
- **restore** when a run starts and its local run directory has no ``config.json`` (a fresh VM):
  the files the manifest lists are copied down with their recorded mtimes, so the next push sends
  only what changes. A local run directory that has ``config.json`` is newer than its mirror and
  is kept as it is.

Only files the manifest lists are ever deleted from the mirror, and a non-empty destination with
no manifest is refused, so pointing the flag at a path holding other data loses none of it.
``compile_cache/`` and ``checkpoints/`` are not mirrored (point ``--compilation_cache_dir`` at a
bucket to keep compiled programs; with a mirror the checkpoints default to ``<mirror>/checkpoints``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

MANIFEST = ".whale-mirror.json"
NOT_MIRRORED = ("compile_cache", "checkpoints")  # top-level entries of the run directory
_CHUNK = 8 << 20


class MirrorError(RuntimeError):
    """The mirror cannot be read or written (the message names the path)."""


class MirrorRefused(MirrorError):
    """The destination is not this run's mirror (foreign data, an unknown manifest): bad input,
    which rerunning does not mend."""


def _path(url: str):
    from etils import epath

    return epath.Path(url)


def _copy(src, dst) -> None:
    with src.open("rb") as f, dst.open("wb") as g:
        shutil.copyfileobj(f, g, _CHUNK)


def _manifest(files: dict[str, list[int]]) -> dict[str, Any]:
    return {"version": 1, "written": round(time.time(), 3), "files": files}


class Mirror:
    def __init__(
        self,
        root: str,
        url: str,
        *,
        log: Callable[[str], None] = print,
        attempts: int = 3,
        backoff_s: float = 2.0,
    ):
        self.root, self.url, self.log = root, url.rstrip("/"), log
        self.attempts, self.backoff_s = attempts, backoff_s
        self._remote = _path(self.url)
        self._manifest: dict[str, list[int]] | None = None  # what the mirror holds, once read
        self._claimed = False  # the destination holds a manifest (ours)

    # ---- reading the mirror --------------------------------------------------------------------

    def _read_manifest(self) -> dict[str, list[int]]:
        """The mirror's manifest; {} for an empty or missing destination. A destination holding
        anything else (besides the checkpoints) without a manifest is refused."""
        if self._manifest is not None:
            return self._manifest
        manifest_path = self._remote / MANIFEST
        try:
            if manifest_path.exists():
                data = json.loads(manifest_path.read_text())
                files = data.get("files")
                if data.get("version") != 1 or not isinstance(files, dict):
                    raise MirrorRefused(f"{manifest_path}: not a manifest this version writes")
                self._manifest = {str(k): [int(v[0]), int(v[1])] for k, v in files.items()}
                self._claimed = True
                return self._manifest
            others = (
                sorted(p.name for p in self._remote.iterdir() if p.name not in NOT_MIRRORED)
                if self._remote.exists()
                else []
            )
        except MirrorError:
            raise
        except (OSError, ValueError, TypeError, IndexError) as e:
            raise MirrorError(f"--run_dir_mirror={self.url}: cannot read it: {e}") from e
        if others:
            raise MirrorRefused(
                f"--run_dir_mirror={self.url}: holds {others[:5]} but no {MANIFEST}: not a run "
                "directory's mirror; choose an empty path (nothing there was changed)"
            )
        self._manifest = {}
        return self._manifest

    def restore(self) -> int:
        """Copies the mirrored run directory down when the local one has not started (no
        config.json); returns the number of files copied."""
        if os.path.exists(os.path.join(self.root, "config.json")):
            self._read_manifest()  # still refuse a foreign destination before the run writes
            return 0
        files = self._read_manifest()
        if not files:
            return 0
        t0 = time.monotonic()
        for rel, (size, mtime_ns) in sorted(files.items()):
            dst = os.path.join(self.root, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            tmp = dst + ".mirror-part"
            self._retry(
                f"copying {rel} from it", lambda r=rel, t=tmp: _copy(self._remote / r, _path(t))
            )
            # A push cut short may have sent a newer file than its manifest lists: keep it (the
            # resume cuts back what its checkpoint has not reached); the next push sends it again.
            same = os.path.getsize(tmp) == size
            os.replace(tmp, dst)
            if same:
                os.utime(dst, ns=(mtime_ns, mtime_ns))
        self.log(f"run directory restored from {self.url}: {len(files)} files "
                 f"in {time.monotonic() - t0:.1f}s")  # fmt: skip
        return len(files)

    # ---- writing it ----------------------------------------------------------------------------

    def local_files(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for top, dirs, names in os.walk(self.root):
            rel_top = os.path.relpath(top, self.root)
            if rel_top == ".":
                dirs[:] = [d for d in dirs if d not in NOT_MIRRORED]
            for name in names:
                if name.endswith(".mirror-part") or (rel_top == "." and name == MANIFEST):
                    continue
                st = os.stat(os.path.join(top, name))
                rel = name if rel_top == "." else os.path.join(rel_top, name)
                out[rel.replace(os.sep, "/")] = [st.st_size, st.st_mtime_ns]
        return out

    def push(self) -> dict[str, int]:
        """Makes the mirror equal the run directory (except what is not mirrored); returns the
        counts of files copied and deleted. Raises MirrorError after ``attempts`` tries."""
        old = dict(self._read_manifest())
        if not self._claimed:
            # An empty manifest before the first file: a first push cut short leaves a
            # destination this run still recognises as its own, not a foreign one it refuses.
            self._retry(f"writing {MANIFEST}", lambda: self._write_manifest(_manifest({})))
            self._claimed = True
        local = self.local_files()
        changed = sorted(rel for rel, st in local.items() if old.get(rel) != st)
        for rel in changed:
            # A file removed between the walk and its copy is left out of this push.
            src = os.path.join(self.root, rel)
            if not os.path.exists(src):
                local.pop(rel)
                continue
            self._retry(f"copying {rel} to it", lambda r=rel, s=src: self._put(s, r))
        gone = sorted(set(old) - set(local))  # after the copies: a file removed meanwhile too
        for rel in gone:
            self._retry(
                f"deleting {rel} from it", lambda r=rel: (self._remote / r).unlink(missing_ok=True)
            )
        self._retry(f"writing {MANIFEST}", lambda: self._write_manifest(_manifest(local)))
        self._manifest = local
        return {"copied": len(changed), "deleted": len(gone)}

    def _put(self, src: str, rel: str) -> None:
        dst = self._remote / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        _copy(_path(src), dst)

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        self._remote.mkdir(parents=True, exist_ok=True)
        tmp = self._remote / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, sort_keys=True))
        tmp.replace(self._remote / MANIFEST)

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as e:  # gcsfs and google-auth raise their own types, not OSError
                if attempt == self.attempts:
                    raise MirrorError(
                        f"--run_dir_mirror={self.url}: {what} failed {attempt} times: {e}"
                    ) from e
                self.log(
                    f"mirror: {what} failed ({e}); retrying in {self.backoff_s * attempt:.0f}s"
                )
                time.sleep(self.backoff_s * attempt)
        raise AssertionError("unreachable")
