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
import time
from typing import Any

from harness.data import BadRowLog, read_rows
from harness.domains.base import (
    DataError,
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
from harness.domains.searchqa.retrieval import (
    BM25Retriever,
    HTTPRetriever,
    Retriever,
    split_contents,
)
from harness.judge import LLMJudge
from harness.splits import split_by_hash

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

    def __init__(self, retriever: Retriever | None = None, judge: LLMJudge | None = None):
        self.retriever = retriever
        self.judge = judge  # asked only when exact match fails; None from it: exact match stands

    def check(self) -> list[str]:
        r = self.retriever
        if not isinstance(r, HTTPRetriever):
            return [f"retriever: {type(r).__name__} in process"]
        t0 = time.monotonic()
        try:
            hits = r.retrieve(["health check"], 1)
            if len(hits) != 1:
                raise ValueError(f"{len(hits)} result lists for 1 query")
        except Exception as e:  # urllib, socket and JSON errors alike: the server is not usable
            raise DataError(
                f"--retriever_url={r.url}: the retrieval server did not answer a test query "
                f"({type(e).__name__}: {e}); start it (docs/loop.md, 'Splits and data') or leave "
                "--retriever_url empty for BM25 over the corpus in process"
            ) from None
        return [f"retriever {r.url}: answered a test query in {time.monotonic() - t0:.2f}s"]

    def costs(self) -> dict[str, int]:
        j = self.judge
        if j is None:
            return {}
        return {"judge_calls": j.calls, "judge_tokens": j.tokens, "judge_failures": j.failures}

    def test_groups(self, tasks: list[Task]) -> dict[str, list[Task]]:
        """One group per benchmark: the test score is their macro-average, as the paper's."""
        groups: dict[str, list[Task]] = {}
        for t in tasks:
            groups.setdefault(str(t.meta.get("data_source", "unknown")), []).append(t)
        return dict(sorted(groups.items()))

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
        if self.judge is not None and self.judge.judge(task.question, golds, predicted):
            return 1.0, predicted
        return 0.0, predicted


DOMAIN = SearchQADomain
OPTIONS = (
    "retriever_url",
    "test_per_source",
    "judge",
    "judge_model",
    "judge_base_url",
    "judge_api_key_env",
)  # the loop's data settings this domain reads; fmt: skip
# Files under --data_dir (what ``python -m whale_jax.fetch_data --domain=searchqa`` writes).
DATA_FILES = {
    "train": "searchqa/train.parquet",
    "test": "searchqa/test/*.parquet",  # one file per benchmark (seven)
    "corpus": "searchqa/wiki-18.jsonl",
}
# Search-R1's seven test sets and the FlashRAG split each uses.
_TESTS = (("nq", "test"), ("triviaqa", "test"), ("popqa", "test"), ("hotpotqa", "dev"),
          ("2wikimultihopqa", "dev"), ("musique", "dev"), ("bamboogle", "test"))  # fmt: skip
SOURCES = [
    Source(DATA_FILES["train"], "PeterJinGo/nq_hotpotqa_train", ("train.parquet",), "parquet"),
    *(Source(f"searchqa/test/{name}.parquet", "RUC-NLPIR/FlashRAG_datasets",
             (f"{name}/{split}.jsonl",), "rows", data_source=name,
             columns=("id", "question", "golden_answers")) for name, split in _TESTS),
    Source(DATA_FILES["corpus"], "PeterJinGo/wiki-18-corpus", ("wiki-18.jsonl.gz",), "gunzip"),
]  # fmt: skip


def judge_from(spec: DataSpec) -> LLMJudge | None:
    """The LLM judge ``--judge`` asks for (None: exact match only)."""
    kind = getattr(spec, "judge", "")
    if not kind:
        return None
    return LLMJudge(kind, spec.judge_model, base_url=spec.judge_base_url or None,  # type: ignore[attr-defined]
                    api_key_env=spec.judge_api_key_env)  # type: ignore[attr-defined]  # fmt: skip


def load(spec: DataSpec) -> DomainData:
    """Search-R1's NQ+HotpotQA into search / validation / train and its seven test sets
    (``test_per_source`` of each per evaluation), retrieval from ``retriever_url`` or BM25 over
    the corpus (``data_dir``); offline, the generated country-facts corpus split four ways."""
    url = spec.retriever_url  # type: ignore[attr-defined]
    if url and not url.startswith(("http://", "https://")):
        raise DataError(f"--retriever_url: {url!r} is not an http(s) URL")
    bad: list[Any] = []
    if spec.data_dir:
        pool, bad = load_search_r1(data_files(spec, DATA_FILES["train"], "train")[0])
        test: list[Task] = []
        for path in data_files(spec, DATA_FILES["test"], "test"):
            tasks, b = load_search_r1(path)
            test, bad = test + tasks, bad + b
        splits = split_tasks(spec, pool, lambda t: t.question, test=False)
        per = spec.test_per_source  # type: ignore[attr-defined]
        splits["test"] = periodic_test(test, seed=spec.split_seed, per_source=per) if per else test
        if url:
            retriever: Retriever = HTTPRetriever(url)
        else:
            docs, b = load_corpus(data_files(spec, DATA_FILES["corpus"], "corpus")[0])
            bad += b
            retriever = BM25Retriever(docs)
        source = f"Search-R1 NQ+HotpotQA and seven test sets under {spec.data_dir}"
    else:
        docs, pool = countryinfo_corpus()
        splits = split_tasks(spec, pool, lambda t: t.question, test=True)
        retriever = HTTPRetriever(url) if url else BM25Retriever(docs)
        source = "generated country-facts corpus (countryinfo)"
    domain = SearchQADomain(retriever=retriever, judge=judge_from(spec))
    return DomainData(domain=domain, **splits, source=source, bad_rows=len(bad))
