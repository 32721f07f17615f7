"""A harness phase end to end: archive, audits, evaluation, Pareto acceptance, resume, the command
proposer and prompt-only mode, with the real executor and an instant scripted model."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest

from harness.backends import ScriptedBackend
from harness.domains.arith import ArithDomain, generate
from harness.executor import Executor, ExecutorConfig
from harness.search import frontier
from harness.search.archive import Archive
from harness.search.phase import HarnessPhase, SearchConfig
from harness.search.proposers.base import ProposeRequest, collect
from harness.search.proposers.command import CommandProposer
from harness.search.validate import ValidationConfig, leakage, prompt_only_change
from tests.harness.conftest import TEST_BUDGETS, TEST_LIMITS

H0 = ArithDomain().seed_harness()


def careful_model(request) -> str:
    """Sums the last user message's numbers only when told to think step by step; otherwise
    answers one too many (a model that needs the right prompt)."""
    text = request.messages[-1]["content"]
    total = sum(int(x) for x in re.findall(r"\d+", text))
    system = request.messages[0]["content"] if request.messages[0]["role"] == "system" else ""
    return str(total if "step by step" in system else total + 1)


STEP = H0.replace("Answer with only the number.", "Think step by step, then give the number.")
COMPUTES = """
import re


def run(task, model, tools):
    total = sum(int(x) for x in re.findall(r"[0-9]+", task.question))
    return model.chat([{"role": "user", "content": "Repeat exactly: " + str(total)}])
"""
HOSTILE = "import os\n\ndef run(task, model, tools):\n    return os.environ.get('HOME')\n"
LOOPS = "def run(task, model, tools):\n    while True:\n        pass\n"  # passes the static check


class ListProposer:
    """Writes given sources into the slots per the output contract; real ``collect``."""

    name = "list"

    def __init__(self, rounds: list[list[tuple[str, str]]]):
        self.rounds, self.calls = rounds, 0

    def propose(self, request: ProposeRequest):
        batch = self.rounds[min(self.calls, len(self.rounds) - 1)]
        self.calls += 1
        pending = []
        for name, source in batch:
            os.makedirs(os.path.join(request.slot_dir, name))
            with open(os.path.join(request.slot_dir, name, "harness.py"), "w") as f:
                f.write(source)
            pending.append({"name": name, "hypothesis": f"h-{name}", "changes": f"c-{name}"})
        with open(os.path.join(request.slot_dir, "pending.json"), "w") as f:
            json.dump(pending, f)
        return collect(request, self.name)


@pytest.fixture()
def setup(tmp_path):
    tasks = generate(6, seed=21)
    config = ExecutorConfig(concurrency=8, budgets=TEST_BUDGETS, limits=TEST_LIMITS)
    ex = Executor(ScriptedBackend(careful_model), config)
    yield tasks, ex, Archive(str(tmp_path / "archive"))
    ex.close()


def leaking(tasks) -> str:
    table = {t.question: str(t.gold) for t in tasks}
    return f"TABLE = {table!r}\n" + H0


def test_phase_audits_scores_and_accepts(setup):
    tasks, ex, archive = setup
    proposer = ListProposer([[("step", STEP), ("leak", leaking(tasks)), ("computes", COMPUTES)],
                             [("hostile", HOSTILE), ("loops", LOOPS), ("h0-again", H0)]])  # fmt: skip
    phase = HarnessPhase(archive=archive, index=1, domain=ArithDomain(), executor=ex,
                         search_tasks=tasks, proposer=proposer, skill="skill",
                         config=SearchConfig(iterations=3, slots=3), weights={"step": 7},
                         log=lambda s: None)  # fmt: skip
    result = phase.run(H0)
    by = {c.name: c for c in result.candidates}
    assert set(by) == {"h000-incoming", "h001-step", "h002-leak", "h003-computes", "h004-hostile",
                       "h005-loops", "h006-h0-again"}  # fmt: skip
    assert by["h000-incoming"].summary["success_rate"] == 0.0
    assert by["h001-step"].summary["success_rate"] == 1.0
    assert by["h002-leak"].invalid["audit"] == "leakage"
    assert by["h003-computes"].invalid["audit"] == "computes_answers"
    assert by["h004-hostile"].invalid["audit"] == "static"
    assert (
        by["h005-loops"].invalid["audit"] == "smoke"
        and "timeout" in by["h005-loops"].invalid["reason"]
    )
    assert by["h006-h0-again"].summary["success_rate"] == 0.0
    assert result.accepted.name == "h001-step"
    assert result.frontier[0] == "h001-step"
    assert result.detail["vs_incoming"]["gain"] == 1.0
    root = phase.phase.root
    assert json.load(open(os.path.join(root, "accepted.json")))["name"] == "h001-step"
    assert open(os.path.join(root, "accepted.py")).read() == STEP
    traces = list(phase.phase.traces("h001-step"))
    assert len(traces) == len(tasks) and all(t.reward == 1.0 for t in traces)
    log = phase.phase.iterations()
    assert [e["iteration"] for e in log] == [1, 2, 3]
    assert log[1]["rejected"] == {"h002-leak": "leakage", "h003-computes": "computes_answers"}
    meta = json.load(open(os.path.join(root, "phase.json")))
    assert meta["weights"] == {"step": 7} and len(meta["search_task_ids"]) == len(tasks)
    proposal = json.load(open(os.path.join(root, "candidates", "h001-step", "proposal.json")))
    assert proposal["hypothesis"] == "h-step" and proposal["iteration"] == 2


def test_an_interrupted_phase_resumes_without_re_evaluating(setup):
    tasks, ex, archive = setup
    evaluated: list[str] = []

    class Crashing(HarnessPhase):
        crash_on: str | None = "h002-also"

        def evaluate(self, cand, incoming):
            if cand.name == self.crash_on:
                raise KeyboardInterrupt("the machine was preempted")
            evaluated.append(cand.name)
            super().evaluate(cand, incoming)

    also = STEP.replace("then give", "and then give")
    proposer = ListProposer([[("step", STEP), ("also", also)], [("third", H0)]])
    kwargs = dict(archive=archive, index=1, domain=ArithDomain(), executor=ex, search_tasks=tasks,
                  proposer=proposer, skill="s", config=SearchConfig(iterations=3, slots=2),
                  log=lambda s: None)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        Crashing(**kwargs).run(H0)
    assert evaluated == ["h000-incoming", "h001-step"] and proposer.calls == 1
    resumed = Crashing(**kwargs)
    resumed.crash_on = None
    result = resumed.run(H0)
    assert evaluated == ["h000-incoming", "h001-step", "h002-also", "h003-third"]
    assert proposer.calls == 2  # iteration 2 was not proposed again
    assert result.accepted.name == "h001-step"  # tie on success and turns: the earlier one


def test_interrupt_stops_between_candidates_and_a_torn_candidate_is_dropped(setup):
    """``interrupt`` (SIGTERM in the loop) stops before the next candidate; a candidate directory
    a crash left half-written is removed on resume, so the names proposed again do not shift."""
    from harness.search.phase import PhaseInterrupted

    tasks, ex, archive = setup
    stop = {"after": 2}
    seen: list[str] = []

    def interrupt() -> bool:
        return len(seen) >= stop["after"]

    proposer = ListProposer([[("step", STEP), ("again", H0)], [("third", H0)]])
    kwargs = dict(archive=archive, index=1, domain=ArithDomain(), executor=ex, search_tasks=tasks,
                  proposer=proposer, skill="s", config=SearchConfig(iterations=3, slots=2),
                  log=lambda s: seen.append(s) if ": success" in s else None,
                  interrupt=interrupt)  # fmt: skip
    with pytest.raises(PhaseInterrupted, match="before h002-again"):
        HarnessPhase(**kwargs).run(H0)
    torn = os.path.join(archive.phase(1).candidates_dir, "h003-torn")
    os.makedirs(torn)  # a crash between the directory and its files
    stop["after"] = 99
    result = HarnessPhase(**kwargs).run(H0)
    names = [c.name for c in result.candidates]
    assert names == ["h000-incoming", "h001-step", "h002-again", "h003-third"]
    assert not os.path.exists(torn) or os.path.exists(os.path.join(torn, "harness.py"))


def test_proposer_failure_skips_its_slots(setup):
    tasks, ex, archive = setup

    class Broken:
        name = "broken"

        def propose(self, request):
            raise ConnectionError("API unreachable after retries")

    phase = HarnessPhase(archive=archive, index=1, domain=ArithDomain(), executor=ex,
                         search_tasks=tasks, proposer=Broken(), skill="s",
                         config=SearchConfig(iterations=2), log=lambda s: None)  # fmt: skip
    result = phase.run(H0)
    assert result.accepted.name == "h000-incoming"
    assert "API unreachable" in phase.phase.iterations()[1]["problems"][0]


@pytest.mark.parametrize(
    "rounds, iterations",
    [
        ([[("same", H0)]], [1, 2, 3, 4, 5, 6]),  # never improves: the 5 proposal minimum
        (
            [[("a", H0)]] * 4 + [[("step", STEP)], [("b", H0)], [("c", H0)]],
            [1, 2, 3, 4, 5, 6, 7, 8],
        ),
    ],
    ids=["stalled", "late_gain"],
)
def test_adaptive_schedule(setup, rounds, iterations):
    """At least 5 proposal iterations, then stop after 2 without a new best (iteration 1, the
    incoming harness, sets the first best)."""
    tasks, ex, archive = setup
    config = SearchConfig(slots=1, schedule="adaptive",
                          validation=ValidationConfig(audit_tasks=1, smoke=False))  # fmt: skip
    phase = HarnessPhase(archive=archive, index=1, domain=ArithDomain(), executor=ex,
                         search_tasks=tasks[:2], proposer=ListProposer(rounds), skill="s",
                         config=config, log=lambda s: None)  # fmt: skip
    phase.run(H0)
    assert [e["iteration"] for e in phase.phase.iterations()] == iterations


def test_command_proposer_takes_only_the_slots(setup, tmp_path):
    tasks, ex, archive = setup
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(f'''
        import json, os, sys
        prompt = open(sys.argv[1]).read()
        assert "slot_dir = slots" in prompt and "phase-001" in prompt
        assert os.path.exists("phase-001/candidates/h000-incoming/traces.jsonl")
        os.makedirs("slots/step")
        open("slots/step/harness.py", "w").write({STEP!r})
        json.dump([{{"name": "step", "hypothesis": "think first", "changes": "system prompt"}}],
                  open("slots/pending.json", "w"))
        open("phase-001/evil.py", "w").write("x")  # into the copy only
        print("agent done")
    '''))  # fmt: skip
    proposer = CommandProposer(f"{sys.executable} {agent} {{prompt_file}}", timeout_s=60)
    phase = HarnessPhase(archive=archive, index=1, domain=ArithDomain(), executor=ex,
                         search_tasks=tasks, proposer=proposer, skill="s",
                         config=SearchConfig(iterations=2), log=lambda s: None)  # fmt: skip
    result = phase.run(H0)
    assert result.accepted.name == "h001-step"
    assert result.accepted.proposal["hypothesis"] == "think first"
    assert not os.path.exists(os.path.join(phase.phase.root, "evil.py"))
    log = open(os.path.join(phase.phase.root, "proposals", "iter-002", "command.log")).read()
    assert "agent done" in log


def test_prompt_only_mode_rejects_code_and_accepts_prompts(setup):
    assert prompt_only_change(STEP, H0) is None
    assert prompt_only_change(H0.replace("max_new_tokens=12", "max_new_tokens=13"), H0)
    tasks, ex, archive = setup
    code = H0.replace("max_new_tokens=12", "max_new_tokens=13")
    proposer = ListProposer([[("prompt", STEP), ("code", code)]])
    config = SearchConfig(iterations=2, validation=ValidationConfig(prompt_only=True))
    phase = HarnessPhase(archive=archive, index=1, domain=ArithDomain(), executor=ex,
                         search_tasks=tasks, proposer=proposer, skill="s", config=config,
                         log=lambda s: None)  # fmt: skip
    result = phase.run(H0)
    by = {c.name: c for c in result.candidates}
    assert by["h002-code"].invalid["audit"] == "prompt_only"
    assert by["h001-prompt"].valid and result.accepted.name == "h001-prompt"


def test_leakage_finds_questions_ids_and_golds():
    from harness.domains.base import Task

    tasks = generate(3, seed=4)
    golds = [[str(t.gold)] for t in tasks]
    assert leakage(H0, tasks, golds) is None
    assert "question" in leakage(f"Q = {tasks[1].question!r}\n", tasks, golds)
    assert "task id" in leakage(f"K = {{{tasks[2].id!r}: 1}}\n", tasks, golds)
    # short numbers are everywhere (few-shot examples, token limits): not evidence
    assert leakage(f"EXAMPLES = {[str(t.gold) for t in tasks]!r}\n", tasks, golds) is None
    qa = [Task(id=f"q{i}", question=f"Capital number {i}?", gold=[g])
          for i, g in enumerate(["Canberra", "Ottawa", "Lima", "Quito"])]  # fmt: skip
    qa_golds = [t.gold for t in qa]
    assert leakage("S = 'Known: Canberra'\n", qa, qa_golds) is None  # one is chance
    assert "gold answers of 3" in leakage("S = 'Canberra, Ottawa and Lima'\n", qa, qa_golds)


def test_frontier_and_interval():
    scored = [("a", {"success_rate": 0.5, "mean_turns": 1.0}),
              ("b", {"success_rate": 0.7, "mean_turns": 3.0}),
              ("c", {"success_rate": 0.5, "mean_turns": 2.0}),
              ("d", {"success_rate": 0.7, "mean_turns": 3.0})]  # fmt: skip
    assert frontier.pareto(scored) == ["b", "d", "a"]
    iv = frontier.paired_interval([1, 1, 1, 0] * 25, [0, 1, 0, 0] * 25)
    assert iv["gain"] == pytest.approx(0.5) and iv["low"] > 0 and iv["significant"]
    noisy = frontier.paired_interval([1, 0] * 5, [0, 1] * 5)
    assert noisy["low"] < 0 < noisy["high"] and not noisy["significant"]
    scored = [
        ("inc", {"success_rate": 0.5, "mean_turns": 1.0, "rewards": [1, 0] * 5}),
        ("new", {"success_rate": 0.6, "mean_turns": 1.0, "rewards": [1, 0] * 4 + [1, 1]}),
    ]
    assert frontier.accept(scored, "inc")[0] == "new"
    assert frontier.accept(scored, "inc", require_significant=True)[0] == "inc"


def test_the_cost_axis_decides_between_a_vote_and_a_single_call():
    """A 5-way vote is one turn at five times the calls and tokens: by turns it dominates a
    single call at equal success; by calls or tokens the single call is the cheaper tie."""

    def summary(success, turns, calls, tokens):
        return {"success_rate": success, "mean_turns": turns, "mean_calls": calls, "n": 10,
                "prompt_tokens": tokens * 10 // 2, "completion_tokens": tokens * 10 // 2}  # fmt: skip

    scored = [("single", summary(0.5, 1.0, 1.0, 40)), ("vote", summary(0.5, 1.0, 5.0, 200)),
              ("retry", summary(0.5, 2.0, 2.0, 80))]  # fmt: skip
    assert frontier.pareto(scored, "turns") == ["single", "vote"]  # equal turns: order decides
    assert frontier.pareto(scored, "calls") == ["single"]
    assert frontier.pareto(scored, "tokens") == ["single"]
    scored[0] = ("single", summary(0.4, 1.0, 1.0, 40))
    # With the single call worse: by turns the vote wins, by calls the 2-call retry does.
    assert frontier.accept(scored, "single")[:2] == ("vote", ["vote"])
    assert frontier.accept(scored, "single", cost="calls")[:2] == ("retry", ["retry", "single"])
    assert frontier.cost_of(scored[2][1], "tokens") == 80
    with pytest.raises(ValueError, match="'memory'"):
        frontier.cost_of(scored[0][1], "memory")


def test_prompt_only_masks_exactly_the_reference_prompt_constants():
    """Fast-Slow may rewrite SYSTEM_PROMPT and USER_PROMPT_TEMPLATE (chess: USER_PROMPT), not any
    other constant: a feedback string or a tool schema is code."""
    source = (
        'SYSTEM_PROMPT = "Be brief."\nUSER_PROMPT_TEMPLATE = "Q: {question}"\n'
        'NUDGE = "Try again."\n\n\ndef run(task, model, tools):\n    return NUDGE\n'
    )
    templated = source.replace("Q: {question}", "Question: {question}\\nThink first.")
    assert prompt_only_change(templated.replace("Be brief.", "Be exact."), source) is None
    assert prompt_only_change(source.replace("Try again.", "The answer is near."), source)
