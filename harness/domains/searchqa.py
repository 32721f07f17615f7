"""Search QA: Search-R1's NQ+HotpotQA train and its 7 test sets (parquet), a tool
``search(query, k)`` against a retriever, exact match after SQuAD normalisation. Offline: a corpus
and single/multi-hop questions generated from the ``countryinfo`` package's data files."""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import re
import string
from typing import Any

from harness.data import BadRowLog, read_rows
from harness.domains.base import Domain, Env, EpisodeContext, Task, ToolError
from harness.model_api import ChatBackend, ChatRequest, RngKey, SamplingSettings
from harness.retrieval import Retriever, split_contents
from harness.splits import split_by_hash

TEST_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: list[str]) -> bool:
    p = normalize(prediction)
    return any(p == normalize(g) for g in golds)


def extract_answer(text: str | None) -> str | None:
    """The last ``<answer>...</answer>`` (Search-R1's convention)."""
    if not text:
        return None
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


# ---- data ------------------------------------------------------------------------------------


def load_search_r1(
    path: str | os.PathLike[str], *, on_bad: str = "skip"
) -> tuple[list[Task], list]:
    """One Search-R1 parquet (train or a test set): FlashRAG columns + verl columns."""
    log = BadRowLog(on_bad)
    tasks = []
    for i, row in enumerate(read_rows(path, required=("question",))):
        question = str(row.get("question") or "").strip()
        golds = row.get("golden_answers")
        if golds is None:
            rm = row.get("reward_model") or {}
            golds = ((rm.get("ground_truth") or {}) if isinstance(rm, dict) else {}).get("target")
        golds = [str(g).strip() for g in (golds or []) if str(g).strip()]
        if not question:
            log.add(path, i, "question", "missing or empty")
            continue
        if not golds:
            log.add(path, i, "golden_answers", "no non-empty answer")
            continue
        source = str(row.get("data_source") or "unknown")
        ident = row.get("id")
        if ident is None:
            extra = row.get("extra_info") or {}
            ident = extra.get("index", i) if isinstance(extra, dict) else i
        tasks.append(
            Task(
                id=f"{source}-{ident}",
                question=question,
                gold=golds,
                meta={"data_source": source},
                source=os.fspath(path),
            )
        )
    return tasks, log.finish()


def load_corpus(path: str | os.PathLike[str], *, on_bad: str = "skip") -> tuple[list[dict], list]:
    """wiki-18 style JSONL: ``{"id", "contents"}`` per line."""
    log = BadRowLog(on_bad)
    docs = []
    for i, row in enumerate(read_rows(path, required=("contents",))):
        if not str(row.get("contents") or "").strip():
            log.add(path, i, "contents", "empty")
            continue
        docs.append({"id": str(row.get("id", i)), "contents": str(row["contents"])})
    return docs, log.finish()


def _countryinfo_records() -> list[dict[str, Any]]:
    spec = importlib.util.find_spec("countryinfo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'countryinfo' package is not installed")
    root = list(spec.submodule_search_locations)[0]
    out = []
    for path in sorted(glob.glob(os.path.join(root, "data", "*.json"))):
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
    return out


def _as_list(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, str) and value.startswith("["):
        try:
            return [str(v) for v in ast.literal_eval(value)]
        except (ValueError, SyntaxError):
            return []
    return []


def _iso3(record: dict[str, Any]) -> str | None:
    iso = record.get("ISO")
    if isinstance(iso, str):
        try:
            iso = ast.literal_eval(iso)
        except (ValueError, SyntaxError):
            return None
    return iso.get("alpha3") if isinstance(iso, dict) else None


def countryinfo_corpus() -> tuple[list[dict[str, str]], list[Task]]:
    """A passage per country and questions over it: single-hop (capital, region, demonym) and
    two-hop (a neighbour's capital: find the neighbours, then their capitals; any one counts)."""
    records = [r for r in _countryinfo_records() if r.get("name") and r.get("capital")]
    by_iso = {_iso3(r): r for r in records if _iso3(r)}
    docs, tasks = [], []
    for r in records:
        name, capital = str(r["name"]), str(r["capital"])
        neighbours = [by_iso[c]["name"] for c in _as_list(r.get("borders")) if c in by_iso]
        text = f"{name} is a country in {r.get('subregion') or r.get('region') or 'the world'}"
        text += f" ({r.get('region')}). Its capital is {capital}."
        if r.get("demonym"):
            text += f" Its people are called {r['demonym']}."
        if neighbours:
            text += " It borders " + ", ".join(neighbours) + "."
        if r.get("population"):
            text += f" Population: {r['population']}."
        docs.append({"id": f"country-{_iso3(r) or name}", "contents": f'"{name}"\n{text}'})
        base = f"countryinfo-{_iso3(r) or name}"
        caps = sorted(
            {str(by_iso[c]["capital"]) for c in _as_list(r.get("borders")) if c in by_iso}
        )
        questions = [
            ("capital", f"What is the capital of {name}?", [capital], 1),
            ("region", f"In which region of the world is {name}?", [r.get("region")], 1),
            ("demonym", f"What are the people of {name} called?", [r.get("demonym")], 1),
            (
                "neighbour-capital",
                f"What is the capital of a country that borders {name}?",
                caps,
                2,
            ),
        ]
        for kind, question, golds, hops in questions:
            golds = [str(g) for g in golds if g]
            if golds:
                meta = {"data_source": "countryinfo", "hops": hops}
                tasks.append(Task(id=f"{base}-{kind}", question=question, gold=golds, meta=meta))
    return docs, tasks


def make_splits(
    train_pool: list[Task], *, seed: int, search: int = 256, validation: int = 500
) -> dict[str, list[Task]]:
    return split_by_hash(
        train_pool,
        lambda t: t.question,
        seed=seed,
        sizes={"search": search, "validation": validation},
    )


def periodic_test(test_tasks: list[Task], *, seed: int, per_source: int = 100) -> list[Task]:
    """100 tasks per benchmark (fixed by seed); report the macro average over benchmarks."""
    by_source: dict[str, list[Task]] = {}
    for t in test_tasks:
        by_source.setdefault(t.meta.get("data_source", "unknown"), []).append(t)
    out = []
    for source in sorted(by_source):
        out += split_by_hash(by_source[source], lambda t: t.id, seed=seed, sizes={"x": per_source})[
            "x"
        ]
    return out


def macro_average(records: list[Any], tasks: list[Task]) -> float:
    source = {t.id: t.meta.get("data_source", "unknown") for t in tasks}
    per: dict[str, list[float]] = {}
    for r in records:
        per.setdefault(source.get(r.task_id, "unknown"), []).append(r.reward)
    return sum(sum(v) / len(v) for v in per.values()) / max(len(per), 1)


# ---- domain ----------------------------------------------------------------------------------


class _SearchEnv(Env):
    def __init__(self, retriever: Retriever):
        self.retriever = retriever

    def call(self, name: str, args: list[Any], kwargs: dict[str, Any], ctx: EpisodeContext) -> Any:
        if name != "search":
            raise ToolError(f"unknown tool {name!r}")
        params = dict(zip(("query", "k"), args, strict=False)) | kwargs
        query, k = params.get("query"), params.get("k", 1)
        if not isinstance(query, str) or not query.strip() or not isinstance(k, int):
            raise ToolError("search(query: str, k: int = 1)")
        if set(params) - {"query", "k"}:
            raise ToolError("search(query: str, k: int = 1)")
        k = max(1, min(k, 10))
        (hits,) = self.retriever.retrieve([query[:1000]], k)
        words = ctx.budgets.passage_tokens
        out = []
        for doc, score in hits:
            title, text = split_contents(str(doc.get("contents", "")))
            out.append({"title": title, "text": " ".join(text.split()[:words]), "score": score})
        return out


class SearchQADomain(Domain):
    name = "searchqa"
    tool_names = ("search",)
    seed_file = "searchqa_h0.py"

    def __init__(self, retriever: Retriever | None = None, judge: ChatBackend | None = None):
        self.retriever = retriever
        self.judge = judge

    def new_env(self, task: Task) -> Env:
        if self.retriever is None:
            raise ValueError("SearchQADomain needs a retriever (BM25Retriever or HTTPRetriever)")
        return _SearchEnv(self.retriever)

    def score(self, task: Task, answer: str | None, env: Env) -> tuple[float, str | None]:
        predicted = extract_answer(answer)
        if predicted is None:
            return 0.0, None
        golds = [str(g) for g in task.gold]
        if exact_match(predicted, golds):
            return 1.0, predicted
        if self.judge is not None:
            return float(self._judge(task, predicted, golds)), predicted
        return 0.0, predicted

    def _judge(self, task: Task, predicted: str, golds: list[str]) -> bool:
        prompt = (
            f"Question: {task.question}\nReference answers: {'; '.join(golds)}\n"
            f"Proposed answer: {predicted}\nIs the proposed answer correct? Reply yes or no."
        )
        assert self.judge is not None
        result = self.judge.chat(
            ChatRequest(
                episode_id=f"judge/{task.id}",
                session_id=f"judge/{task.id}",
                messages=({"role": "user", "content": prompt},),
                settings=SamplingSettings(temperature=0.0, max_new_tokens=4),
                train=False,
                rng=RngKey(run_seed=0, step=0, task_id=task.id, sample_index=0, call_index=0),
            )
        )
        return result.text.strip().lower().startswith("yes")
