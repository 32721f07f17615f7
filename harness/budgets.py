"""Trusted per-episode budgets, counted and enforced in the main process whatever a harness does."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budgets:
    """Defaults are WHALE's. ``passage_tokens`` is counted in whitespace-separated words (the tool
    side holds no tokenizer); every other token count comes from the backend's tokenizer. A call's
    prompt is capped at ``prompt_tokens`` when it starts a conversation and at ``prompt_tokens +
    response_tokens`` when it continues one."""

    def prompt_cap(self, continuing: bool) -> int:
        return self.prompt_tokens + (self.response_tokens if continuing else 0)

    assistant_tokens: int = 8192  # completion tokens summed over all calls of an episode
    prompt_tokens: int = 2048  # a conversation's first prompt
    # What a conversation's later prompts may add to that: its own sampled tokens, tool results and
    # feedback (the reference's response region: 8,192 tokens; chess 16,384).
    response_tokens: int = 8192
    passage_tokens: int = 200
    turns: int = 16  # calls in the longest conversation (session) of an episode
    retries: int = 10  # rejected actions (malformed or illegal), summed over the episode
    model_calls: int = 32
    wall_s: float = 600.0  # episode wall time, model waits included
    step_s: float = 60.0  # harness compute between two requests (a hang detector)
    tool_calls: int = 32
