"""Session verdicts: which conversations of an episode the verifier scored, and how.

RSFT trains a token only when the verifier scored the conversation it belongs to above the
threshold. In the reference a rollout is one conversation and its reward comes from its own last
assistant message; a harness here may hold several conversations per episode (votes, fresh
retries, checks), so each one that has trained (``train=True``) completions gets its own verdict
(``harness.records.SessionVerdict``), decided here in the trusted process:

- the sessions the domain credits with the episode's outcome take the episode's reward: by default
  the session of the latest completion that carries the submitted answer (``ANSWER``); chess
  credits the sessions whose moves were played (``PLAYED``);
- every other session is scored by the domain on its own last trained completion (``VERIFIED``),
  or, where the domain cannot score one alone, is not trained (``UNSCORED``);
- a credited session that the domain can also score alone takes the lower of the two, its own
  score read from where the submitted answer starts in its last trained completion: an answer a
  harness cut out of a wrong completion ("42" out of "420") never trains that completion, and one
  it took from the end of a right one ("Answer: 42") does;
- an episode the prompt audit flagged (gold or the submitted answer written into a prompt by the
  harness) trains nothing (``FLAGGED``), and neither does one that ended by a failure (a crash, a
  timeout, an answer not found in any completion, an audit or a hook that failed): its sessions
  are ``UNSCORED``.
"""

from __future__ import annotations

from typing import Any

from harness.records import (
    ANSWER,
    FLAGGED,
    PLAYED,
    UNSCORED,
    VERIFIED,
    EpisodeRecord,
    ModelCallRecord,
    SessionVerdict,
)


def last_trained_calls(record: EpisodeRecord) -> dict[str, ModelCallRecord]:
    """Per session with trained tokens (in the order the sessions started): its last
    ``train=True`` call that has completion ids; that completion is what its verdict reads."""
    last: dict[str, ModelCallRecord] = {}
    for call in sorted(record.calls, key=lambda c: c.call_index):
        if call.train and call.completion_ids:
            last[call.session_id] = call
    return last


def source_call(
    record: EpisodeRecord, text: str, before: int | None = None
) -> ModelCallRecord | None:
    """The latest completion (call index below ``before``) that contains ``text`` verbatim."""
    text = text.strip()
    if not text:
        return None
    for call in sorted(record.calls, key=lambda c: c.call_index, reverse=True):
        if before is not None and call.call_index >= before:
            continue
        if call.error is None and (text in call.text or text in call.raw_text):
            return call
    return None


def answer_sessions(record: EpisodeRecord) -> set[str]:
    """The session whose completion carries the submitted answer (none when no completion does)."""
    if record.answer is None or not record.answer_in_completion:
        return set()
    call = source_call(record, record.answer)
    return {call.session_id} if call is not None else set()


def tail(text: str, answer: str) -> str:
    """What a credited completion is scored on: from the last place the submitted answer starts
    (a harness may cut the answer out of the reply: "Answer: 42" -> "42"; "42" cut out of "420"
    then reads "420"), or the whole text when the answer is not in it."""
    at = text.rfind(answer) if answer else -1
    return text[at:] if at >= 0 else text


def unscored(record: EpisodeRecord, why: str) -> list[SessionVerdict]:
    """Every session with trained completions, not scored (so not trained), for ``why``."""
    return [SessionVerdict(session_id=s, reward=None, origin=UNSCORED, detail=why[:300])
            for s in last_trained_calls(record)]  # fmt: skip


def session_verdicts(
    domain: Any, task: Any, record: EpisodeRecord, env: Any, *, clean: bool
) -> list[SessionVerdict]:
    """One verdict per session with trained completions (see the module docstring). ``clean``:
    the episode ended without a failure (its reward was scored)."""
    last = last_trained_calls(record)
    if not last:
        return []
    if not clean:
        return unscored(record, f"the episode ended by {record.stop_reason or 'an error'}")
    if record.gold_in_prompt or record.answer_from_harness:
        why = "the prompt audit flagged the episode (harness-written gold or answer)"
        return [SessionVerdict(session_id=s, reward=None, origin=FLAGGED, detail=why) for s in last]
    credited = domain.credited_sessions(task, record, env)
    kind = ANSWER if domain.answer_required else PLAYED
    out = []
    answer = (record.answer or "").strip()
    for sid, call in last.items():
        try:
            text = tail(call.text, answer if sid in credited else "")
            if sid in credited and answer and text.strip() == answer:
                own = record.reward  # the very text the episode was scored on (no second judge)
            else:
                own = domain.score_completion(task, text)
        except Exception as e:  # a verifier bug must not pass as a verdict
            out.append(SessionVerdict(session_id=sid, reward=None, origin=UNSCORED,
                                      detail=f"verifier failed: {type(e).__name__}: {e}"[:300]))  # fmt: skip
            continue
        if sid in credited:
            if own is not None and own < record.reward:
                detail = f"the episode scored {record.reward:g}, its own last completion {own:g}"
                out.append(SessionVerdict(session_id=sid, reward=own, origin=kind, detail=detail))
            else:
                out.append(SessionVerdict(session_id=sid, reward=record.reward, origin=kind))
        elif own is not None:
            out.append(SessionVerdict(session_id=sid, reward=own, origin=VERIFIED))
        else:
            out.append(SessionVerdict(session_id=sid, reward=None, origin=UNSCORED,
                                      detail=f"{domain.name} cannot score a conversation alone"))  # fmt: skip
    return out
