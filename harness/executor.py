"""The sandboxed executor: runs a harness over tasks in fresh worker processes and returns one
EpisodeRecord per (task, sample).

Main-process side (trusted): budgets, model calls (``ChatBackend.chat`` from a thread pool), tools,
timeouts, answer checks and verifiers. Worker side (untrusted harness code): harness.worker.

Containment of failures: an exception, a sandbox violation, a memory error or too much output costs
only its episode. A hang (no request for ``Budgets.step_s``) or an episode over ``Budgets.wall_s``
kills its worker; the culprit is recorded and the innocent episodes that died with it run again in a
fresh worker. A worker that dies without a known culprit (a signal, a C-level crash) has its
in-flight episodes split in two halves, each re-run in its own worker; a half that dies again is
split again, so a deterministic bomb is isolated in log2(in-flight) rounds and is the only episode
charged. A harness that fails to load costs the whole candidate.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from harness import sandbox
from harness.budgets import Budgets
from harness.domains.base import Domain, EpisodeContext, Task, ToolError
from harness.ipc import Channel
from harness.model_api import ChatBackend, ChatRequest, ChatResult, RngKey, SamplingSettings
from harness.records import EpisodeRecord, ModelCallRecord, ToolCallRecord
from harness.static_check import check_source

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOT = "import sys; sys.path.insert(0, sys.argv[2]); from harness.worker import main; main()"
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_SETTINGS = frozenset(
    {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "enable_thinking"}
)
_MAX_RERUNS = 4
_FAILURES = frozenset(
    {"static_check", "harness_load", "sandbox_violation", "output_limit", "memory_limit", "error",
     "timeout", "worker_died", "answer_not_in_completion"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    workers: int = 1  # pool workers per harness run
    concurrency: int = 64  # episodes in flight per worker (one thread each)
    limits: sandbox.Limits = sandbox.Limits()
    budgets: Budgets | None = None  # None: the domain's defaults
    default_settings: SamplingSettings = SamplingSettings()
    run_seed: int = 0
    step: int = 0
    load_timeout_s: float = 60.0
    static_check: bool = True  # off only in tests of the second line of defence
    max_frame_bytes: int = 4 << 20
    backend_threads: int = 512
    tool_threads: int = 4
    poll_s: float = 0.05


class _Ep:
    def __init__(self, key: str, task: Task, sample: int, domain: Domain):
        self.key, self.task, self.sample = key, task, sample
        self.record = EpisodeRecord(task_id=task.id, domain=domain.name, sample_index=sample)
        self.state = "pending"  # pending | running | suspect | done
        self.attempt = 0
        self.reset(domain)

    def reset(self, domain: Domain) -> None:
        reruns = self.record.reruns
        self.record = EpisodeRecord(
            task_id=self.task.id, domain=domain.name, sample_index=self.sample, reruns=reruns
        )
        self.env = domain.new_env(self.task)
        self.ctx: EpisodeContext | None = None
        self.sessions: list[dict[str, Any]] = []
        self.assistant_tokens = 0
        self.budget_stop: str | None = None
        self.refusals = 0
        self.waiting = 0
        self.started = self.busy_since = time.monotonic()
        self.worker: _Worker | None = None


class _Worker:
    def __init__(self, kind: str):
        self.kind = kind  # pool | group
        self.eps: dict[str, _Ep] = {}
        self.ready = False
        self.retiring = False
        self.dead = False
        self.culprit: tuple[_Ep, str, str] | None = None  # (episode, stop_reason, error)
        self.protections: dict[str, str] = {}
        self.spawned = time.monotonic()
        self.workdir = tempfile.mkdtemp(prefix="whale-worker-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.chan: Channel | None = None

    def send(self, msg: dict[str, Any]) -> None:
        try:
            assert self.chan is not None
            self.chan.send(msg)
        except OSError:
            pass  # the reader thread notices the death

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()


_SIGNAL_MEANING = {
    "SIGXCPU": " (CPU-time limit)",
    "SIGXFSZ": " (file-size limit)",
    "SIGSEGV": " (crash)",
    "SIGABRT": " (abort)",
}


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "unknown exit"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            return f"killed by signal {-rc}"
        return f"killed by {name}" + _SIGNAL_MEANING.get(name, "")
    return f"exit code {rc}"


def _string_leaves(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _string_leaves(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _string_leaves(v, out)


def gold_in_prompts(record: EpisodeRecord, question: str, golds: list[str]) -> bool:
    """Does harness-written prompt text contain a gold answer? Assistant messages, the task's
    question, tool results and completions of earlier calls are removed first: only what the
    harness itself wrote is audited. Golds shorter than 2 characters are skipped (they occur in any
    text)."""
    patterns = [
        re.compile(r"(?<![\w.])" + re.escape(g.strip()) + r"(?!\w)")
        for g in golds
        if len(g.strip()) >= 2
    ]
    if not patterns:
        return False
    known = [question]
    for t in record.tool_calls:
        _string_leaves(t.result, known)
    for i, call in enumerate(record.calls):
        earlier = [c.text for c in record.calls[:i]] + [c.raw_text for c in record.calls[:i]]
        removable = sorted({r for r in known + earlier if r}, key=len, reverse=True)
        for m in call.messages:
            if m.get("role") == "assistant":
                continue
            text = m.get("content", "")
            for r in removable:
                if r in text:
                    text = text.replace(r, " ")
            if any(p.search(text) for p in patterns):
                return True
    return False


class Executor:
    """Runs harness source over tasks. One Executor serves many runs (and concurrent runs from
    several threads: each run has its own workers, so one candidate's bomb costs no other)."""

    def __init__(self, backend: ChatBackend, config: ExecutorConfig = ExecutorConfig()):
        self.backend = backend
        self.config = config
        self._calls = concurrent.futures.ThreadPoolExecutor(config.backend_threads, "model-call")
        self._tools = concurrent.futures.ThreadPoolExecutor(config.tool_threads, "tool-call")
        self.last_protections: dict[str, str] = {}
        self.last_backend_stats: dict[str, float] = {}

    def _backend_stats(self) -> dict[str, float]:
        stats = getattr(self.backend, "stats", None)
        return dict(stats()) if callable(stats) else {}

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._tools.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(
        self,
        source: str,
        domain: Domain,
        tasks: Sequence[Task],
        *,
        samples: int = 1,
        run_id: str = "run",
        step: int | None = None,
    ) -> list[EpisodeRecord]:
        """One record per (task, sample), in task-major order. ``step`` (default: the config's)
        goes into every request's RNG identity: the RSFT step, so each step samples afresh."""
        r = _Run(self, source, domain, tasks, samples, run_id)
        r.step = self.config.step if step is None else int(step)
        before = self._backend_stats()
        records = r.execute()
        after = self._backend_stats()
        # The backend's counters (e.g. the engine's prefix cache) over this run; runs sharing
        # the backend at the same time are counted in each other's.
        self.last_backend_stats = {k: v - before.get(k, 0) for k, v in after.items()}
        if r.protections:
            self.last_protections = r.protections
        return records


class _Run:
    def __init__(
        self,
        ex: Executor,
        source: str,
        domain: Domain,
        tasks: Sequence[Task],
        samples: int,
        run_id: str,
    ):
        self.ex, self.cfg, self.domain, self.source = ex, ex.config, domain, source
        self.budgets = ex.config.budgets or domain.budgets
        self.run_id = run_id
        self.step = ex.config.step
        self.eps = [
            _Ep(f"e{i * samples + s}", t, s, domain)
            for i, t in enumerate(tasks)
            for s in range(samples)
        ]
        self.pending: collections.deque[_Ep] = collections.deque(self.eps)
        self.groups: collections.deque[list[_Ep]] = collections.deque()
        self.workers: list[_Worker] = []
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.remaining = len(self.eps)
        self.failed: tuple[str, str] | None = None
        self.protections: dict[str, str] = {}

    # ---- driver -------------------------------------------------------------------------------

    def execute(self) -> list[EpisodeRecord]:
        if self.cfg.static_check:
            violations = check_source(self.source, allowed_imports=self.domain.allowed_imports)
            if violations:
                self.fail_all("static_check", "; ".join(str(v) for v in violations[:20]))
                return [e.record for e in self.eps]
        try:
            with self.lock:
                while self.remaining > 0:
                    self.schedule()
                    self.check_deadlines()
                    self.changed.wait(self.cfg.poll_s)
        finally:
            with self.lock:
                workers = list(self.workers)
            for w in workers:
                w.send({"t": "exit"})
            for w in workers:
                self.reap(w, grace_s=1.0)
        return [e.record for e in self.eps]

    def schedule(self) -> None:
        live = [w for w in self.workers if not w.dead]
        pool = [w for w in live if w.kind == "pool" and not w.retiring]
        if self.pending and len(pool) < self.cfg.workers:
            self.spawn("pool", [])
        while self.groups and len(live) < self.cfg.workers + 2:
            self.spawn("group", self.groups.popleft())
            live = [w for w in self.workers if not w.dead]

    def check_deadlines(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.dead or w.culprit is not None:
                continue
            if not w.ready:
                if now - w.spawned > self.cfg.load_timeout_s:
                    self.fail_all("harness_load", f"not ready after {self.cfg.load_timeout_s:.0f}s")
                    w.kill()
                continue
            for ep in w.eps.values():
                if ep.waiting == 0 and now - ep.busy_since > self.budgets.step_s:
                    msg = f"no request for {self.budgets.step_s:.1f}s (hang or long computation)"
                    w.culprit = (ep, "timeout", msg)
                elif now - ep.started > self.budgets.wall_s:
                    w.culprit = (ep, "timeout", f"episode over {self.budgets.wall_s:.1f}s")
                else:
                    continue
                w.kill()
                break

    # ---- workers ------------------------------------------------------------------------------

    def spawn(self, kind: str, group: list[_Ep]) -> None:
        w = _Worker(kind)
        for ep in group:
            ep.state = "pending"
            w.eps[ep.key] = ep
        self.workers.append(w)
        parent, child = socket.socketpair()
        with open(os.path.join(w.workdir, "harness.py"), "w", encoding="utf-8") as f:
            f.write(self.source)
        log = open(os.path.join(w.workdir, "worker.log"), "wb")  # C-level output; FSIZE-capped
        try:
            w.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, str(child.fileno()), _ROOT],
                pass_fds=(child.fileno(),),
                cwd=w.workdir,
                env=sandbox.scrubbed_env(w.workdir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            child.close()
            log.close()
        w.chan = Channel(parent, max_frame=self.cfg.max_frame_bytes)
        w.send(
            {
                "t": "init",
                "source": self.source,
                "allowed_imports": sorted(self.domain.allowed_imports),
                "tools": list(self.domain.tool_names),
                "concurrency": self.cfg.concurrency if kind == "pool" else len(group),
                "limits": self.cfg.limits.to_dict(),
                "max_frame_bytes": self.cfg.max_frame_bytes,
            }
        )
        threading.Thread(target=self.read, args=(w,), name="worker-reader", daemon=True).start()

    def read(self, w: _Worker) -> None:
        assert w.chan is not None
        handlers = {
            "chat": self.on_chat,
            "tool": self.on_tool,
            "done": self.on_done,
            "ready": self.on_ready,
            "load_error": self.on_load_error,
        }
        reason = ""
        try:
            while True:
                try:
                    msg = w.chan.recv()
                except EOFError:
                    break
                except Exception as e:  # FrameError, OSError, anything a hostile peer provokes
                    reason = f"protocol: {type(e).__name__}: {e}"[:500]
                    break
                handler = handlers.get(msg.get("t", "")) if isinstance(msg.get("t"), str) else None
                if handler is None:
                    reason = f"protocol: unknown message {str(msg.get('t'))[:40]!r}"
                    break
                try:
                    handler(w, msg)
                except Exception as e:  # a frame the handler could not take fails this worker
                    reason = (f"protocol: malformed {str(msg.get('t'))[:40]!r} message "
                              f"({type(e).__name__}: {str(e)[:200]})")  # fmt: skip
                    break
        finally:  # whatever happened above, the worker is killed, reaped and its episodes settled
            if reason:
                w.kill()
            self.on_death(w, reason)

    def reap(self, w: _Worker, grace_s: float = 0.0) -> str:
        rc = None
        if w.proc is not None:
            try:
                rc = w.proc.wait(timeout=grace_s) if grace_s else w.proc.poll()
            except subprocess.TimeoutExpired:
                rc = None
            if rc is None:
                w.kill()
                rc = w.proc.wait()
        if w.chan is not None:
            w.chan.close()
        shutil.rmtree(w.workdir, ignore_errors=True)
        return _describe_exit(rc)

    def on_ready(self, w: _Worker, msg: dict[str, Any]) -> None:
        with self.lock:
            w.ready = True
            w.protections = {str(k): str(v) for k, v in dict(msg.get("protections", {})).items()}
            self.protections = w.protections
            if w.kind == "group":
                for ep in list(w.eps.values()):
                    self.start(w, ep)
            else:
                self.feed(w)

    def on_load_error(self, w: _Worker, msg: dict[str, Any]) -> None:
        with self.lock:
            reason = "sandbox_violation" if msg.get("violation") else "harness_load"
            self.fail_all(reason, str(msg.get("error"))[-4000:])

    def feed(self, w: _Worker) -> None:
        while self.pending and len(w.eps) < self.cfg.concurrency and not w.dead:
            self.start(w, self.pending.popleft())
        if not w.eps and not self.pending and not w.retiring:
            w.retiring = True
            w.send({"t": "exit"})

    def start(self, w: _Worker, ep: _Ep) -> None:
        if ep.attempt:
            ep.record.reruns += 1
        ep.attempt += 1
        ep.reset(self.domain)
        ep.ctx = EpisodeContext(budgets=self.budgets)
        ep.state, ep.worker = "running", w
        w.eps[ep.key] = ep
        w.send({"t": "episode", "ep": ep.key, "task": self.domain.public_view(ep.task)})

    def on_death(self, w: _Worker, reason: str) -> None:
        exit_text = self.reap(w, grace_s=2.0)
        with self.lock:
            w.dead = True
            inflight = [e for e in w.eps.values() if e.state in ("running", "pending")]
            w.eps.clear()
            if self.failed is not None or not inflight:
                self.changed.notify_all()
                return
            if not w.ready:
                self.fail_all("harness_load", f"worker died before loading: {reason or exit_text}")
                return
            if w.culprit is not None:
                culprit, stop, error = w.culprit
                self.finish(culprit, stop, error=error)
                for ep in inflight:
                    if ep is not culprit:
                        self.requeue(ep, "worker killed for another episode")
            elif len(inflight) == 1:
                self.finish(inflight[0], "worker_died", error=reason or exit_text)
            else:
                half = len(inflight) // 2
                for part in (inflight[:half], inflight[half:]):
                    for ep in part:
                        ep.state = "suspect"
                    self.groups.append(part)
            self.changed.notify_all()

    def requeue(self, ep: _Ep, why: str) -> None:
        if ep.attempt > _MAX_RERUNS:
            self.finish(ep, "worker_died", error=f"{why}; gave up after {ep.attempt} attempts")
        else:
            ep.state = "pending"
            self.pending.appendleft(ep)

    def fail_all(self, stop: str, error: str) -> None:
        """The candidate itself failed (static check, load): every episode carries the reason."""
        with self.lock:
            if self.failed is None:
                self.failed = (stop, error)
            self.pending.clear()
            self.groups.clear()
            for ep in self.eps:
                if ep.state != "done":
                    self.finish(ep, stop, error=error)
            for w in self.workers:
                w.kill()

    # ---- requests from harness code ------------------------------------------------------------

    def lookup(self, w: _Worker, msg: dict[str, Any]) -> _Ep | None:
        ep = w.eps.get(str(msg.get("ep")))
        return ep if ep is not None and ep.state == "running" else None

    def refuse(self, w: _Worker, ep: _Ep, rid: Any, budget: str, detail: str) -> None:
        ep.budget_stop = ep.budget_stop or f"budget:{budget}"
        ep.refusals += 1
        if ep.refusals > 3:  # a harness that ignores refusals is a runaway: stop it here
            w.culprit = (ep, f"budget:{budget}", f"kept calling after refusal: {detail}")
            w.kill()
            return
        w.send({"t": "reply", "rid": rid, "ok": False, "kind": "budget", "error": detail})

    def on_chat(self, w: _Worker, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        with self.lock:
            ep = self.lookup(w, msg)
            if ep is None:
                return
            b, rec = self.budgets, ep.record
            messages = msg.get("messages")
            if not (
                isinstance(messages, list)
                and messages
                and all(
                    isinstance(m, dict)
                    and m.get("role") in _ROLES
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                error = "messages must be a non-empty list of {'role', 'content'} dicts"
                w.send({"t": "reply", "rid": rid, "ok": False, "kind": "model", "error": error})
                return
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            try:
                settings = self.settings(msg.get("settings") or {}, b, ep)
            except (TypeError, ValueError, ArithmeticError) as e:
                w.send({"t": "reply", "rid": rid, "ok": False, "kind": "model",
                        "error": f"bad sampling settings: {e}"})  # fmt: skip
                return
            if len(rec.calls) >= b.model_calls:
                return self.refuse(w, ep, rid, "model_calls", f"{b.model_calls} calls used")
            if settings.max_new_tokens <= 0:
                return self.refuse(w, ep, rid, "assistant_tokens", f"{b.assistant_tokens} used")
            if sum(len(m["content"]) for m in messages) > 64 * b.prompt_tokens:
                return self.refuse(w, ep, rid, "prompt_tokens", "prompt far over the budget")
            session = next(
                (
                    s
                    for s in ep.sessions
                    if len(messages) > len(s["prefix"])
                    and messages[: len(s["prefix"])] == s["prefix"]
                ),
                None,
            )
            if session is not None and session["turns"] >= b.turns:
                return self.refuse(w, ep, rid, "turns", f"{b.turns} turns used")
            if session is None:
                session = {"id": f"{self.run_id}/{ep.key}/a{ep.attempt}/s{len(ep.sessions)}",
                           "prefix": [], "turns": 0}  # fmt: skip
                ep.sessions.append(session)
            call_index = len(rec.calls)
            call = ModelCallRecord(
                call_index=call_index,
                session_id=session["id"],
                messages=messages,
                settings=settings.to_dict(),
                train=bool(msg.get("train", True)),
            )
            rec.calls.append(call)
            session["turns"] += 1
            rec.turns = max(rec.turns, session["turns"])
            ep.waiting += 1
            request = ChatRequest(
                episode_id=f"{self.run_id}/{ep.key}",
                session_id=session["id"],
                messages=tuple(messages),
                settings=settings,
                train=call.train,
                rng=RngKey(
                    run_seed=self.cfg.run_seed,
                    step=self.step,
                    task_id=ep.task.id,
                    sample_index=ep.sample,
                    call_index=call_index,
                ),
                max_prompt_tokens=b.prompt_tokens,
            )
            attempt = ep.attempt
        self.ex._calls.submit(self.call_model, w, ep, attempt, rid, request, call, session)

    def settings(self, given: dict[str, Any], b: Budgets, ep: _Ep) -> SamplingSettings:
        """The call's sampling settings: the harness's overrides on the defaults, each checked
        for type and range (a frame is hostile: non-finite or huge numbers, bools for numbers,
        unknown keys all refused with ValueError)."""
        if not isinstance(given, dict):
            raise ValueError("settings must be an object")
        unknown = set(given) - _SETTINGS
        if unknown:
            raise ValueError(f"unknown settings {sorted(map(str, unknown))[:5]}")
        base = self.cfg.default_settings.to_dict()
        for key, value in given.items():
            if key in ("temperature", "top_p"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{key} must be a number")
                if not math.isfinite(value) or not 0.0 <= value <= 10.0:
                    raise ValueError(f"{key} out of range")
            elif key in ("top_k", "max_new_tokens"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{key} must be an integer")
                if not 0 <= value <= 1 << 30:
                    raise ValueError(f"{key} out of range")
            elif key == "stop":
                if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                    raise ValueError("stop must be a list of strings")
            elif key == "enable_thinking" and value is not None and not isinstance(value, bool):
                raise ValueError("enable_thinking must be true, false or null")
            base[key] = value
        s = SamplingSettings.from_dict(base)
        if not (0.0 <= s.temperature <= 10.0 and 0.0 < s.top_p <= 1.0 and s.top_k >= 0):
            raise ValueError("temperature/top_p/top_k out of range")
        if len(s.stop) > 16 or any(len(x) > 200 for x in s.stop):
            raise ValueError("at most 16 stop strings of 200 characters")
        left = b.assistant_tokens - ep.assistant_tokens
        return dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, left))

    def call_model(
        self,
        w: _Worker,
        ep: _Ep,
        attempt: int,
        rid: Any,
        request: ChatRequest,
        call: ModelCallRecord,
        session: dict[str, Any],
    ) -> None:
        t0 = time.monotonic()
        try:
            result = self.ex.backend.chat(request)
        except Exception as e:  # a backend failure costs the call, never the run
            result = ChatResult(text="", raw_text="", finish_reason="error", error=repr(e)[:500])
        with self.lock:
            if ep.attempt != attempt or ep.state != "running":
                return
            ep.waiting -= 1
            ep.busy_since = time.monotonic()
            rec, b = ep.record, self.budgets
            call.latency_s = ep.busy_since - t0
            call.prompt_ids = list(result.prompt_ids)
            call.completion_ids = list(result.completion_ids)
            call.prompt_tokens, call.completion_tokens = (
                result.prompt_tokens,
                result.completion_tokens,
            )
            call.finish_reason, call.error = result.finish_reason, result.error
            call.weights_version = result.weights_version
            rec.prompt_tokens += result.prompt_tokens
            rec.completion_tokens += result.completion_tokens
            ep.assistant_tokens += result.completion_tokens
            if result.finish_reason == "prompt_too_long" or result.prompt_tokens > b.prompt_tokens:
                call.error = call.error or f"prompt over {b.prompt_tokens} tokens"
                return self.refuse(w, ep, rid, "prompt_tokens", call.error)
            if result.error is not None:
                w.send(
                    {"t": "reply", "rid": rid, "ok": False, "kind": "model", "error": result.error}
                )
                return
            call.text, call.raw_text = result.text, result.raw_text
            assert ep.ctx is not None
            ep.ctx.completions += [result.text, result.raw_text]
            session["prefix"] = [*request.messages, {"role": "assistant", "content": result.text}]
            reply = {
                "t": "reply",
                "rid": rid,
                "ok": True,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "completion_tokens": result.completion_tokens,
                "remaining": {
                    "assistant_tokens": b.assistant_tokens - ep.assistant_tokens,
                    "model_calls": b.model_calls - len(rec.calls),
                    "turns": b.turns - session["turns"],
                },
            }
        w.send(reply)

    def on_tool(self, w: _Worker, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        with self.lock:
            ep = self.lookup(w, msg)
            if ep is None:
                return
            name, args, kwargs = msg.get("name"), msg.get("args", []), msg.get("kwargs", {})
            if (
                name not in self.domain.tool_names
                or not isinstance(args, list)
                or not isinstance(kwargs, dict)
            ):
                w.send({"t": "reply", "rid": rid, "ok": False, "kind": "tool",
                        "error": f"no tool {str(name)[:40]!r}"})  # fmt: skip
                return
            if len(ep.record.tool_calls) >= self.budgets.tool_calls:
                return self.refuse(w, ep, rid, "tool_calls", f"{self.budgets.tool_calls} used")
            rec = ToolCallRecord(name=name, arguments={"args": args, "kwargs": kwargs})
            ep.record.tool_calls.append(rec)
            ep.waiting += 1
            attempt = ep.attempt
        self.ex._tools.submit(self.call_tool, w, ep, attempt, rid, rec)

    def call_tool(self, w: _Worker, ep: _Ep, attempt: int, rid: Any, rec: ToolCallRecord) -> None:
        t0 = time.monotonic()
        ok, value, error = True, None, None
        try:
            assert ep.ctx is not None
            value = ep.env.call(rec.name, rec.arguments["args"], rec.arguments["kwargs"], ep.ctx)
            json.dumps(value)
        except ToolError as e:
            ok, error = False, str(e)
        except Exception as e:  # trusted tool code failed on odd input: the call fails, not the run
            ok, error = False, f"tool failed: {type(e).__name__}: {e}"[:500]
        with self.lock:
            if ep.attempt != attempt or ep.state != "running":
                return
            ep.waiting -= 1
            ep.busy_since = time.monotonic()
            rec.latency_s = ep.busy_since - t0
            rec.result, rec.error = value, error
            actions = self.domain.action_tools
            ep.record.turns = max(
                ep.record.turns,
                sum(t.name in (actions or self.domain.tool_names) for t in ep.record.tool_calls),
            )
            assert ep.ctx is not None
            if ep.ctx.retries > self.budgets.retries:
                return self.refuse(w, ep, rid, "retries", f"{self.budgets.retries} retries used")
        if ok:
            w.send({"t": "reply", "rid": rid, "ok": True, "value": value})
        else:
            w.send({"t": "reply", "rid": rid, "ok": False, "kind": "tool", "error": error})

    def on_done(self, w: _Worker, msg: dict[str, Any]) -> None:
        with self.lock:
            ep = self.lookup(w, msg)
            if ep is None:
                return
            kind = msg.get("kind")
            error = msg.get("error")
            answer = msg.get("answer")
            ep.record.output = str(msg.get("output", ""))[: self.cfg.limits.output_bytes]
            stop = {
                "violation": "sandbox_violation",
                "output_limit": "output_limit",
                "memory": "memory_limit",
                "exception": "error",
                "budget": ep.budget_stop or "budget",
            }.get(str(kind), "")
            if kind == "exception" and isinstance(error, str) and "MemoryError" in error:
                stop = "memory_limit"
            if answer is not None and not isinstance(answer, str):
                stop, error, answer = "error", "answer is not a string", None
            self.finish(ep, stop, error=str(error) if error is not None else None, answer=answer)
            del w.eps[ep.key]
            if w.kind == "pool":
                self.feed(w)
            elif not w.eps:
                w.retiring = True
                w.send({"t": "exit"})

    # ---- scoring -----------------------------------------------------------------------------

    def finish(
        self, ep: _Ep, stop: str, *, error: str | None = None, answer: str | None = None
    ) -> None:
        """Close an episode: check the answer came from the model, score it, audit the prompts."""
        if ep.state == "done":
            return
        rec = ep.record
        rec.error = error
        rec.wall_s = time.monotonic() - ep.started
        rec.answer = answer
        if not stop:
            if self.domain.answer_required:
                if answer is None or not answer.strip():
                    stop = ep.budget_stop or "no_answer"
                else:
                    rec.answer_in_completion = any(
                        answer.strip() in c.text or answer.strip() in c.raw_text
                        for c in rec.calls
                        if c.error is None
                    )
                    stop = "answered" if rec.answer_in_completion else "answer_not_in_completion"
                    if ep.budget_stop and rec.answer_in_completion:
                        stop = ep.budget_stop
            else:
                stop = ep.env.status or ep.budget_stop or "no_answer"
        rec.stop_reason = stop
        t0 = time.monotonic()
        clean = error is None and stop not in _FAILURES
        if clean and (rec.answer_in_completion or not self.domain.answer_required):
            try:
                rec.reward, rec.extracted = self.domain.score(ep.task, answer, ep.env)
            except Exception as e:  # a verifier bug must not pass as a reward
                rec.reward, rec.extracted = 0.0, None
                rec.error = f"verifier failed: {type(e).__name__}: {e}"
        try:
            rec.gold_in_prompt = gold_in_prompts(
                rec, ep.task.question, self.domain.gold_strings(ep.task)
            )
        except Exception:
            rec.gold_in_prompt = False
        rec.score_s = time.monotonic() - t0
        ep.state = "done"
        self.remaining -= 1
        self.changed.notify_all()
