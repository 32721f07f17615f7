"""Trusted per-episode budgets, counted and enforced in the main process whatever a harness does."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budgets:
    """Defaults are WHALE's. ``passage_tokens`` is counted in whitespace-separated words (the tool
    side holds no tokenizer); every other token count comes from the backend's tokenizer."""

    assistant_tokens: int = 8192  # completion tokens summed over all calls of an episode
    prompt_tokens: int = 2048  # per call
    passage_tokens: int = 200
    turns: int = 16  # calls in the longest conversation (session) of an episode
    retries: int = 10  # rejected actions (malformed or illegal), summed over the episode
    model_calls: int = 32
    wall_s: float = 600.0  # episode wall time, model waits included
    step_s: float = 60.0  # harness compute between two requests (a hang detector)
    tool_calls: int = 32
