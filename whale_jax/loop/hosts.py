"""A harness phase across hosts: host 0 searches, the others wait for what it accepts.

A phase's work is the proposer (one LLM conversation: it must run once, or hosts would accept
different harnesses) and the rollouts that score its candidates, which host 0 runs on its own
engine. The other hosts wait on jax.distributed's coordination service, the key-value store every
process of the job already reaches, rather than inside a collective: a phase takes minutes to
hours, and a collective held that long is at the mercy of its transport's timeouts. The store
carries two things per phase:

- ``whale_jax/phase-<token>-<i>/stop/<host>``: a host told to stop (SIGTERM) while host 0 searches; host
  0's phase reads these between candidates, as it reads its own signal.
- ``whale_jax/phase-<token>-<i>/outcome``: host 0's result, written once: ``done`` (the accepted harness
  with its source, the phase's cost counters, its metric line), ``preempted`` or ``failed``.

``token`` is host 0's, shared with every host as the job starts, so a key of an earlier run in
the same job is never read as this one's.

The client is jax's own (``jax._src.distributed.global_state.client``, the one Orbax's multi-host
code uses too); ``board_client`` returns None where a jax lacks it, and the loop then refuses a
search across hosts as before.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from whale_jax.loop.metrics import jsonable

PREFIX = "whale_jax/phase-"


class PhaseFailed(RuntimeError):
    """Host 0's harness phase ended in an error (named in its log); a waiting host stops too."""


def board_client():
    """jax.distributed's key-value client (None: no distributed job, or no such client)."""
    try:
        from jax._src.distributed import global_state
    except ImportError:
        return None
    client = getattr(global_state, "client", None)
    needed = ("key_value_set", "key_value_dir_get")
    return client if client is not None and all(hasattr(client, n) for n in needed) else None


class PhaseBoard:
    """Host 0 and the waiting hosts of harness phase ``index`` (see the module's docstring)."""

    def __init__(self, client, token: str, index: int, host: int, *, poll_s: float = 0.5):
        self.client, self.host, self.poll_s = client, host, poll_s
        self.root = f"{PREFIX}{token}-{index:03d}/"  # token: host 0's, shared as the job starts
        self.published = False
        self._stop_seen = False
        self._stop_checked = 0.0

    def post_stop(self) -> None:
        self.client.key_value_set(f"{self.root}stop/{self.host}", "1")  # once per host and phase

    def stop_posted(self) -> bool:
        """Whether another host was told to stop (read at most every ``poll_s``)."""
        now = time.monotonic()
        if not self._stop_seen and now - self._stop_checked >= self.poll_s:
            self._stop_checked = now
            self._stop_seen = bool(self.client.key_value_dir_get(f"{self.root}stop/"))
        return self._stop_seen

    def publish(self, outcome: dict[str, Any]) -> None:
        value = json.dumps(outcome, sort_keys=True, default=jsonable)  # before it counts as sent
        self.client.key_value_set(f"{self.root}outcome", value)
        self.published = True

    def wait(self, stopping: Callable[[], bool], *, log: Callable[[str], None] | None = None,
             log_every_s: float = 600.0) -> dict[str, Any]:  # fmt: skip
        """Host 0's outcome. While waiting, posts a stop once ``stopping()`` turns true (this
        host's own SIGTERM), so host 0 ends its phase at its next check."""
        posted, t0, said = False, time.monotonic(), time.monotonic()
        while True:
            if not posted and stopping():
                self.post_stop()
                posted = True
            for key, value in self.client.key_value_dir_get(self.root):
                if key.rstrip("/").endswith("outcome"):
                    return json.loads(value)
            if log is not None and time.monotonic() - said >= log_every_s:
                said = time.monotonic()
                log(f"waiting for host 0's harness phase ({said - t0:.0f}s)")
            time.sleep(self.poll_s)
