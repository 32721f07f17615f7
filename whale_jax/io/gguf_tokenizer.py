"""Build a Hugging Face fast tokenizer from a GGUF file's tokenizer metadata (no torch).

A GGUF file carries no ``tokenizer.json``; llama.cpp stores the tokenizer as metadata instead:

* ``tokenizer.ggml.model``: the algorithm; only ``"gpt2"`` (byte-level BPE) is supported here,
* ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges``: the vocabulary (already spelled in the
  GPT-2 byte-to-unicode alphabet, ``"Ġthe"``) and the merge list (``"Ġ t"``), best first,
* ``tokenizer.ggml.token_type``: per token, 1 normal, 3 control (``<|im_start|>``...), 4
  user-defined, ...,
* ``tokenizer.ggml.pre``: which pre-tokenizer (text splitting regex) the vocabulary was learnt with,
* the bos/eos/unk/padding ids, ``add_bos_token`` / ``add_eos_token`` and ``chat_template``.

:func:`build_backend_tokenizer` turns that into a :class:`tokenizers.Tokenizer`;
:func:`tokenizer_from_gguf` wraps it in a :class:`transformers.PreTrainedTokenizerFast` with the
special tokens and the chat template set, so ``encode``/``decode``/``apply_chat_template`` work.

Pre-tokenization. By default the result reproduces ``transformers``' own GGUF tokenizer
(``AutoTokenizer.from_pretrained(folder, gguf_file=...)``) id for id. For ``pre == "smollm"`` that
is the plain GPT-2 byte-level split, whereas llama.cpp (and SmolLM2's original ``tokenizer.json``)
first split every digit off on its own. The two only disagree where a run of two or more
whitespace characters precedes a digit (``"a  1"``: transformers ``a|Ġ|Ġ|1``, llama.cpp
``a|ĠĠ|1``), because the vocabulary has no merge involving a digit. Pass
``pretokenizer="llama.cpp"`` for llama.cpp's behaviour.
"""

from __future__ import annotations

import pathlib
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from whale_jax.io.gguf import GGUFCheckpoint

__all__ = [
    "PRE_TOKENIZER_SPLITS",
    "build_backend_tokenizer",
    "gpt2_bytes_to_unicode",
    "tokenizer_from_gguf",
]

PretokenizerMode = Literal["transformers", "llama.cpp"]

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for the `tokenizer.ggml.pre` values whose split is not GPT-2's. Each is followed by
# a byte-level mapping without its own regex.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
# `pre` values whose vocabulary uses GPT-2's own split (the byte-level pre-tokenizer's built-in
# regex). "smollm" additionally isolates digits in llama.cpp (see the module docstring).
_GPT2_SPLIT_PRES = frozenset({"default", "gpt2", "gpt-2", "smollm"})
_DIGIT_SPLIT_PRES = frozenset({"smollm"})


@lru_cache(maxsize=1)
def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    The 188 bytes that are printable and not whitespace (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``)
    map to themselves; the other 68 map, in byte order, to ``chr(256)``, ``chr(257)``, ...
    (so the space, byte 32, becomes ``"Ġ"`` = ``chr(288)``).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _metadata_of(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    metadata = getattr(source, "metadata", None)
    if isinstance(metadata, dict):
        return metadata
    if isinstance(source, (str, pathlib.Path)):
        from whale_jax.io.gguf import read_gguf_metadata

        return read_gguf_metadata(source)
    raise TypeError(
        "expected a GGUFCheckpoint, a GGUF metadata dict or a path to a .gguf file, "
        f"got {type(source).__name__}"
    )


def _source_name(source: Any) -> str:
    if isinstance(source, (str, pathlib.Path)):
        return str(source)
    path = getattr(source, "path", None)
    return str(path) if path is not None else "<GGUF metadata>"


def _require(metadata: dict[str, Any], key: str, where: str) -> Any:
    if key not in metadata:
        raise ValueError(f"{where}: missing tokenizer metadata key {key!r}")
    return metadata[key]


def _pre_tokenizer(pre: str, mode: PretokenizerMode, where: str) -> pre_tokenizers.PreTokenizer:
    if pre in PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_SPLIT_PRES:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if mode == "llama.cpp" and pre in _DIGIT_SPLIT_PRES:
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        return byte_level
    raise ValueError(
        f"{where}: unsupported pre-tokenizer {pre!r} (key 'tokenizer.ggml.pre'); supported: "
        f"{sorted(_GPT2_SPLIT_PRES | set(PRE_TOKENIZER_SPLITS))}"
    )


def build_backend_tokenizer(
    checkpoint_or_path: Any, *, pretokenizer: PretokenizerMode = "transformers"
) -> Tokenizer:
    """A :class:`tokenizers.Tokenizer` (byte-level BPE) from GGUF tokenizer metadata.

    Args:
        checkpoint_or_path: a :class:`~whale_jax.io.gguf.GGUFCheckpoint`, its ``metadata`` dict,
            or a path to a ``.gguf`` file (only the metadata is read).
        pretokenizer: ``"transformers"`` (default) to match transformers' GGUF tokenizer,
            ``"llama.cpp"`` to match llama.cpp where they differ (see the module docstring).

    Control tokens become special added tokens; user-defined ones plain added tokens. No
    post-processor is set (no BOS/EOS is added); :func:`tokenizer_from_gguf` sets that.

    Raises:
        ValueError: not a ``gpt2`` BPE tokenizer, an unsupported ``tokenizer.ggml.pre``, or
            missing keys; the message names the file and the key.
    """
    if pretokenizer not in ("transformers", "llama.cpp"):
        raise ValueError(
            f"pretokenizer must be 'transformers' or 'llama.cpp', not {pretokenizer!r}"
        )
    metadata = _metadata_of(checkpoint_or_path)
    where = _source_name(checkpoint_or_path)
    kind = _require(metadata, "tokenizer.ggml.model", where)
    if kind != "gpt2":
        raise ValueError(
            f"{where}: unsupported tokenizer model {kind!r} (key 'tokenizer.ggml.model'); "
            "only 'gpt2' (byte-level BPE) is supported"
        )
    tokens: list[str] = _require(metadata, "tokenizer.ggml.tokens", where)
    merges_raw: list[str] = _require(metadata, "tokenizer.ggml.merges", where)
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"{where}: 'tokenizer.ggml.token_type' has {len(token_types)} entries for "
            f"{len(tokens)} tokens"
        )

    # Tokens are stored in the byte alphabet already; the odd one that is not gets re-spelt.
    spelling = gpt2_bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(spelled(token), index)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ValueError(f"{where}: malformed merge {merge!r} in 'tokenizer.ggml.merges'")
        merges.append((left, right))

    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(
        str(metadata.get("tokenizer.ggml.pre", "default")), pretokenizer, where
    )
    backend.decoder = decoders.ByteLevel()

    # Control tokens spelt outside the byte alphabet would be llama.cpp labelling mistakes that
    # cannot be real vocabulary entries; they are left out rather than added as new ids.
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind_ in zip(tokens, token_types, strict=True)
        if kind_ == _TOKEN_TYPE_CONTROL and set(token) <= alphabet
    ]
    if special:
        backend.add_special_tokens(special)
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind_ in zip(tokens, token_types, strict=True)
        if kind_ == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


def tokenizer_from_gguf(
    checkpoint_or_path: GGUFCheckpoint | dict[str, Any] | str | pathlib.Path,
    *,
    pretokenizer: PretokenizerMode = "transformers",
) -> PreTrainedTokenizerFast:
    """A :class:`transformers.PreTrainedTokenizerFast` built from a GGUF file's metadata.

    Special tokens (bos/eos/unk/pad) come from the ``tokenizer.ggml.*_token_id`` keys, whether a
    BOS/EOS is added when encoding from ``tokenizer.ggml.add_bos_token``/``add_eos_token``
    (default: no), and the chat template from ``tokenizer.chat_template``. See
    :func:`build_backend_tokenizer` for the arguments and errors.
    """
    from transformers import PreTrainedTokenizerFast

    metadata = _metadata_of(checkpoint_or_path)
    backend = build_backend_tokenizer(metadata, pretokenizer=pretokenizer)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    where = _source_name(checkpoint_or_path)

    def token_for(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{where}: 'tokenizer.ggml.{key}' = {index} is outside the vocabulary")
        return tokens[int(index)]

    template = metadata.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token_for("bos_token_id"),
        eos_token=token_for("eos_token_id"),
        unk_token=token_for("unknown_token_id"),
        pad_token=token_for("padding_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
        clean_up_tokenization_spaces=False,
    )
