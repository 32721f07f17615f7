"""A domain's tasks for a run: the four disjoint splits (weight-training, harness-search,
validation, test), fixed by ``--split_seed``, from the real data a user fetched
(``python -m whale_jax.fetch_data``) or from the domain's offline source.

Each domain's folder decides how (``harness.domains``: its ``load``, ``DATA_FILES`` and
``SOURCES``); the data directory's layout is the one ``whale_jax.fetch_data`` writes, and a missing
file is an error naming it, the flag and the command that fetches it.

``--data_dir`` may be a bucket (``gs://bucket/data``: the same path layer as the checkpoints,
``etils.epath``, with ``gcsfs``). Its files are staged first to a directory on this host's disk
(``$WHALE_DATA_CACHE``, default ``~/.cache/whale_jax/data``, one subdirectory per URL), and
loaded from there: every host of a TPU slice stages its own copy, and a VM that comes back from a
preemption with an empty disk stages again. A file already staged with the remote's size is kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
from collections.abc import Callable

from harness.domains import add_domain_dir, plugin
from harness.domains.base import DataError, DomainData
from whale_jax.loop.config import ConfigError, DataConfig

__all__ = ["DomainData", "gcsfs_missing", "load_domain_data", "stage"]

GCSFS_HINT = (
    "gs:// paths need the gcsfs package (pip install gcsfs; tpu_setup/tpu.py install adds it)"
)


def gcsfs_missing(url: str) -> bool:
    """A gs:// path without the package ``etils.epath`` reads it through."""
    return url.startswith("gs://") and importlib.util.find_spec("gcsfs") is None


def load_domain_data(cfg: DataConfig, log: Callable[[str], None] = print) -> DomainData:
    """The domain folder's ``load`` (``harness.domains``); its bad input is a ``ConfigError``
    (exit 2) naming the flag or file."""
    try:
        if cfg.domain_dir:
            add_domain_dir(cfg.domain_dir)
        if "://" in cfg.data_dir:
            local = staging_dir(cfg.data_dir)
            stage(cfg.data_dir, local, log=log)
            cfg = dataclasses.replace(cfg, data_dir=local)
        return plugin(cfg.domain).load(cfg)
    except DataError as e:
        raise ConfigError(str(e)) from None


def staging_dir(url: str) -> str:
    root = os.environ.get("WHALE_DATA_CACHE") or os.path.join("~", ".cache", "whale_jax", "data")
    name = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(root), name)


def stage(source: str, dest: str, log: Callable[[str], None] = print) -> int:
    """Copies every file under ``source`` (a bucket URL, or any path ``etils.epath`` reads) to the
    same relative path under ``dest``; a file already there with the source's size is kept, and
    each copy lands whole (written beside, then renamed). Returns the bytes copied. DataError
    naming ``--data_dir`` when the source cannot be listed or read."""
    from etils import epath

    if gcsfs_missing(source):
        raise DataError(f"--data_dir={source}: {GCSFS_HINT}")
    root = epath.Path(source)
    copied = 0
    try:
        files = sorted((d / name for d, _, names in root.walk() for name in names), key=str)
        if not files:
            raise DataError(f"--data_dir={source}: no files there (fetch them with python -m "
                            "whale_jax.fetch_data, then copy the directory up)")  # fmt: skip
        for remote in files:
            rel = os.path.relpath(str(remote), str(root))
            local = os.path.join(dest, rel)
            size = remote.stat().length
            if os.path.exists(local) and os.path.getsize(local) == size:
                continue
            os.makedirs(os.path.dirname(local), exist_ok=True)
            part = local + ".partial"
            with remote.open("rb") as f, open(part, "wb") as g:
                shutil.copyfileobj(f, g, 8 << 20)
            os.replace(part, local)
            copied += size
    except DataError:
        raise
    except Exception as e:  # gcsfs and google-auth raise their own types, not OSError
        raise DataError(f"--data_dir={source}: cannot read it ({type(e).__name__}: {e}); check "
                        "the bucket's name and this machine's credentials") from None  # fmt: skip
    if copied:
        log(f"staged {copied / 2**20:.1f} MiB of {source} to {dest}")
    return copied
