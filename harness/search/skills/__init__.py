"""Proposer skill texts: one markdown file per domain (``<domain>.md``), shipped as package data.

The skill text is the system prompt of an LLM proposer and the single most important lever of the
search (Meta-Harness): it states the contract, the trusted/untrusted boundary, what may change,
how to read the archive and the output contract. ``skill_text(domain)`` reads it.
"""

from __future__ import annotations

import importlib.resources
import re


def available() -> list[str]:
    """The domains with a skill text."""
    files = importlib.resources.files(__name__).iterdir()
    return sorted(f.name[:-3] for f in files if f.name.endswith(".md"))


def skill_text(domain: str) -> str:
    """The skill text of ``domain``; ValueError naming the domain when there is none."""
    if not isinstance(domain, str) or not re.fullmatch(r"[a-z0-9_]+", domain):
        raise ValueError(f"no proposer skill text for domain {domain!r}: not a domain name")
    resource = importlib.resources.files(__name__).joinpath(f"{domain}.md")
    if not resource.is_file():
        raise ValueError(
            f"no proposer skill text for domain {domain!r} (harness/search/skills/{domain}.md "
            f"is missing; available: {', '.join(available())})"
        )
    return resource.read_text(encoding="utf-8")
