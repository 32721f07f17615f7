"""Domains: tasks, tools, verifiers and seed harnesses. ``get_domain(name)`` builds one by name."""

from __future__ import annotations

from harness.domains.base import Domain


def get_domain(name: str, **kwargs) -> Domain:
    if name == "arith":
        from harness.domains.arith import ArithDomain

        return ArithDomain(**kwargs)
    if name == "math":
        from harness.domains.math import MathDomain

        return MathDomain(**kwargs)
    if name == "searchqa":
        from harness.domains.searchqa import SearchQADomain

        return SearchQADomain(**kwargs)
    if name == "chess":
        from harness.domains.chess import ChessDomain

        return ChessDomain(**kwargs)
    raise ValueError(f"unknown domain {name!r} (arith, math, searchqa, chess)")
