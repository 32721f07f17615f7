"""Hugging Face weights in and out.

In: safetensors (one file or a sharded index) with keys under ``model.language_model.`` (Qwen3.5
conditional-generation checkpoints), ``model.`` (causal LMs) or bare; ``model.visual.*`` and
``mtp.*`` are skipped; mixed bf16/fp32 tensors. Tensors stream one model parameter at a time (its
layers stacked on the host, then placed on the mesh), so host memory peaks at one stacked
parameter, not the checkpoint. Missing keys, unexpected keys and shape mismatches are errors that
name the key and the file.

Out: ``save_hf`` writes config.json + safetensors in the same layout, so transformers or any
HF-compatible server loads a trained model; skipped tensors (vision tower, MTP head) are copied
through from the source checkpoint so the result is complete.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from whale_jax.models.config import FULL, ModelConfig
from whale_jax.models.transformer import Transformer
from whale_jax.sharding import param_sharding

SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
TEXT_PREFIXES = ("model.language_model.", "model.", "")
# Kept in fp32 whatever the checkpoint or compute dtype: decay parameters and norm weights.
FP32_PARAMS = re.compile(r"(A_log|dt_bias|norm\.weight)$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the key and the file at fault."""


# -- sources ----------------------------------------------------------------------------------
@dataclasses.dataclass
class TensorSource:
    """Named tensors with the file each came from; ``load`` reads one on demand."""

    shapes: dict[str, tuple[int, ...]]
    files: dict[str, str]
    load: Callable[[str], np.ndarray]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> file


def safetensors_source(directory: str | Path) -> TensorSource:
    """Indexes the safetensors files of a checkpoint directory without reading tensor data."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files and no index")
    shapes, where, skipped = {}, {}, {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise CheckpointError(f"{index}: lists {name}, which does not exist")
        try:
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():
                    if key.startswith(SKIPPED_PREFIXES):
                        skipped[key] = str(path)
                        continue
                    if key in where:
                        raise CheckpointError(f"{path}: key {key!r} also in {where[key]}")
                    shapes[key] = tuple(f.get_slice(key).get_shape())
                    where[key] = str(path)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: cannot read safetensors header ({e})") from e

    def load(key: str) -> np.ndarray:
        with safe_open(where[key], framework="numpy") as f:
            return f.get_tensor(key)

    return TensorSource(shapes, where, load, skipped)


def arrays_source(tensors: dict[str, np.ndarray], origin: str) -> TensorSource:
    """In-memory tensors (e.g. dequantised GGUF) keyed by HF names."""
    return TensorSource(
        {k: tuple(v.shape) for k, v in tensors.items()},
        {k: origin for k in tensors},
        lambda key: tensors[key],
    )


# -- the mapping ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mapping:
    """One model parameter and the HF tensors (one per stacked layer) that fill it."""

    path: tuple[str, ...]  # attribute path in the model
    hf_keys: tuple[str, ...]  # without prefix; several when stacked over layer groups
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    stacked: bool


def _t(x):
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _same(x):
    return x


def mappings(cfg: ModelConfig) -> list[Mapping]:
    """The full HF <-> model correspondence for ``cfg`` (HF keys without prefix)."""
    d, p, G = cfg.hidden_size, cfg.period, cfg.num_groups
    H, N, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = [Mapping(("embed",), ("embed_tokens.weight",), _same, _same, False)]
    out.append(Mapping(("final_norm", "weight"), ("norm.weight",), _same, _same, False))
    if not cfg.tie_word_embeddings:
        out.append(Mapping(("lm_head",), ("lm_head.weight",), _t, _t, False))
    qx = 2 * K if cfg.attn_output_gate else K
    for i, kind in enumerate(cfg.layer_types[:p]):
        layers = [i + g * p for g in range(G)]

        def add(path, hf_name, to_model, to_hf, layers=layers, i=i):
            keys = tuple(f"layers.{n}.{hf_name}" for n in layers)
            out.append(Mapping(("blocks", f"b{i}", *path), keys, to_model, to_hf, True))

        add(("input_norm", "weight"), "input_layernorm.weight", _same, _same)
        add(("post_norm", "weight"), "post_attention_layernorm.weight", _same, _same)
        for name in ("gate_proj", "up_proj", "down_proj"):
            add(("mlp", name), f"mlp.{name}.weight", _t, _t)
        if kind == FULL:
            a = "self_attn"
            add(
                ("attn", "q_proj"),
                f"{a}.q_proj.weight",
                lambda w, qx=qx: _t(w).reshape(d, H, qx),
                lambda w: _t(w.reshape(d, -1)),
            )
            for name in ("k_proj", "v_proj"):
                add(
                    ("attn", name),
                    f"{a}.{name}.weight",
                    lambda w: _t(w).reshape(d, N, K),
                    lambda w: _t(w.reshape(d, -1)),
                )
            add(
                ("attn", "o_proj"),
                f"{a}.o_proj.weight",
                lambda w: _t(w).reshape(H, K, d),
                lambda w: _t(w.reshape(H * K, d)),
            )
            if cfg.attention_bias:
                add(
                    ("attn", "q_bias"),
                    f"{a}.q_proj.bias",
                    lambda b, qx=qx: b.reshape(H, qx),
                    lambda b: b.reshape(-1),
                )
                for name in ("k", "v"):
                    add(
                        ("attn", f"{name}_bias"),
                        f"{a}.{name}_proj.bias",
                        lambda b: b.reshape(N, K),
                        lambda b: b.reshape(-1),
                    )
            if cfg.qk_norm:
                add(("attn", "q_norm", "weight"), f"{a}.q_norm.weight", _same, _same)
                add(("attn", "k_norm", "weight"), f"{a}.k_norm.weight", _same, _same)
        else:
            a = "linear_attn"
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                add(("gdn", name), f"{a}.{name}.weight", _t, _t)
            add(
                ("gdn", "conv"),
                f"{a}.conv1d.weight",
                lambda w: np.ascontiguousarray(w[:, 0, :].T),
                lambda w: np.ascontiguousarray(w.T[:, None, :]),
            )
            add(("gdn", "dt_bias"), f"{a}.dt_bias", _same, _same)
            add(("gdn", "A_log"), f"{a}.A_log", _same, _same)
            add(("gdn", "norm", "weight"), f"{a}.norm.weight", _same, _same)
    return out


def full_key(prefix: str, key: str) -> str:
    """The checkpoint key of a mapped tensor: the LM head sits outside the text-model prefix."""
    return key if key == "lm_head.weight" else prefix + key


def _detect_prefix(source: TensorSource, origin: str) -> str:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in source.shapes:
            return prefix
    raise CheckpointError(
        f"{origin}: no embedding tensor found (looked for "
        + ", ".join(f"{p}embed_tokens.weight" for p in TEXT_PREFIXES)
        + ")"
    )


def _variable(model: nnx.Module, path: tuple[str, ...]) -> nnx.Variable:
    node = model
    for name in path:
        node = getattr(node, name)
    return node


# -- loading ----------------------------------------------------------------------------------
def load_into(model: Transformer, source: TensorSource, origin: str, mesh=None) -> str:
    """Fills every parameter of ``model`` (possibly abstract, from ``nnx.eval_shape``) from
    ``source``; returns the key prefix found. Raises CheckpointError naming key and file."""
    cfg = model.cfg
    prefix = _detect_prefix(source, origin)
    plan = mappings(cfg)
    expected = {full_key(prefix, k) for m in plan for k in m.hf_keys}
    present = set(source.shapes)
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(
            f"{origin}: missing key {missing[0]!r}"
            + (f" (and {len(missing) - 1} more: {missing[1:4]}...)" if len(missing) > 1 else "")
        )
    unexpected = sorted(present - expected)
    if cfg.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some tied checkpoints store the copy anyway
    if unexpected:
        key = unexpected[0]
        raise CheckpointError(
            f"{source.files[key]}: unexpected key {key!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    for m in plan:
        var = _variable(model, m.path)
        target = var.get_value()
        shape, dtype = tuple(target.shape), target.dtype
        per_layer = shape[1:] if m.stacked else shape
        host = np.empty(shape, dtype=np.dtype(dtype)) if m.stacked else None
        for g, key in enumerate(m.hf_keys):
            name = full_key(prefix, key)
            tensor = source.load(name)
            try:
                value = m.to_model(np.asarray(tensor))
            except ValueError as e:
                raise CheckpointError(
                    f"{source.files[name]}: key {name!r} has shape {tuple(tensor.shape)}, "
                    f"which does not fit the model parameter of shape {per_layer} ({e})"
                ) from e
            if tuple(value.shape) != per_layer:
                raise CheckpointError(
                    f"{source.files[name]}: key {name!r} has shape {tuple(tensor.shape)}; "
                    f"the config implies {tuple(m.to_hf(np.zeros(per_layer, np.float32)).shape)}"
                )
            value = value.astype(np.dtype(dtype))
            if m.stacked:
                host[g] = value
            else:
                host = value
        if mesh is not None:
            array = jax.device_put(host, param_sharding(var, mesh))
        else:
            array = jnp.asarray(host)
        var.set_value(array)
    return prefix


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> Transformer:
    """A model with shapes and metadata but no allocated parameters (nnx.eval_shape)."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


# -- saving -----------------------------------------------------------------------------------
def hf_tensors(
    model: Transformer, prefix: str = "model.", dtype=None
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF key, host array) for every parameter; ``dtype`` casts matrices (fp32 params stay)."""
    for m in mappings(model.cfg):
        value = np.asarray(jax.device_get(_variable(model, m.path).get_value()))
        if dtype is not None and not FP32_PARAMS.search(m.hf_keys[0]):
            value = value.astype(np.dtype(dtype))
        layers = value if m.stacked else [value]
        for key, layer in zip(m.hf_keys, layers, strict=True):
            yield full_key(prefix, key), np.ascontiguousarray(m.to_hf(np.asarray(layer)))


def save_hf(
    model: Transformer,
    out_dir: str | Path,
    hf_config: dict,
    *,
    prefix: str = "model.",
    source_dir: str | Path | None = None,
    dtype=None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Writes ``out_dir``/config.json and safetensors (sharded with an index past ``shard_bytes``).
    Tensors skipped at load (vision tower, MTP head) are copied from ``source_dir`` if given."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0

    def add(key, value):
        nonlocal size
        if size and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes

    for key, value in hf_tensors(model, prefix, dtype):
        add(key, value)
    if source_dir is not None and Path(source_dir).is_dir():
        for key, path in safetensors_source(source_dir).skipped.items():
            with safe_open(path, framework="numpy") as f:
                add(key, f.get_tensor(key))
    config = dict(hf_config)
    if dtype is not None:
        config["torch_dtype"] = {np.dtype(ml_dtypes.bfloat16): "bfloat16"}.get(
            np.dtype(dtype), np.dtype(dtype).name
        )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out_dir / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.nbytes for s in shards for v in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir
