"""What the hosts of one job agree on: choices that lead into a collective (a save, stopping; at
the end of this file), the harness every host starts from, and a harness phase across hosts: host
0 searches, the others wait for what it accepts.

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
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from harness.files import write_atomic
from whale_jax.loop.config import ConfigError
from whale_jax.loop.metrics import jsonable
from whale_jax.loop.state import AcceptedHarness, Preempted, emit, harness_source
from whale_jax.sharding import process_gather_json, process_max

if TYPE_CHECKING:
    from whale_jax.loop.build import Run

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


# ---- what every host agrees on ---------------------------------------------------------------


def agreed(flag: bool) -> bool:
    """``flag`` or-ed over hosts. A choice that leads into a collective (a checkpoint save,
    stopping) is made once, the same on every host: a host that went alone into Orbax's
    barrier, or stopped while the others trained, would hang the job."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(process_max(int(bool(flag))))


def check_term(run: Run) -> None:
    if agreed(run.term_at is not None):  # every host stops at the same step
        if run.term_at is None:  # another host was told first
            run.term_at = time.monotonic()
        raise Preempted()


def sync_harness(run: Run) -> None:
    """Every host takes host 0's current harness (a resumed host's own disk may lack the
    accepted source a checkpoint refers to)."""
    mine: dict[str, Any] = {}
    if jax.process_index() == 0:
        try:
            mine = {"source": harness_source(run), "token": os.urandom(6).hex()}
        except OSError as e:  # every host stops, none waits alone in a later collective
            mine = {"error": f"{type(e).__name__}: {e}"}
    got = process_gather_json(mine)[0]
    if "error" in got:
        raise ConfigError(f"host 0 cannot read its harness {run.state.harness.path} "
                          f"under its --run_dir: {got['error']}")  # fmt: skip
    run.board_token = got["token"]  # this job's keys apart from any earlier run's
    if jax.process_index() != 0:
        write_atomic(os.path.join(run.root, run.state.harness.path), got["source"])


def await_harness_phase(run: Run, index: int) -> None:
    """A host other than 0: waits for host 0's phase and takes what it accepted."""
    s = run.state
    board = PhaseBoard(run.board_client, run.board_token, index, jax.process_index())
    run.say(f"harness phase {index}: host 0 searches; waiting for its outcome")
    out = board.wait(lambda: run.term_at is not None, log=run.say)
    if out["status"] == "preempted":
        if run.term_at is None:  # another host was told first
            run.term_at = time.monotonic()
        raise Preempted()
    if out["status"] != "done":
        raise PhaseFailed(f"harness phase {index} failed on host 0: {out.get('error')} "
                          "(host 0's log has the rest)")  # fmt: skip
    s.harness = AcceptedHarness(**out["harness"])
    write_atomic(os.path.join(run.root, s.harness.path), out["source"])
    for name, delta in out["counters"].items():  # the phase's cost, as counted on host 0
        s.counters[name] = s.counters.get(name, 0) + delta
    emit(run, "harness_phase", **out["line"])
