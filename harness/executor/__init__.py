"""The executor: runs a harness over tasks in the sandbox and returns one ``EpisodeRecord`` per
(task, sample).

- ``loop``: the run loop (one event loop over every episode's channel, model and tool pools);
- ``ledger``: an episode's budgets and its conversations (sessions), counted in this process;
- ``audits``: whether the harness wrote the answer into the model's prompts.

Scoring each conversation (``harness.verdicts``) sits beside the records it reads: the domains use
it too.
"""

from harness.executor.loop import Executor, ExecutorConfig, load_check

__all__ = ["Executor", "ExecutorConfig", "load_check"]
