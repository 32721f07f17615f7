"""One set of sampling settings: every form the settings take is SamplingSettings or derived from it
with the same names and defaults, and one range check serves the flags and every harness call."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from harness.api import SAMPLING_FIELDS, SamplingSettings
from harness.executor.ledger import check_settings
from harness.sandbox.worker import Model
from whale_jax.engine.requests import Sampling
from whale_jax.loop.config import ModelSettings


def test_the_harness_chat_call_takes_exactly_the_sampling_fields():
    params = set(inspect.signature(Model.chat).parameters) - {"self", "messages", "train", "tools"}
    assert params == SAMPLING_FIELDS


def test_the_engine_and_the_flags_default_to_the_same_settings():
    s = SamplingSettings()
    e = Sampling()
    assert (e.temperature, e.top_p, e.top_k, e.max_new_tokens) == (
        s.temperature, s.top_p, s.top_k, s.max_new_tokens,
    )  # fmt: skip
    assert ModelSettings().sampling() == s


def test_a_call_s_settings_reach_the_engine_unchanged():
    s = SamplingSettings(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=33, stop=("</a>",))
    e = Sampling.from_settings(s, stop_ids=(2,))
    assert (e.temperature, e.top_p, e.top_k, e.max_new_tokens, e.stop_strings, e.stop_ids) == (
        0.7, 0.9, 5, 33, ("</a>",), (2,),
    )  # fmt: skip
    assert {f.name for f in dataclasses.fields(Sampling)} >= {"temperature", "top_p", "top_k"}


@pytest.mark.parametrize(
    "given, field",
    [
        ({"temperature": 11.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ["x"] * 17}, "stop"),
    ],
)
def test_one_range_check_for_the_flags_and_the_harness(given, field):
    bad = dataclasses.replace(SamplingSettings(), **{k: tuple(v) if k == "stop" else v
                                                    for k, v in given.items()})  # fmt: skip
    assert [f for f, _ in bad.errors()] == [field]
    with pytest.raises(ValueError, match=field):
        check_settings(given, SamplingSettings(), tokens_left=100)


def test_the_harness_may_not_name_other_settings():
    with pytest.raises(ValueError, match="unknown settings"):
        check_settings({"seed": 3}, SamplingSettings(), tokens_left=100)
    assert check_settings({"top_k": 0}, SamplingSettings(), tokens_left=100).top_k == 0
    assert check_settings({}, SamplingSettings(), tokens_left=7).max_new_tokens == 7
