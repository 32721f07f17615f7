"""Generated integer arithmetic for the offline demo; reward = exact match of the first integer."""

from __future__ import annotations

import random
import re

from harness.api import Budgets
from harness.domains.base import DataSpec, Domain, DomainData, Env, Source, Task, split_tasks


def extract_int(text: str | None) -> int | None:
    """The first integer in the text ("-12", "1,234" → 1234 is not accepted: digits only)."""
    if text is None:
        return None
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


def generate(n: int, *, seed: int, difficulty: int = 1) -> list[Task]:
    """``difficulty`` 1: a + b with a, b in 2..30 (the demo of DESIGN §3); each level adds an
    operand and a digit; from level 3 subtraction and multiplication join."""
    rng = random.Random(seed)
    ops = ["+"] if difficulty < 3 else ["+", "-", "*"]
    hi = 30 if difficulty == 1 else 10 ** min(difficulty, 6)
    tasks = []
    for i in range(n):
        terms = [rng.randint(2, hi) for _ in range(difficulty + 1)]
        expr = str(terms[0])
        for t in terms[1:]:
            expr += f" {rng.choice(ops)} {t}"
        value = eval(expr, {"__builtins__": {}})  # trusted: our own digits and operators
        tasks.append(
            Task(
                id=f"arith-{seed}-{difficulty}-{i}",
                question=f"What is {expr}?",
                gold=int(value),
                meta={"difficulty": difficulty},
                source="generated",
            )
        )
    return tasks


class ArithDomain(Domain):
    name = "arith"
    tool_names = ()
    budgets = Budgets(assistant_tokens=256, turns=4, model_calls=8)

    def score(self, task: Task, answer: str | None, env: Env) -> tuple[float, str | None]:
        value = extract_int(answer)
        if value is None:
            return 0.0, None
        return float(value == int(task.gold)), str(value)


DOMAIN = ArithDomain
OPTIONS = ("arith_difficulty", "arith_pool")  # the loop's data settings this domain reads
DATA_FILES: dict[str, str] = {}  # generated: nothing to fetch
SOURCES: list[Source] = []


def load(spec: DataSpec) -> DomainData:
    """``arith_pool`` problems at ``arith_difficulty`` from ``split_seed``; all four splits."""
    difficulty, size = spec.arith_difficulty, spec.arith_pool  # type: ignore[attr-defined]
    pool = generate(size, seed=spec.split_seed, difficulty=difficulty)
    splits = split_tasks(spec, pool, lambda t: t.question, test=True)
    return DomainData(domain=ArithDomain(), **splits,
                      source=f"generated arith, level {difficulty}, {size} problems")  # fmt: skip
