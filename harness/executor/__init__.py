"""The executor: runs a harness over tasks in the sandbox and returns one ``EpisodeRecord`` per
(task, sample).

- ``loop``: the run loop (one event loop over every episode's channel, model and tool pools);
- ``ledger``: an episode's budgets and its conversations (sessions), counted in this process;
- ``verdicts``: which of an episode's conversations the verifier scored, and how;
- ``audits``: whether the harness wrote the answer into the model's prompts.

``Executor`` and ``ExecutorConfig`` are resolved on first use: the domains import ``verdicts``, and
the loop imports the domains.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Executor", "ExecutorConfig"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'harness.executor' has no attribute {name!r}")
    from harness.executor import loop

    return getattr(loop, name)
