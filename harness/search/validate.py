"""Audits a proposed harness must pass before it is evaluated on the search split. Each returns a
reason (rejected) or None; the phase records the first failing audit and its reason.

1. ``static``: the executor's static check.
2. ``prompt_only`` (Fast-Slow control only): the syntax tree must equal the incoming harness's
   once the values of its prompt constants (module-level ``SYSTEM_PROMPT``,
   ``USER_PROMPT_TEMPLATE`` and chess's ``USER_PROMPT``, bound to strings: the reference's
   ``PROMPT_CONSTANTS``) and docstrings are masked.
3. ``leakage``: the source holds a search-split question or gold answer as a literal.
4. ``computes_answers``: on a few search tasks with two trusted stand-in models — one echoes its
   prompt's last message, one replies with fixed unrelated text — any reward above zero means the
   harness produces the answer itself (e.g. adds the numbers and has the model repeat the sum).
5. ``smoke``: one episode with the real model must end without a harness failure (load error,
   exception, violation, timeout, crash).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from collections.abc import Sequence

from harness.api import ChatRequest
from harness.backends import ScriptedBackend
from harness.domains.base import Domain, Task
from harness.executor import Executor
from harness.records import EpisodeRecord
from harness.sandbox.static_check import check_source

HARNESS_FAILURES = frozenset(
    {"static_check", "harness_load", "sandbox_violation", "error", "timeout", "worker_died",
     "protocol_error", "output_limit", "memory_limit"}
)  # fmt: skip
FIXED_REPLY = "I would rather talk about the weather on the coast today."


def echo(request: ChatRequest) -> str:
    return request.messages[-1]["content"]


def fixed(request: ChatRequest) -> str:
    return FIXED_REPLY


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    audit_tasks: int = 4  # search tasks run with each stand-in model
    smoke: bool = True  # one episode with the real model
    prompt_only: bool = False


# ---- static audits -----------------------------------------------------------------------------


def _constants(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float)):
            if not isinstance(node.value, bool):
                out.append(str(node.value))
    return out


def _squash(text: str) -> str:
    return " ".join(text.split()).lower()


def _countable(gold: str) -> bool:
    """Golds that are evidence when found: 2+ characters, and numbers only from 4 digits (short
    numbers occur in any few-shot example)."""
    g = gold.strip()
    digits = g.replace("-", "").replace(".", "")
    return len(g) >= 2 and (not digits.isdigit() or len(digits) >= 4)


def leakage(source: str, tasks: Sequence[Task], golds: Sequence[Sequence[str]]) -> str | None:
    """The source holds search-split content as literals: any question (16+ characters) or task id
    (6+ characters) inside a literal, which a lookup table needs as its key; or several gold
    answers (at least 3, or 2% of the tasks) as literals or whole words inside string literals."""
    try:
        consts = _constants(ast.parse(source))
    except SyntaxError:
        return None  # the static check reports it
    squashed = [_squash(c) for c in consts]
    exact = {c.strip().lower() for c in consts}
    found: list[str] = []
    for task, task_golds in zip(tasks, golds, strict=True):
        q = _squash(task.question)
        if len(q) >= 16 and any(q in c for c in squashed):
            return f"the source holds search question {task.id!r} as a literal"
        if len(task.id) >= 6 and any(task.id.lower() in c for c in squashed):
            return f"the source holds search task id {task.id!r} as a literal"
        for g in task_golds:
            if not _countable(g):
                continue
            g = g.strip().lower()
            word = re.compile(r"(?<![\w.])" + re.escape(g) + r"(?![\w])")
            if g in exact or any(word.search(c) for c in squashed):
                found.append(task.id)
                break
    if len(found) >= max(3, int(0.02 * len(tasks))):
        return f"the source holds the gold answers of {len(found)} search tasks ({found[:5]})"
    return None


PROMPT_CONSTANTS = frozenset({"SYSTEM_PROMPT", "USER_PROMPT_TEMPLATE", "USER_PROMPT"})


def _mask(tree: ast.Module) -> ast.Module:
    tree = copy.deepcopy(tree)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
            body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):  # fmt: skip
            body[0].value.value = ""
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            named = all(isinstance(t, ast.Name) and t.id in PROMPT_CONSTANTS for t in targets)
            strings = all(
                isinstance(n, ast.Constant) and isinstance(n.value, str)
                for n in ast.walk(stmt.value)
                if isinstance(n, ast.Constant)
            ) and isinstance(stmt.value, (ast.Constant, ast.BinOp, ast.JoinedStr))
            if named and strings:
                stmt.value = ast.Constant("")
    return tree


def prompt_only_change(source: str, incoming: str) -> str | None:
    """None when ``source`` differs from ``incoming`` only in prompt constants and docstrings."""
    try:
        new, old = ast.parse(source), ast.parse(incoming)
    except SyntaxError as e:
        return f"does not parse: {e.msg}"
    if ast.dump(_mask(new)) != ast.dump(_mask(old)):
        return "prompt-only mode: the change touches code, not only prompt constants or docstrings"
    return None


# ---- dynamic audits ----------------------------------------------------------------------------


def _failure(records: list[EpisodeRecord]) -> str | None:
    for r in records:
        if r.stop_reason in HARNESS_FAILURES:
            return f"{r.stop_reason}: {(r.error or '')[-600:]}"
    return None


def validate(
    source: str,
    *,
    domain: Domain,
    incoming: str,
    search_tasks: Sequence[Task],
    executor: Executor,
    config: ValidationConfig,
) -> tuple[str, str] | None:
    """(audit, reason) for the first audit that fails, or None when the candidate may be scored."""
    violations = check_source(source, allowed_imports=domain.allowed_imports)
    if violations:
        return "static", "; ".join(str(v) for v in violations[:10])
    if config.prompt_only:
        reason = prompt_only_change(source, incoming)
        if reason:
            return "prompt_only", reason
    golds = [domain.gold_strings(t) for t in search_tasks]
    reason = leakage(source, search_tasks, golds)
    if reason:
        return "leakage", reason
    tasks = list(search_tasks[: config.audit_tasks])
    stand_in_config = dataclasses.replace(executor.config, concurrency=max(1, len(tasks)))
    for name, respond in (("echo", echo), ("fixed", fixed)):
        with Executor(ScriptedBackend(respond), stand_in_config) as stand_in:
            records = stand_in.run(source, domain, tasks, run_id=f"audit-{name}")
        failure = _failure(records)
        if failure and records[0].stop_reason in ("static_check", "harness_load"):
            return "load", failure
        scored = [r for r in records if r.reward > 0]
        if scored:
            return "computes_answers", (
                f"scored {len(scored)}/{len(records)} with the {name} stand-in model (it "
                f"{'repeats its prompt' if name == 'echo' else 'never answers'}): the harness "
                "produces answers itself"
            )
    if config.smoke and search_tasks:
        records = executor.run(source, domain, list(search_tasks[:1]), run_id="audit-smoke")
        failure = _failure(records)
        if failure:
            return "smoke", failure
    return None
