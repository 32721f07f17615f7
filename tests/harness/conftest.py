from __future__ import annotations

import re

import pytest

from harness.api import Budgets
from harness.backends import ScriptedBackend
from harness.domains.arith import ArithDomain, generate
from harness.executor import Executor, ExecutorConfig
from harness.sandbox.python_layer import Limits

# Tight limits keep the hostile cases fast; the defaults are for real runs.
TEST_BUDGETS = Budgets(assistant_tokens=256, turns=4, model_calls=8, wall_s=20.0, step_s=1.5)
TEST_LIMITS = Limits(memory_bytes=768 << 20, cpu_s=30, output_bytes=4096)


def add_numbers(request) -> str:
    """An arith oracle: sums the integers of the last user message."""
    text = request.messages[-1]["content"]
    return str(sum(int(x) for x in re.findall(r"\d+", text)))


@pytest.fixture(scope="session")
def arith():
    return ArithDomain()


@pytest.fixture(scope="session")
def arith_tasks():
    return generate(8, seed=3)


@pytest.fixture(scope="session")
def executor():
    config = ExecutorConfig(
        concurrency=8, budgets=TEST_BUDGETS, limits=TEST_LIMITS, load_timeout_s=20.0
    )
    with Executor(ScriptedBackend(add_numbers), config) as ex:
        yield ex


def make_executor(delay_s: float = 0.0, respond=add_numbers, **overrides) -> Executor:
    config = dict(concurrency=8, budgets=TEST_BUDGETS, limits=TEST_LIMITS, load_timeout_s=20.0)
    config.update(overrides)
    return Executor(ScriptedBackend(respond, delay_s=delay_s), ExecutorConfig(**config))
