"""An LLM judge for short answers (searchqa's optional verifier, as the reference's).

``LLMJudge.judge(question, golds, predicted)`` asks a chat model, at temperature 0, whether the
predicted answer means one of the reference answers, and reads a yes or a no. A request that fails
is tried 3 times in all; when every try fails, or the reply is neither yes nor no, the result is
None and the caller falls back to exact match. Calls, tokens and failures are counted (the run's
costs). Two wire formats: any OpenAI-compatible chat-completions endpoint and Gemini
(google-genai). The API key comes from the environment, never from flags or files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from harness.endpoints import GEMINI_BASE_URL, KEY_ENVS, OPENAI_BASE_URL, api_key_from_env

JUDGES = ("openai", "gemini")
ATTEMPTS = 3
PROMPT = (
    "You grade a short answer to a factual question against reference answers.\n"
    "Question: {question}\nReference answers: {golds}\nProposed answer: {predicted}\n"
    "Does the proposed answer mean the same as one of the reference answers? "
    "Reply with only yes or no."
)


class LLMJudge:
    """``kind``: openai | gemini; ``model``: the model name; ``base_url``: the endpoint (None: the
    provider's); ``api_key_env``: the variable holding the key (a loopback endpoint needs none)."""

    def __init__(
        self,
        kind: str,
        model: str,
        *,
        base_url: str | None = None,
        api_key_env: str = "",
        timeout_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if kind not in JUDGES:
            raise ValueError(f"judge {kind!r}: expected one of {', '.join(JUDGES)}")
        if not model:
            raise ValueError("the judge needs a model name")
        self.kind, self.model, self.sleep = kind, model, sleep
        self.name = f"{kind}:{model}"
        self._lock = threading.Lock()
        self.calls = self.tokens = self.failures = 0
        if kind == "openai":
            import openai

            url = base_url or OPENAI_BASE_URL
            key = api_key_from_env(api_key_env or KEY_ENVS["openai"], url, self.name)
            client = openai.OpenAI(api_key=key, base_url=url, timeout=timeout_s, max_retries=0)

            def ask(prompt: str) -> tuple[str, int]:
                r = client.chat.completions.create(
                    model=model, temperature=0.0, max_tokens=8,
                    messages=[{"role": "user", "content": prompt}],
                )  # fmt: skip
                used = (r.usage.prompt_tokens + r.usage.completion_tokens) if r.usage else 0
                return r.choices[0].message.content or "", used
        else:
            from google import genai
            from google.genai import types

            url = base_url or GEMINI_BASE_URL
            key = api_key_from_env(api_key_env or KEY_ENVS["gemini"], url, self.name)
            client = genai.Client(
                vertexai=False, api_key=key,
                http_options=types.HttpOptions(base_url=url, timeout=int(timeout_s * 1000)),
            )  # fmt: skip
            config = types.GenerateContentConfig(temperature=0.0)

            def ask(prompt: str) -> tuple[str, int]:
                r = client.models.generate_content(model=model, contents=prompt, config=config)
                usage = r.usage_metadata
                return r.text or "", (usage.total_token_count or 0) if usage else 0

        self._ask = ask

    def judge(self, question: str, golds: Sequence[str], predicted: str) -> bool | None:
        """True or False as the model says; None when it could not say (fall back)."""
        prompt = PROMPT.format(question=question, golds="; ".join(golds), predicted=predicted)
        for attempt in range(ATTEMPTS):
            try:
                text, used = self._ask(prompt)
            except Exception:  # any transport or API error: try again, then give up
                with self._lock:
                    self.calls += 1
                    self.failures += 1
                if attempt + 1 < ATTEMPTS:
                    self.sleep(2.0**attempt)
                continue
            with self._lock:
                self.calls += 1
                self.tokens += used
            word = text.strip().lower().lstrip("*\"' ")
            if word.startswith("yes"):
                return True
            if word.startswith("no"):
                return False
            return None
        return None

    def __repr__(self) -> str:
        return f"LLMJudge({self.name!r})"
