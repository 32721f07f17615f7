"""Fetch and prepare a domain's public data into the layout the loop reads (whale_jax/loop/data.py):

    python -m whale_jax.fetch_data --domain=math --data_dir=data        # or searchqa, chess, all
    python -m whale_jax.fetch_data --domain=math --data_dir=data --verify

Each prepared file is recorded in ``<data_dir>/MANIFEST.json`` with its SHA-256, size and source
(Hugging Face dataset repo and revision). A rerun skips files whose checksum matches the manifest,
re-prepares the others, and resumes interrupted downloads (huggingface_hub keeps partial files);
``--verify`` recomputes every checksum and fails on a mismatch. Needs network (the hub); never
called by tests or by a run.

Sources: each domain folder's ``SOURCES`` (``harness.domains``; FORMATS.md): DAPO-Math-17K, AIME
2024 and 2025; Search-R1's NQ+HotpotQA training set, the seven QA test sets from FlashRAG (each gets
its ``data_source`` column) and the wiki-18 corpus; the Lichess puzzle database (the Hugging Face
export).
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable

from harness import domains
from harness.data import read_rows
from harness.domains.base import Source
from harness.files import write_json


def sources(domain: str) -> list[Source]:
    """What a domain folder says to fetch (its ``SOURCES``)."""
    return list(domains.plugin(domain).SOURCES)


def fetchable() -> list[str]:
    """The domains with public data to fetch."""
    return [d for d in domains.names() if domains.plugin(d).SOURCES]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hub_download(repo: str, patterns: tuple[str, ...], dest: str, revision: str) -> list[str]:
    """The repo's files matching ``patterns`` under ``dest`` (resumable); sorted paths."""
    from huggingface_hub import snapshot_download

    root = snapshot_download(repo, repo_type="dataset", revision=revision,
                             allow_patterns=list(patterns), local_dir=dest)  # fmt: skip
    return matching(root, patterns)


def matching(root: str, patterns: tuple[str, ...]) -> list[str]:
    """The files of the first pattern that matches any (a repo with the same rows as parquet and
    as JSONL gives them once), sorted; patterns match the relative path or the file name."""
    files = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [os.path.join(dirpath, n) for n in names]
    for pattern in patterns:
        found = [f for f in files
                 if fnmatch.fnmatch(os.path.relpath(f, root), pattern)
                 or fnmatch.fnmatch(os.path.basename(f), pattern)]  # fmt: skip
        if found:
            return sorted(found)
    return []


def prepare(source: Source, files: list[str], out: str) -> None:
    """Writes ``out`` from the downloaded ``files`` atomically (a temporary file, then a rename)."""
    if not files:
        raise FileNotFoundError(f"{source.repo}: no file matches {source.patterns}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".partial"
    if source.prepare == "gunzip":
        with gzip.open(files[0], "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if source.prepare == "parquet":
            table = pa.concat_tables([pq.read_table(p) for p in files], promote_options="default")
        else:
            rows = [row for p in files for row in read_rows(p)]
            if source.columns:
                rows = [{k: row.get(k) for k in source.columns} for row in rows]
            table = pa.Table.from_pylist(rows)
        if source.data_source:
            column = pa.array([source.data_source] * table.num_rows)
            if "data_source" in table.column_names:
                table = table.drop_columns(["data_source"])
            table = table.append_column("data_source", column)
        pq.write_table(table, tmp)
    os.replace(tmp, out)


def fetch(
    domain: str,
    data_dir: str,
    *,
    revision: str = "main",
    download: Callable[[str, tuple[str, ...], str, str], list[str]] = hub_download,
    log: Callable[[str], None] = print,
) -> dict:
    manifest_path = os.path.join(data_dir, "MANIFEST.json")
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    for source in sources(domain):
        out = os.path.join(data_dir, source.out)
        known = manifest.get(source.out)
        if known and os.path.exists(out) and sha256(out) == known["sha256"]:
            log(f"{source.out}: present, checksum matches")
            continue
        t0 = time.monotonic()
        log(f"{source.out}: fetching {source.repo} ({', '.join(source.patterns)})")
        dest = os.path.join(data_dir, ".downloads", source.repo.replace("/", "__"))
        files = download(source.repo, source.patterns, dest, revision)
        prepare(source, files, out)
        manifest[source.out] = {"sha256": sha256(out), "bytes": os.path.getsize(out),
                                "repo": source.repo, "revision": revision,
                                "files": [os.path.relpath(p, dest) for p in files]}  # fmt: skip
        write_json(manifest_path, manifest)
        log(f"{source.out}: {manifest[source.out]['bytes']:,} bytes, sha256 "
            f"{manifest[source.out]['sha256'][:16]}... ({time.monotonic() - t0:.0f}s)")  # fmt: skip
    return manifest


def verify(domain: str, data_dir: str, log: Callable[[str], None] = print) -> list[str]:
    """Problems (missing files, checksum mismatches) of a domain's prepared data."""
    manifest_path = os.path.join(data_dir, "MANIFEST.json")
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    problems = []
    for source in sources(domain):
        out = os.path.join(data_dir, source.out)
        if source.out not in manifest:
            problems.append(f"{out}: not in {manifest_path} (not fetched)")
        elif not os.path.exists(out):
            problems.append(f"{out}: missing")
        elif sha256(out) != manifest[source.out]["sha256"]:
            problems.append(f"{out}: checksum differs from {manifest_path}")
        else:
            log(f"{source.out}: ok")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domain", required=True, help="a domain with data to fetch, or all")
    p.add_argument("--data_dir", default="data")
    p.add_argument("--revision", default="main", help="dataset revision (branch, tag or commit)")
    p.add_argument("--verify", action="store_true", help="only check the prepared files")
    args = p.parse_args(argv)
    chosen = fetchable() if args.domain == "all" else [args.domain]
    if any(d not in fetchable() for d in chosen):
        p.error(f"--domain={args.domain}: expected one of {', '.join(fetchable())} or all")
    if args.verify:
        problems = [x for d in chosen for x in verify(d, args.data_dir)]
        for x in problems:
            print(f"error: {x}", file=sys.stderr)
        return 1 if problems else 0
    for d in chosen:
        fetch(d, args.data_dir, revision=args.revision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
