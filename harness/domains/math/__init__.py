"""Math: DAPO-Math-17K (training, validation, search) and AIME 2024+2025 (test) from their published
files; offline, procedurally generated problems from reasoning-gym. Tool: sandboxed Python.
Verifier: strict match of the last ``\\boxed{}`` (math-verify as an option)."""

from __future__ import annotations

import hashlib
import os
import re
from fractions import Fraction
from typing import Any

from harness.data import BadRowLog, read_rows
from harness.domains.base import (
    DataSpec,
    Domain,
    DomainData,
    Env,
    EpisodeContext,
    Source,
    Task,
    ToolError,
    data_files,
    split_tasks,
)
from harness.sandbox.run_python import PythonToolConfig, run_python

_DAPO_PREFIX = "Solve the following math problem"
_DAPO_SUFFIX = "Remember to put your answer"


# ---- verifier --------------------------------------------------------------------------------


def last_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}``, braces balanced; None if absent."""
    if not text:
        return None
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i = starts[-1]
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalize_answer(s: str) -> str:
    """Remove presentation only: spaces, ``$``, ``\\left``/``\\right``, ``\\!``, ``\\,``,
    ``\\text{}`` wrappers, ``dfrac``/``tfrac``, a trailing period, surrounding braces."""
    s = s.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[!,;: ]", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    while s.startswith("{") and s.endswith("}") and last_boxed("\\boxed" + s) == s[1:-1]:
        s = s[1:-1]
    return s


def _as_number(s: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\d+/\d+", s.replace(",", "") if re.fullmatch(
            r"-?\d{1,3}(,\d{3})+", s) else s):  # fmt: skip
            return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(predicted: str, gold: str) -> bool:
    """Strict: equal after presentation-only normalisation, or equal as plain numbers
    ("034" = "34", "0.5" = "\\frac{1}{2}"). No symbolic equivalence (that is math-verify's job)."""
    p, g = normalize_answer(predicted), normalize_answer(gold)
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    return pn is not None and gn is not None and pn == gn


def math_verify_match(predicted_text: str, gold: str) -> bool:
    """Symbolic check with math-verify. Its signal-based timeouts only work on the main thread, so
    they are off here: the caller bounds the time."""
    from math_verify import parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse(predicted_text, parsing_timeout=None)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


# ---- data ------------------------------------------------------------------------------------


def dapo_problem(prompt: Any) -> str:
    """The raw problem inside a DAPO verl prompt (strip the fixed instruction and reminder)."""
    if isinstance(prompt, (list, tuple)):
        contents = [m.get("content", "") for m in prompt if isinstance(m, dict)]
        text = next((c for c in contents if c), "")
    else:
        text = str(prompt or "")
    parts = [p for p in text.split("\n\n")]
    if parts and parts[0].lstrip().startswith(_DAPO_PREFIX):
        parts = parts[1:]
    if parts and parts[-1].lstrip().startswith(_DAPO_SUFFIX):
        parts = parts[:-1]
    return "\n\n".join(parts).strip()


def _task_id(prefix: str, text: str) -> str:
    return f"{prefix}-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"


def load_dapo(path: str | os.PathLike[str], *, on_bad: str = "skip") -> tuple[list[Task], list]:
    """DAPO-Math-17K parquet (verl layout). Duplicate problems (the upload repeats rows) collapse
    to one task when their answers agree; disagreeing duplicates are bad rows."""
    log = BadRowLog(on_bad)
    seen: dict[str, Task] = {}
    for i, row in enumerate(read_rows(path, required=("prompt", "reward_model"))):
        problem = dapo_problem(row.get("prompt"))
        rm = row.get("reward_model") or {}
        gold = str(rm.get("ground_truth", "") if isinstance(rm, dict) else "").strip()
        if not problem:
            log.add(path, i, "prompt", "no problem text")
            continue
        if not gold:
            log.add(path, i, "reward_model", "empty ground_truth")
            continue
        tid = _task_id("dapo", problem)
        if tid in seen:
            if seen[tid].gold != gold:
                log.add(
                    path, i, "reward_model", f"duplicate problem with another answer ({gold!r})"
                )
            continue
        extra = row.get("extra_info") or {}
        seen[tid] = Task(
            id=tid,
            question=problem,
            gold=gold,
            meta={"source": "dapo"},
            private={"index": extra.get("index") if isinstance(extra, dict) else None},
            source=os.fspath(path),
        )
    return list(seen.values()), log.finish()


def load_aime(path: str | os.PathLike[str], *, on_bad: str = "skip") -> tuple[list[Task], list]:
    """AIME 2024 (``ID, Problem, Solution, Answer``) or 2025 (``problem, answer`` + an id column);
    parquet or JSONL. Column names are matched case-insensitively."""
    log = BadRowLog(on_bad)
    tasks = []
    for i, row in enumerate(read_rows(path)):
        low = {str(k).lower(): v for k, v in row.items()}
        problem, answer = low.get("problem"), low.get("answer")
        if problem is None or not str(problem).strip():
            log.add(path, i, "problem", "missing or empty")
            continue
        if answer is None or not str(answer).strip():
            log.add(path, i, "answer", "missing or empty")
            continue
        ident = low.get("id", low.get("problem_idx", low.get("idx", i)))
        tasks.append(
            Task(
                id=f"aime-{os.path.basename(os.fspath(path)).split('.')[0]}-{ident}",
                question=str(problem).strip(),
                gold=str(answer).strip(),
                meta={"source": "aime"},
                source=os.fspath(path),
            )
        )
    return tasks, log.finish()


OFFLINE_DATASETS = ("basic_arithmetic", "gcd", "lcm", "simple_equations", "prime_factorization")


def generate_offline(
    n: int, *, seed: int, datasets: tuple[str, ...] = OFFLINE_DATASETS
) -> list[Task]:
    """Procedural problems from reasoning-gym, seeded; gold answers as the generator states them."""
    import reasoning_gym

    tasks = []
    per = -(-n // len(datasets))
    for k, name in enumerate(datasets):
        data = reasoning_gym.create_dataset(name, size=per, seed=seed * 1000 + k)
        for j, item in enumerate(data):
            tasks.append(
                Task(
                    id=f"rg-{name}-{seed}-{j}",
                    question=str(item["question"]),
                    gold=str(item["answer"]).strip(),
                    meta={"source": f"reasoning_gym:{name}"},
                    source="reasoning_gym",
                )
            )
    return tasks[:n]


# ---- domain ----------------------------------------------------------------------------------


class _PythonEnv(Env):
    def __init__(self, config: PythonToolConfig):
        self.config = config

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any], ctx: EpisodeContext) -> Any:
        if name != "python":
            raise ToolError(f"unknown tool {name!r}")
        code = kwargs.get("code", args[0] if args else None)
        if not isinstance(code, str) or len(args) + len(kwargs) != 1:
            raise ToolError("python(code) takes one string")
        if len(code) > 20_000:
            raise ToolError("code longer than 20000 characters")
        return run_python(code, self.config)


class MathDomain(Domain):
    name = "math"
    tool_names = ("python",)

    def __init__(self, *, use_math_verify: bool = False, tool: PythonToolConfig | None = None):
        self.use_math_verify = use_math_verify
        self.tool = tool or PythonToolConfig()

    def new_env(self, task: Task) -> Env:
        return _PythonEnv(self.tool)

    def score(self, task: Task, answer: str | None, env: Env) -> tuple[float, str | None]:
        boxed = last_boxed(answer)
        if boxed is None:
            return 0.0, None
        if answers_match(boxed, str(task.gold)):
            return 1.0, boxed
        if self.use_math_verify and answer is not None:
            return float(math_verify_match(answer, str(task.gold))), boxed
        return 0.0, boxed


DOMAIN = MathDomain
OPTIONS = ("math_verify", "arith_pool")  # the loop's data settings this domain reads
# Files under --data_dir (what ``python -m whale_jax.fetch_data --domain=math`` writes).
DATA_FILES = {
    "train": "math/dapo_math_17k.parquet",
    "test_2024": "math/aime_2024.parquet",
    "test_2025": "math/aime_2025.parquet",
}
SOURCES = [
    Source(DATA_FILES["train"], "BytedTsinghua-SIA/DAPO-Math-17k", ("*.parquet",), "parquet"),
    Source(DATA_FILES["test_2024"], "Maxwell-Jia/AIME_2024", ("*.parquet", "*.jsonl")),
    Source(DATA_FILES["test_2025"], "yentinglin/aime_2025", ("*.parquet", "*.jsonl")),
]


def load(spec: DataSpec) -> DomainData:
    """DAPO-Math-17K into search / validation / train and AIME 2024+2025 as test (``data_dir``),
    or reasoning-gym problems split four ways (offline)."""
    domain = MathDomain(use_math_verify=spec.math_verify)  # type: ignore[attr-defined]
    if not spec.data_dir:
        pool = generate_offline(spec.arith_pool, seed=spec.split_seed)  # type: ignore[attr-defined]
        splits = split_tasks(spec, pool, lambda t: t.question, test=True)
        return DomainData(domain=domain, **splits,
                          source=f"reasoning-gym problems ({', '.join(OFFLINE_DATASETS)})")  # fmt: skip
    pool, bad = load_dapo(data_files(spec, DATA_FILES["train"], "train")[0])
    test: list[Task] = []
    for key in ("test_2024", "test_2025"):
        tasks, b = load_aime(data_files(spec, DATA_FILES[key], key)[0])
        test, bad = test + tasks, bad + b
    splits = split_tasks(spec, pool, lambda t: t.question, test=False)
    return DomainData(domain=domain, **splits, test=test, bad_rows=len(bad),
                      source=f"DAPO-Math-17K + AIME 2024/2025 under {spec.data_dir}")  # fmt: skip
