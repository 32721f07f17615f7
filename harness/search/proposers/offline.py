"""The offline proposer: harness candidates from a catalogue of real transformations, no LLM.

It is the default proposer where no network is reachable. Each domain's folder has a recipes
module (``harness/domains/<name>/recipes.py``, built from ``harness.search.proposers.kit``) with a
catalogue of *variants*: one mechanism at one setting, with a stable id (``repair``, ``vote-k5``,
``obs-pieces``, ...). A variant is a change to a *recipe*, a dict from mechanism to setting, and
a recipe renders (``render``) to a complete harness module that contains the code of exactly the
mechanisms it names. The recipes module's contract: ``catalogue()`` and ``prompt_catalogue()``
(lists of ``kit.Variant``), ``render(recipe)`` (the code variants' module), and the optional
evidence hooks ``classify``, ``tally_wrong``, ``describe`` and ``describe_wrong``
(``kit.gather_evidence``).

Lineage: candidates compose along the proposer's own line. Every proposal records its variant id
and its full recipe in ``changes``; a later call reads them back from every ``proposal.json`` of
every phase. The *base* is the best candidate of the current phase whose recipe is known (one of
this proposer's candidates, a harness with the same source, or h0 itself, whose recipe is empty);
each proposal is the base's recipe plus one variant, so the winner of one iteration carries its
mechanisms into the next. A best harness the proposer did not write (an LLM proposer's) cannot be
decomposed into mechanisms, so code variants build on the best *known* recipe instead; prompt-only
edits work on any source and apply to the best candidate itself.

Evidence: the traces of the base (``traces.jsonl``; else of the best evaluated candidate, else of
the previous phase's accepted one), counted by outcome (``Evidence``): episodes
that ended without an answer or with no parsable answer, answered but wrong (with short or long
completions), budget stops, completions cut at the token limit, and per domain: shallow retrieval
(searchqa), wrong answers after a tool turn (math), illegal / malformed / rejected moves and
give-ups (chess). Each variant weighs the evidence that its mechanism addresses (format repair and
instruction for missing answers, voting and verification for wrong ones, fewer or shorter calls
for budget stops, observation formatting and retries for illegal moves, ...); the highest weights
win, one variant per mechanism per call while the catalogue allows. Without traces the
catalogue's priors order the variants. The seed only breaks exact ties, so proposals are a
function of (seed, archive contents).

A variant id is never proposed twice in one archive (across phases): when the catalogue is spent
the proposer says so in its problems instead of repeating itself.

Prompt-only mode (the Fast-Slow control): only the values of the prompt constants change. The
edit appends a sentence or block to the harness's main prompt constant (``SYSTEM_PROMPT``, else
``USER_PROMPT_TEMPLATE`` or chess's ``USER_PROMPT``: what the phase's prompt-only audit lets
change) and splices the new literal into the source, so the code is untouched byte for byte;
braces are doubled when the constant is a ``.format`` template.

Every generated source passes ``harness.sandbox.static_check.check_source`` for the domain before it is
returned. Few-shot examples are invented from each domain's public format and written so the
prompt audits cannot mistake them for answers: arithmetic examples use the operands 0 and 1 (the
generator never does), harness-written example text holds no number of two or more digits
(``harness.executor.audits`` ignores shorter strings), question-answering examples name invented places
and people, and no chess prompt spells out a move.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from types import ModuleType
from typing import Any

from harness.domains import get_domain, recipes_of
from harness.domains.base import Domain
from harness.records import EpisodeRecord
from harness.sandbox.static_check import check_source
from harness.search.archive import Archive, Candidate, Phase, Proposal
from harness.search.proposers.base import ProposeRequest, Usage
from harness.search.proposers.kit import Evidence, Variant, edit_prompt, gather_evidence

__all__ = ["OfflineProposer", "catalogue", "edit_prompt", "prompt_catalogue", "render"]

# ---- a domain's recipes ------------------------------------------------------------------------


def catalogue(domain: str) -> list[Variant]:
    """Every code variant of a domain, in prior order within each mechanism."""
    return recipes_of(domain).catalogue()


def prompt_catalogue(domain: str) -> list[Variant]:
    return recipes_of(domain).prompt_catalogue()


def valid_recipe(domain: str, recipe: Any) -> bool:
    """A recipe this version can render: known mechanisms at known settings."""
    if not isinstance(recipe, dict):
        return False
    settings = {(v.mechanism, json.dumps(v.value)) for v in catalogue(domain)}
    prompts = {v.id for v in prompt_catalogue(domain)}
    for mech, value in recipe.items():
        if mech == "prompts":
            if not isinstance(value, list) or not all(p in prompts for p in value):
                return False
        elif (mech, json.dumps(value)) not in settings:
            return False
    return True


def render(domain: str, recipe: dict[str, Any]) -> str:
    """The complete harness of a recipe: its code variants, then its prompt edits in order."""
    source = recipes_of(domain).render(recipe)
    edits = {v.id: v.value for v in prompt_catalogue(domain)}
    for vid in recipe.get("prompts", []):
        edited = edit_prompt(source, edits[vid])
        if edited is None:
            raise ValueError(f"{domain} recipe: no prompt constant for {vid}")
        source = edited
    return source


# ---- reading the archive -----------------------------------------------------------------------

VARIANT_LINE = re.compile(r"^variant:\s*(\S+)\s*$", re.MULTILINE)
RECIPE_LINE = re.compile(r"^recipe:\s*(\{.*\})\s*$", re.MULTILINE)


@dataclasses.dataclass
class Lineage:
    """What the archive says: every candidate, the variant ids tried, and the recipe of every
    source the proposer can rebuild."""

    current: list[Candidate]  # the current phase's candidates
    earlier: list[Phase]  # earlier phases, latest first
    tried: set[str]
    recipes: dict[str, dict[str, Any]]  # source -> recipe
    sources: set[str]


def read_lineage(request: ProposeRequest, domain: Domain) -> Lineage:
    current_phase = Phase(request.phase_dir)
    here = os.path.realpath(request.phase_dir)
    phases = [p for p in Archive(request.archive_dir).phases() if os.path.realpath(p.root) != here]
    tried: set[str] = set()
    recipes: dict[str, dict[str, Any]] = {domain.seed_harness(): {}}
    sources: set[str] = set()
    current = current_phase.candidates()
    for cand in [c for p in phases for c in p.candidates()] + current:
        changes = str(cand.proposal.get("changes", ""))
        tried.update(VARIANT_LINE.findall(changes))
        sources.add(cand.source)
        found = RECIPE_LINE.search(changes)
        if found and cand.proposal.get("proposer") == "offline":  # only its own recipes
            try:
                recipe = json.loads(found.group(1))
            except ValueError:
                continue
            if valid_recipe(domain.name, recipe):
                recipes.setdefault(cand.source, recipe)
    return Lineage(current=current, earlier=phases[::-1], tried=tried, recipes=recipes,
                   sources=sources)  # fmt: skip


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Valid candidates, best first: success up, turns down, then the earlier candidate."""

    def order(c: Candidate) -> tuple[float, float, str]:
        summary = c.summary or {}
        return (
            -float(summary.get("success_rate", 0.0)),
            float(summary.get("mean_turns", 0.0)),
            c.name,
        )

    return sorted((c for c in candidates if c.summary is not None), key=order)


def traces_of(phase: Phase, cand: Candidate) -> list[EpisodeRecord]:
    try:
        return list(phase.traces(cand.name))
    except (OSError, ValueError, TypeError):
        return []


# ---- the proposer ------------------------------------------------------------------------------


@dataclasses.dataclass
class Parent:
    label: str  # how hypotheses name it
    source: str
    recipe: dict[str, Any] | None  # None: not a recipe this proposer can rebuild


class OfflineProposer:
    """Catalogue proposer: evidence from the traces chooses which untried variants to add to the
    best known recipe (see the module docstring)."""

    name = "offline"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.usage = Usage()  # no model: nothing spent

    def propose(self, request: ProposeRequest) -> tuple[list[Proposal], list[str]]:
        try:
            domain = get_domain(request.domain)
            variants = (prompt_catalogue if request.prompt_only else catalogue)(domain.name)
        except ValueError as e:
            return [], [str(e)]
        if request.slots <= 0:
            return [], []
        lineage = read_lineage(request, domain)
        best = ranked(lineage.current)
        parent, evidence = self.parent(request, domain, lineage, best)
        rng = random.Random(f"{self.seed}/{domain.name}/{request.iteration}")
        order = sorted(
            (v for v in variants if v.id not in lineage.tried and self.changes_parent(v, parent)),
            key=lambda v: (-(round(v.weigh(evidence), 9) + 0.01 * v.prior), rng.random()),
        )
        # The best variant of each mechanism first, so the slots spread over mechanisms; the
        # runners-up only when there are more slots than mechanisms left.
        firsts = [v for i, v in enumerate(order)
                  if all(u.mechanism != v.mechanism for u in order[:i])]  # fmt: skip
        proposals: list[Proposal] = []
        problems: list[str] = []
        for v in firsts + [v for v in order if v not in firsts]:
            if len(proposals) == request.slots:
                break
            made = self.build(domain, v, parent, evidence, lineage)
            if isinstance(made, str):
                problems.append(made)
            else:
                proposals.append(made)
        proposals.sort(key=lambda p: next(i for i, v in enumerate(order) if v.id == p.name))
        if len(proposals) < request.slots:
            problems.append(
                f"{len(proposals)} of {request.slots} slots filled: the {domain.name} "
                f"{'prompt' if request.prompt_only else 'code'} catalogue has no other untried "
                f"variant ({len(lineage.tried)} variant ids tried in this archive)"
            )
        return proposals, problems

    def parent(
        self, request: ProposeRequest, domain: Domain, lineage: Lineage, best: list[Candidate]
    ) -> tuple[Parent, Evidence]:
        """Prompt-only: the best candidate itself (any source). Code variants: the best candidate
        with a known recipe, else the latest earlier phase's accepted one, else h0. Evidence: the
        parent's traces, else the current best candidate's, else (nothing evaluated in this phase
        yet) the traces of the latest accepted candidate of an earlier phase."""
        pool = best if request.prompt_only else [c for c in best if c.source in lineage.recipes]
        chosen = pool[0] if pool else None
        if chosen is not None:
            parent = Parent(chosen.name, chosen.source, lineage.recipes.get(chosen.source))
        else:
            usable = [a for p in lineage.earlier if (a := p.accepted()) is not None
                      and (request.prompt_only or a.source in lineage.recipes)]  # fmt: skip
            if usable:
                src = usable[0].source
                parent = Parent(f"{usable[0].name} (accepted earlier)", src,
                                lineage.recipes.get(src))  # fmt: skip
            else:
                parent = Parent("h0", domain.seed_harness(), {})
        hooks: ModuleType = recipes_of(domain.name)
        here = Phase(request.phase_dir)
        sources = [(here, c) for c in ([chosen] if chosen is not None else []) + best]
        sources += [(p, a) for p in lineage.earlier if (a := p.accepted()) is not None]
        for phase, cand in sources:
            records = traces_of(phase, cand)
            if records:
                return parent, gather_evidence(domain.name, cand.name, records, hooks)
        return parent, Evidence(domain=domain.name)

    @staticmethod
    def changes_parent(v: Variant, parent: Parent) -> bool:
        if v.prompt or parent.recipe is None:
            return True
        return parent.recipe.get(v.mechanism) != v.value

    def build(self, domain: Domain, v: Variant, parent: Parent, evidence: Evidence,
              lineage: Lineage) -> Proposal | str:  # fmt: skip
        """The proposal of one variant on the parent, or the reason there is none."""
        recipe: dict[str, Any] | None = None
        if v.prompt:
            source = edit_prompt(parent.source, v.value)
            if source is None:
                return f"{v.id}: {parent.label} has no module-level prompt string to edit"
            if parent.recipe is not None:
                recipe = {**parent.recipe, "prompts": [*parent.recipe.get("prompts", []), v.id]}
        else:
            recipe = {**(parent.recipe or {}), v.mechanism: v.value}
            source = render(domain.name, recipe)
        violations = check_source(source, allowed_imports=domain.allowed_imports)
        if violations:
            return f"{v.id}: generated source fails the static check: {violations[0]}"
        if source in lineage.sources or source == parent.source:
            return f"{v.id}: the same source is already in the archive"
        lines = [f"variant: {v.id}", f"mechanism: {v.mechanism}: {v.what}",
                 f"base: {parent.label}"]  # fmt: skip
        if recipe is not None:
            lines.append("recipe: " + json.dumps(recipe, sort_keys=True))
        hypothesis = (
            f"{evidence.describe()} {v.why} Change from {parent.label}: {v.what}; nothing else."
        )
        return Proposal(name=v.id, source=source, hypothesis=hypothesis,
                        changes="\n".join(lines), proposer=self.name)  # fmt: skip
