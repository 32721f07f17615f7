"""Domains are plug-ins: a folder is a domain (harness.domains). A fifth domain that lives only in
tests/fixtures/domains/parrot runs the whole program (weight phase, a harness phase with the
offline proposer's recipes from that folder, evaluation) with no other file touched."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from harness import domains
from tests.loop.conftest import metric_lines, run_main, small_run_flags

PARROT_DIR = str(Path(__file__).resolve().parents[1] / "fixtures" / "domains")


def test_the_registry_finds_every_folder_and_checks_the_contract(tmp_path, monkeypatch):
    monkeypatch.setattr(domains, "_extra", {})  # this process's registrations end with the test
    assert {"arith", "math", "searchqa", "chess"} <= set(domains.names())
    assert domains.add_domain_dir(PARROT_DIR) == ["parrot"]
    assert "parrot" in domains.names()
    assert domains.get_domain("parrot").seed_harness().startswith('"""h0 for parrot')
    assert "repeat a word" in domains.skill_text("parrot")
    broken = tmp_path / "broken"
    shutil.copytree(Path(PARROT_DIR) / "parrot", broken / "echo")
    (broken / "echo" / "skill.md").unlink()
    domains.add_domain_dir(broken)
    with pytest.raises(ValueError, match=r"echo lacks skill\.md"):
        domains.plugin("echo")
    with pytest.raises(ValueError, match="unknown domain 'go'"):
        domains.plugin("go")
    clash = tmp_path / "clash" / "arith"
    shutil.copytree(Path(PARROT_DIR) / "parrot", clash)
    with pytest.raises(ValueError, match="'arith' .* is already defined"):
        domains.add_domain_dir(clash.parent)


def test_a_domain_in_its_own_folder_runs_the_whole_loop(tiny_model_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    flags = small_run_flags(run_dir, tiny_model_dir, domain="parrot", domain_dir=PARROT_DIR,
                            report="false")  # fmt: skip
    done = run_main(flags)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = metric_lines(run_dir)
    assert [x["phase_kind"] for x in lines if x["kind"] == "phase_end"] == [
        "weight", "harness", "weight",
    ]  # fmt: skip
    cands = os.path.join(run_dir, "archive", "phase-001", "candidates")
    proposals = [json.load(open(os.path.join(cands, c, "proposal.json")))
                 for c in sorted(os.listdir(cands))]  # fmt: skip
    assert any("variant: quote" in p.get("changes", "") for p in proposals), proposals
