"""The sandboxed executor: runs a harness over tasks, one jailed process per episode, and returns one
EpisodeRecord per (task, sample).

Trusted side (this process): budgets and sessions (``harness.executor.ledger``), model calls
(``ChatBackend.chat`` from a thread pool), tools (``Domain`` envs), timeouts, scoring and prompt
audits (``harness.executor.audits``). Untrusted side: one zygote per run (``harness.sandbox.zygote``, started and
watched by ``harness.sandbox.supervisor``) that forks one jailed process per episode (``harness.sandbox.worker``).

One event loop per run reads every episode's channel (``selectors``); model and tool calls run in
pools and answer on the episode's channel. Every frame is checked against ``harness.sandbox.ipc``'s
tables; a bad frame, a hang, a crash or a runaway costs only its episode, and the run always
finishes. Episodes share nothing: a fresh process per episode, forked from a zygote that never
ran harness code.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from harness import verdicts
from harness.api import Budgets, ChatBackend, ChatRequest, ChatResult, RngKey, SamplingSettings
from harness.domains.base import Domain, EpisodeContext, Task, ToolError
from harness.executor import audits
from harness.executor.ledger import Ledger, Refused, check_messages, check_settings, check_tools
from harness.records import EpisodeRecord, ModelCallRecord, ToolCallRecord
from harness.sandbox import ipc, jail, python_layer
from harness.sandbox.static_check import StaticCheckError, check_source
from harness.sandbox.supervisor import LoadError, SandboxUnavailable, Zygote

__all__ = ["Executor", "ExecutorConfig", "SandboxUnavailable", "load_check"]

_MAX_ZYGOTE_RESTARTS = 3
_FAILURES = frozenset(
    {"static_check", "harness_load", "sandbox_violation", "output_limit", "memory_limit", "error",
     "timeout", "worker_died", "protocol_error", "answer_not_in_completion"}
)  # fmt: skip
_DONE_STOP = {
    "violation": "sandbox_violation",
    "output_limit": "output_limit",
    "memory": "memory_limit",
    "exception": "error",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    concurrency: int = 64  # episodes in flight per run (one process each)
    limits: python_layer.Limits = python_layer.Limits()
    budgets: Budgets | None = None  # None: the domain's defaults
    default_settings: SamplingSettings = SamplingSettings()
    run_seed: int = 0
    step: int = 0
    load_timeout_s: float = 60.0
    sandbox: jail.Policy = dataclasses.field(default_factory=jail.Policy)  # mode read when made
    # The Python-level layers: static check, audit hook, restricted builtins and module facades.
    # Off only in tests that show the OS layer holds alone.
    python_layers: bool = True
    max_frame_bytes: int = 4 << 20
    backend_threads: int = 512
    tool_threads: int = 4
    poll_s: float = 0.05
    send_timeout_s: float = 10.0  # an episode that does not read its replies for this long dies

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 4000:
            raise ValueError(f"concurrency {self.concurrency}: expected 1 to 4000")


class _Ep:
    """One (task, sample): its record and, while it runs, its process's channel."""

    def __init__(self, key: str, task: Task, sample: int, domain: Domain):
        self.key, self.task, self.sample = key, task, sample
        self.record = EpisodeRecord(task_id=task.id, domain=domain.name, sample_index=sample)
        self.state = "pending"  # pending | running | done
        self.attempt = 0
        self.sock: socket.socket | None = None
        self.decoder: ipc.FrameDecoder | None = None
        self.send_lock = threading.Lock()
        self.exit_reason: str | None = None
        self.eof_at: float | None = None
        self.pid = 0
        self.started = time.monotonic()

    def reset(self, domain: Domain, budgets: Budgets, run_id: str) -> None:
        reruns = self.record.reruns + (1 if self.attempt else 0)
        self.attempt += 1
        self.record = EpisodeRecord(
            task_id=self.task.id, domain=domain.name, sample_index=self.sample, reruns=reruns
        )
        self.env = domain.new_env(self.task)
        self.ctx = EpisodeContext(budgets=budgets)
        self.ledger = Ledger(budgets=budgets, session_prefix=f"{run_id}/{self.key}/a{self.attempt}")
        self.waiting = 0
        self.started = self.busy_since = time.monotonic()
        self.exit_reason, self.eof_at = None, None


def harness_zygote(
    cfg: ExecutorConfig,
    source: str,
    domain: Domain,
    on_event: Callable[[str, dict[str, Any]], None],
) -> Zygote:
    """The sandboxed process tree that loads ``source`` and forks one process per episode."""
    return Zygote(
        "harness",
        policy=cfg.sandbox,
        limits=cfg.limits,
        max_children=cfg.concurrency,
        on_event=on_event,
        source=source,
        allowed_imports=tuple(domain.allowed_imports),
        tools=tuple(domain.tool_names),
        python_layers=cfg.python_layers,
        max_frame_bytes=cfg.max_frame_bytes,
    )


def python_layers(cfg: ExecutorConfig) -> str:
    if cfg.python_layers:
        return "static check, audit hook, restricted builtins, module facades"
    return "off (test switch)"


def load_check(source: str, domain: Domain, config: ExecutorConfig | None = None) -> dict[str, str]:
    """Loads ``source`` as a run would (the static check, then the sandbox's zygote) and runs no
    episode; returns the protections the sandbox applied (layer: how). Raises
    ``StaticCheckError``, ``SandboxUnavailable`` (the machine refuses the policy), ``LoadError``
    (the harness fails to load) or ``TimeoutError``."""
    cfg = config or ExecutorConfig()
    if cfg.python_layers:
        violations = check_source(source, allowed_imports=domain.allowed_imports)
        if violations:
            raise StaticCheckError(violations)
    z = harness_zygote(cfg, source, domain, lambda kind, msg: None)
    try:
        return {**z.wait_ready(cfg.load_timeout_s), "python_layers": python_layers(cfg)}
    finally:
        z.close()


class Executor:
    """Runs harness source over tasks. One Executor serves many runs, also concurrently from
    several threads (harness-search candidates): each run has its own zygote."""

    def __init__(self, backend: ChatBackend, config: ExecutorConfig | None = None):
        self.backend = backend
        self.config = config = config or ExecutorConfig()
        self._calls = concurrent.futures.ThreadPoolExecutor(config.backend_threads, "model-call")
        self._tools = concurrent.futures.ThreadPoolExecutor(config.tool_threads, "tool-call")
        # What the sandbox applied in the latest run that started a zygote (layer: how).
        self.last_protections: dict[str, str] = {}

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
        goes into every request's RNG identity: the RSFT step, so each step samples afresh.
        Raises SandboxUnavailable when the machine refuses a protection the policy requires."""
        r = _Run(self, source, domain, tasks, samples, run_id)
        r.step = self.config.step if step is None else int(step)
        records = r.execute()
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
        self.running: dict[str, _Ep] = {}
        self.lock = threading.RLock()
        self.events: queue.SimpleQueue[tuple[Zygote, str, dict[str, Any]]] = queue.SimpleQueue()
        self.sel = selectors.DefaultSelector()
        self.remaining = len(self.eps)
        self.protections: dict[str, str] = {}
        self.zygote: Zygote | None = None
        self.zygote_restarts = 0

    # ---- driver -------------------------------------------------------------------------------

    def execute(self) -> list[EpisodeRecord]:
        if self.cfg.python_layers:
            violations = check_source(self.source, allowed_imports=self.domain.allowed_imports)
            if violations:
                self.fail_all("static_check", "; ".join(str(v) for v in violations[:20]))
                return [e.record for e in self.eps]
        try:
            if self.new_zygote():
                while self.remaining > 0:
                    self.admit()
                    for key, _ in self.sel.select(self.cfg.poll_s):
                        self.read(key.data)
                    self.drain_events()
                    self.check_deadlines()
        finally:
            with self.lock:
                for ep in list(self.running.values()):
                    self.detach(ep)
            if self.zygote is not None:
                self.zygote.close()
            self.sel.close()
        return [e.record for e in self.eps]

    def new_zygote(self) -> bool:
        """Start the run's zygote and wait for its load check; False when the candidate failed."""
        z = harness_zygote(self.cfg, self.source, self.domain,
                           lambda kind, msg: self.events.put((z, kind, msg)))  # fmt: skip
        self.zygote = z
        layers = python_layers(self.cfg)
        try:
            self.protections = {**z.wait_ready(self.cfg.load_timeout_s), "python_layers": layers}
        except LoadError as e:
            self.protections = {**e.protections, "python_layers": layers}
            stop = "sandbox_violation" if e.violation else "harness_load"
            self.fail_all(stop, e.error[-4000:])
            return False
        except TimeoutError as e:
            self.fail_all("harness_load", f"harness: {e}")
            return False
        except SandboxUnavailable:
            raise
        return True

    def admit(self) -> None:
        z = self.zygote
        while self.pending and len(self.running) < self.cfg.concurrency and z and not z.dead:
            ep = self.pending.popleft()
            with self.lock:
                ep.reset(self.domain, self.budgets, self.run_id)
                parent, child = socket.socketpair()
                parent.settimeout(self.cfg.send_timeout_s)
                ep.sock, ep.decoder = parent, ipc.FrameDecoder(self.cfg.max_frame_bytes)
                ep.state = "running"
                self.running[ep.key] = ep
                self.sel.register(parent, selectors.EVENT_READ, ep)
            try:
                z.start(ep.key, {"task": self.domain.public_view(ep.task)}, (child.fileno(),))
            except OSError:
                pass  # the zygote is gone: drain_events requeues
            finally:
                child.close()

    def read(self, ep: _Ep) -> None:
        assert ep.sock is not None and ep.decoder is not None
        try:
            data = ep.sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            with self.lock:
                self.on_eof(ep)
            return
        try:
            frames = ep.decoder.feed(data)
            for frame in frames:
                kind = ipc.check(frame, ipc.EPISODE_TO_EXECUTOR)
                with self.lock:
                    if ep.state != "running":
                        return
                    getattr(self, f"on_{kind}")(ep, frame)
        except ipc.FrameError as e:
            with self.lock:
                self.finish(ep, "protocol_error", error=f"protocol: {e}"[:500])
        except Exception as e:  # a frame the trusted side could not take costs its episode
            with self.lock:
                self.finish(ep, "protocol_error", error=f"protocol: {type(e).__name__}: {e}"[:500])

    def drain_events(self) -> None:
        while True:
            try:
                z, kind, msg = self.events.get_nowait()
            except queue.Empty:
                break
            if z is not self.zygote:
                continue  # an earlier zygote of this run: its episodes were requeued
            with self.lock:
                if kind == "started":
                    ep = self.running.get(msg["key"])
                    if ep is not None:
                        ep.pid = msg["pid"]
                elif kind == "exited":
                    ep = self.running.get(msg["key"])
                    if ep is not None:
                        ep.exit_reason = msg["reason"]
                        if ep.eof_at is not None:
                            self.finish(
                                ep, "worker_died", error=f"episode process {ep.exit_reason}"
                            )
                elif kind == "dead":
                    self.on_zygote_death(msg["reason"])
        now = time.monotonic()
        with self.lock:
            for ep in list(self.running.values()):
                if ep.eof_at is not None and now - ep.eof_at > 5.0:
                    self.finish(ep, "worker_died", error="episode process closed its channel")

    def on_zygote_death(self, reason: str) -> None:
        if self.remaining == 0:
            return
        inflight = list(self.running.values())
        for ep in inflight:
            self.detach(ep)
            ep.state = "pending"
            self.pending.appendleft(ep)
        self.zygote_restarts += 1
        if self.zygote_restarts > _MAX_ZYGOTE_RESTARTS:
            self.fail_all(
                "worker_died", f"sandbox zygote died {self.zygote_restarts} times: {reason}"
            )
            return
        assert self.zygote is not None
        self.zygote.close(grace_s=0.0)
        self.new_zygote()

    def check_deadlines(self) -> None:
        now = time.monotonic()
        b = self.budgets
        with self.lock:
            for ep in list(self.running.values()):
                if ep.eof_at is not None:
                    continue
                if ep.waiting == 0 and now - ep.busy_since > b.step_s:
                    msg = f"no request for {b.step_s:.1f}s (hang or long computation)"
                    self.finish(ep, "timeout", error=msg)
                elif now - ep.started > b.wall_s:
                    self.finish(ep, "timeout", error=f"episode over {b.wall_s:.1f}s")

    # ---- episode lifecycle ---------------------------------------------------------------------

    def detach(self, ep: _Ep) -> None:
        """Stop listening to an episode and make sure its process is gone."""
        self.running.pop(ep.key, None)
        if ep.sock is not None:
            try:
                self.sel.unregister(ep.sock)
            except (KeyError, ValueError):
                pass
            # A model-call thread may be inside sendall on this socket: shut it down first (the
            # send fails at once), then close under the send lock so the descriptor cannot be
            # reused by another episode's socket while a send is still in flight.
            try:
                ep.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            with ep.send_lock:
                ep.sock.close()
                ep.sock = None
            if self.zygote is not None and ep.exit_reason is None:
                self.zygote.stop(ep.key)

    def on_eof(self, ep: _Ep) -> None:
        if ep.state != "running":
            return
        if ep.exit_reason is not None:
            self.finish(ep, "worker_died", error=f"episode process {ep.exit_reason}")
            return
        ep.eof_at = time.monotonic()
        if ep.sock is not None:
            try:
                self.sel.unregister(ep.sock)
            except (KeyError, ValueError):
                pass
        if self.zygote is not None:
            self.zygote.stop(ep.key)  # its reason arrives as "exited"

    def send(self, ep: _Ep, attempt: int, msg: dict[str, Any]) -> None:
        """Answer an episode (from any thread). One that does not read its replies dies."""
        frame = ipc.encode(msg)
        with ep.send_lock:
            sock = ep.sock
            if sock is None or ep.attempt != attempt:
                return
            try:
                sock.sendall(frame)
                return
            except (OSError, TimeoutError):
                pass
        with self.lock:
            if ep.attempt == attempt and ep.state == "running" and ep.eof_at is None:
                self.finish(
                    ep,
                    "timeout",
                    error=f"episode did not read its replies for {self.cfg.send_timeout_s:.0f}s",
                )

    def reply_error(self, ep: _Ep, rid: int, kind: str, error: str) -> None:
        self.send(
            ep,
            ep.attempt,
            {"t": "reply", "rid": rid, "ok": False, "kind": kind, "error": error[:8000]},
        )

    def refuse(self, ep: _Ep, rid: int, refused: Refused) -> None:
        if ep.ledger.refuse(refused):  # a harness that ignores refusals is a runaway: stop it
            self.finish(
                ep,
                f"budget:{refused.budget}",
                error=f"kept calling after refusal: {refused.detail}",
            )
            return
        self.reply_error(ep, rid, "budget", refused.detail)

    # ---- requests from harness code ------------------------------------------------------------

    def on_chat(self, ep: _Ep, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        try:
            messages = check_messages(msg["messages"])
            left = self.budgets.assistant_tokens - ep.ledger.assistant_tokens
            settings = check_settings(msg["settings"], self.cfg.default_settings, left)
            tools = check_tools(msg.get("tools", []))
        except (TypeError, ValueError, ArithmeticError) as e:
            return self.reply_error(ep, rid, "model", f"bad request: {e}")
        try:
            session = ep.ledger.admit(messages, settings, tools)
        except Refused as r:
            return self.refuse(ep, rid, r)
        rec = ep.record
        call = ModelCallRecord(
            call_index=len(rec.calls),
            session_id=session.id,
            messages=messages,
            settings=settings.to_dict(),
            train=msg["train"],
            tools=list(tools),
        )
        rec.calls.append(call)
        rec.turns = max(rec.turns, session.turns)
        ep.waiting += 1
        request = ChatRequest(
            episode_id=f"{self.run_id}/{ep.key}",
            session_id=session.id,
            messages=tuple(messages),
            settings=settings,
            train=call.train,
            rng=RngKey(
                run_seed=self.cfg.run_seed,
                step=self.step,
                task_id=ep.task.id,
                sample_index=ep.sample,
                call_index=call.call_index,
            ),
            max_prompt_tokens=self.budgets.prompt_cap(session.continuing),
            tools=tools,
            continues=session.continuing,
        )
        self.ex._calls.submit(self.call_model, ep, ep.attempt, rid, request, call, session)

    def call_model(self, ep: _Ep, attempt: int, rid: int, request: ChatRequest,
                   call: ModelCallRecord, session: Any) -> None:  # fmt: skip
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
            rec = ep.record
            call.latency_s = ep.busy_since - t0
            call.prompt_ids = list(result.prompt_ids)
            call.completion_ids = list(result.completion_ids)
            call.prompt_tokens = result.prompt_tokens
            call.completion_tokens = result.completion_tokens
            call.finish_reason, call.error = result.finish_reason, result.error
            call.weights_version = result.weights_version
            rec.prompt_tokens += result.prompt_tokens
            rec.completion_tokens += result.completion_tokens
            ep.ledger.assistant_tokens += result.completion_tokens
            cap = request.max_prompt_tokens
            if result.finish_reason == "prompt_too_long" or result.prompt_tokens > cap:
                call.error = call.error or f"prompt over {cap} tokens"
                return self.refuse(ep, rid, Refused("prompt_tokens", call.error))
            if result.error is not None:
                return self.reply_error(ep, rid, "model", result.error)
            call.text, call.raw_text = result.text, result.raw_text
            ep.ctx.completions += [result.text, result.raw_text]
            session.prefix = [*request.messages, {"role": "assistant", "content": result.text}]
            reply = {"t": "reply", "rid": rid, "ok": True, "text": result.text,
                     "finish_reason": result.finish_reason,
                     "completion_tokens": result.completion_tokens,
                     "tool_calls": [{"name": c.name, "arguments": c.arguments}
                                    for c in result.tool_calls],
                     "remaining": ep.ledger.remaining(session)}  # fmt: skip
        self.send(ep, attempt, reply)

    def on_tool(self, ep: _Ep, msg: dict[str, Any]) -> None:
        rid, name = msg["rid"], msg["name"]
        if name not in self.domain.tool_names:
            return self.reply_error(ep, rid, "tool", f"no tool {name[:40]!r}")
        if len(ep.record.tool_calls) >= self.budgets.tool_calls:
            return self.refuse(ep, rid, Refused("tool_calls", f"{self.budgets.tool_calls} used"))
        rec = ToolCallRecord(name=name, arguments={"args": msg["args"], "kwargs": msg["kwargs"]},
                             after_call=len(ep.record.calls))  # fmt: skip
        ep.record.tool_calls.append(rec)
        ep.waiting += 1
        self.ex._tools.submit(self.call_tool, ep, ep.attempt, rid, rec)

    def call_tool(self, ep: _Ep, attempt: int, rid: int, rec: ToolCallRecord) -> None:
        t0 = time.monotonic()
        ok, value, error = True, None, None
        try:
            value = ep.env.call(rec.name, rec.arguments["args"], rec.arguments["kwargs"], ep.ctx)
            json.dumps(value, allow_nan=False)
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
            actions = self.domain.action_tools or self.domain.tool_names
            ep.record.turns = max(
                ep.record.turns, sum(t.name in actions for t in ep.record.tool_calls)
            )
            if ep.ctx.retries > self.budgets.retries:
                return self.refuse(
                    ep, rid, Refused("retries", f"{self.budgets.retries} retries used")
                )
        if ok:
            self.send(ep, attempt, {"t": "reply", "rid": rid, "ok": True, "value": value})
        else:
            self.reply_error(ep, rid, "tool", str(error))

    def on_done(self, ep: _Ep, msg: dict[str, Any]) -> None:
        ep.record.output = msg["output"][: self.cfg.limits.output_bytes]
        kind, error, answer = msg["kind"], msg["error"], msg["answer"]
        stop = _DONE_STOP.get(kind, "")
        if kind == "budget":
            stop = ep.ledger.budget_stop or "budget"
        if kind == "exception" and error and "MemoryError" in error:
            stop = "memory_limit"
        self.finish(ep, stop, error=error, answer=answer if kind == "ok" else None)

    # ---- scoring -----------------------------------------------------------------------------

    def finish(self, ep: _Ep, stop: str, *, error: str | None = None,
               answer: str | None = None) -> None:  # fmt: skip
        """Close an episode: check the answer came from the model, score it, audit the prompts."""
        if ep.state == "done":
            return
        self.detach(ep)
        rec = ep.record
        rec.error = error
        rec.wall_s = time.monotonic() - ep.started
        rec.answer = answer
        budget_stop = ep.ledger.budget_stop if ep.attempt else None
        if not stop:
            if self.domain.answer_required:
                if answer is None or not answer.strip():
                    stop = budget_stop or "no_answer"
                else:
                    rec.answer_in_completion = any(
                        answer.strip() in c.text or answer.strip() in c.raw_text
                        for c in rec.calls
                        if c.error is None
                    )
                    stop = "answered" if rec.answer_in_completion else "answer_not_in_completion"
                    if budget_stop and rec.answer_in_completion:
                        stop = budget_stop
            else:
                stop = ep.env.status or budget_stop or "no_answer"
        rec.stop_reason = stop
        t0 = time.monotonic()
        clean = error is None and stop not in _FAILURES
        if ep.attempt and clean and (rec.answer_in_completion or not self.domain.answer_required):
            try:
                rec.reward, rec.extracted = self.domain.score(ep.task, answer, ep.env)
            except Exception as e:  # a verifier bug must not pass as a reward
                rec.reward, rec.extracted = 0.0, None
                rec.error = f"verifier failed: {type(e).__name__}: {e}"
        if ep.attempt:
            audited = True
            try:
                answers = self.domain.answer_strings(ep.task, answer, rec.extracted, ep.env)
                audits.audit(rec, ep.task.question, self.domain.gold_strings(ep.task), answers)
            except Exception:
                rec.gold_in_prompt = rec.answer_from_harness = False
                audited = False  # unaudited prompts train nothing
            try:
                rec.sessions = verdicts.session_verdicts(
                    self.domain, ep.task, rec, ep.env, clean=clean and audited and rec.error is None
                )
            except Exception as e:  # a domain hook's bug: nothing of the episode is trained
                rec.sessions = verdicts.unscored(rec, f"verdicts failed: {type(e).__name__}: {e}")
        rec.score_s = time.monotonic() - t0
        ep.state = "done"
        self.remaining -= 1

    def fail_all(self, stop: str, error: str) -> None:
        """The candidate itself failed (static check, load): every episode carries the reason."""
        with self.lock:
            self.pending.clear()
            for ep in self.eps:
                if ep.state != "done":
                    self.finish(ep, stop, error=error)
