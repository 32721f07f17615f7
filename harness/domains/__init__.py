"""Domains as plug-ins: each domain is one folder, found by its name. Nothing outside a domain's
folder switches on its name.

A domain folder (``harness/domains/<name>/``, or one under a directory given to ``add_domain_dir``)
holds:

- ``__init__.py``: the domain itself: its ``Domain`` subclass as ``DOMAIN`` (tasks' public view,
  tools, verifier), ``DATA_FILES`` (the files under ``--data_dir`` its real data lives in; may be
  empty), ``SOURCES`` (what ``python -m whale_jax.fetch_data`` downloads into them; may be empty)
  and ``load(spec) -> DomainData`` (the four splits and the built domain, from ``DataSpec``);
- ``h0.py``: the seed harness (data: read as text, run in the sandbox);
- ``skill.md``: the proposer's skill text;
- ``recipes.py``: the offline proposer's catalogue and renderer
  (``harness.search.proposers.offline`` has its contract).

docs/domains.md walks through adding one.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.domains.base import Domain

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_REQUIRED = ("DOMAIN", "DATA_FILES", "SOURCES", "load")
_FILES = ("h0.py", "skill.md", "recipes.py")
_extra: dict[str, Path] = {}  # out-of-tree domains: name -> folder
_lock = threading.Lock()


def _folders() -> dict[str, Path]:
    here = Path(__file__).parent
    found = {p.name: p for p in here.iterdir() if (p / "__init__.py").is_file()}
    return {**found, **_extra}


def names() -> list[str]:
    """Every domain this process can run."""
    return sorted(n for n in _folders() if _NAME.fullmatch(n))


def add_domain_dir(path: str | os.PathLike[str]) -> list[str]:
    """Make the domain folders under ``path`` available (a user's own domains); returns their
    names. A name already taken is an error naming both folders."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"domain directory {os.fspath(path)!r} does not exist")
    added = []
    with _lock:
        for sub in sorted(root.iterdir()):
            if not (sub / "__init__.py").is_file() or not _NAME.fullmatch(sub.name):
                continue
            taken = _folders().get(sub.name)
            if taken is not None and taken.resolve() != sub.resolve():
                raise ValueError(f"domain {sub.name!r} in {sub} is already defined in {taken}")
            _extra[sub.name] = sub
            added.append(sub.name)
    return added


def plugin(name: str) -> ModuleType:
    """The domain folder's package, its contract checked; ValueError naming what is missing."""
    folders = _folders()
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name not in folders:
        raise ValueError(f"unknown domain {name!r} (available: {', '.join(names())})")
    folder = folders[name]
    if name in _extra:
        module_name = f"harness_domain_{name}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(
                module_name, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(f"{__name__}.{name}")
    missing = [a for a in _REQUIRED if not hasattr(module, a)]
    missing += [f for f in _FILES if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"domain folder {folder} lacks {', '.join(missing)}")
    return module


def get_domain(name: str, **kwargs: Any) -> Domain:
    """The domain ``name`` built with its options (e.g. a retriever for searchqa)."""
    return plugin(name).DOMAIN(**kwargs)


def folder_of(name: str) -> Path:
    plugin(name)
    return _folders()[name]


def skill_text(name: str) -> str:
    """The proposer's skill text of domain ``name``; ValueError naming the domain otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"no proposer skill text for domain {name!r}: not a domain name")
    try:
        return (folder_of(name) / "skill.md").read_text(encoding="utf-8")
    except ValueError as e:
        raise ValueError(f"no proposer skill text for domain {name!r}: {e}") from None


def recipes_of(name: str) -> ModuleType:
    """The offline proposer's recipes module of domain ``name``."""
    module = plugin(name)
    return importlib.import_module(f"{module.__name__}.recipes")
