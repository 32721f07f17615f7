"""The import graph's floors (docs/architecture.md, "The map"): harness/ imports neither whale_jax
nor benchmarks, whale_jax/ does not import benchmarks, and no module imports jax from harness/
(sandboxed workers import its modules). Read from the source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each floor must not import (the first part of the module name).
FORBIDDEN = {
    "harness": {"whale_jax", "benchmarks", "jax", "flax", "optax", "orbax"},
    "whale_jax": {"benchmarks"},
}


def imported_tops(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("floor", sorted(FORBIDDEN))
def test_a_floor_imports_nothing_above_it(floor):
    files = sorted((REPO / floor).rglob("*.py"))
    assert files
    bad = {
        str(p.relative_to(REPO)): sorted(imported_tops(p) & FORBIDDEN[floor])
        for p in files
        if imported_tops(p) & FORBIDDEN[floor]
    }
    assert not bad, bad


def test_the_check_sees_an_upward_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from whale_jax.engine import client\n    import jax.numpy as jnp\n")
    assert {"whale_jax", "jax"} <= imported_tops(p)


# The rooms of each floor, in order: a room imports only from the rooms before it (and its own).
# A domain folder's recipes.py belongs to the search room: only the offline proposer loads it.
ROOMS = {
    "harness": ["contract", "sandbox", "domains", "executor", "search"],
    "whale_jax": ["models", "shared", "io", "engine", "train", "loop", "programs"],
}
PROGRAMS = {"main", "generate", "fetch_data", "export", "serve"}


def room_of(module: str, path: str = "") -> str | None:
    """The room of a dotted module name (harness.* or whale_jax.*); None for other packages."""
    parts = module.split(".")
    if parts[0] == "harness":
        if path.endswith("recipes.py"):
            return "harness.search"
        sub = parts[1] if len(parts) > 1 else ""
        return f"harness.{sub if sub in ROOMS['harness'] else 'contract'}"
    if parts[0] == "whale_jax":
        sub = parts[1] if len(parts) > 1 else ""
        if not sub:
            return (
                "whale_jax.face"  # the package's __init__: re-exports, imported by nothing inside
            )
        if sub in PROGRAMS:
            return "whale_jax.programs"
        return f"whale_jax.{sub if sub in ROOMS['whale_jax'] else 'shared'}"
    return None


def rank(room: str) -> tuple[int, int]:
    floor, name = room.split(".")
    if name == "face":
        return (1, len(ROOMS["whale_jax"]))
    return (0 if floor == "harness" else 1, ROOMS[floor].index(name))


@pytest.mark.parametrize("floor", sorted(ROOMS))
def test_a_room_imports_only_the_rooms_before_it(floor):
    bad = []
    for path in sorted((REPO / floor).rglob("*.py")):
        rel = path.relative_to(REPO)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        mine = room_of(module, str(rel))
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                theirs = room_of(name)
                if theirs is not None and theirs != mine and rank(theirs) > rank(mine):
                    bad.append(f"{rel}:{node.lineno} ({mine}) imports {name} ({theirs})")
    assert not bad, "\n".join(bad)


def test_the_room_check_sees_an_import_from_a_later_room():
    assert rank(room_of("harness.search.phase")) > rank(room_of("harness.executor.loop"))
    assert room_of("harness.domains.math.recipes", "harness/domains/math/recipes.py") == (
        "harness.search"
    )
    assert rank(room_of("whale_jax.loop.run")) > rank(room_of("whale_jax.train.rsft"))
    assert room_of("whale_jax.sharding") == "whale_jax.shared"
