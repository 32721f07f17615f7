"""HF safetensors in and out: layouts, round trips, and errors that name the key and the file."""

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.conftest import assert_close_to_scale
from whale_jax import ModelConfig, load_model, source_of
from whale_jax.io.safetensors import CheckpointError, save_hf


def read_tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture
def qwen_dir(fixtures_dir, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(fixtures_dir / "tiny_qwen3_5", out)
    return out


def rewrite(directory, transform):
    """Rewrites a checkpoint's single safetensors file through ``transform(dict) -> dict``."""
    path = directory / "model.safetensors"
    save_file(transform(load_file(path)), path)


@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_llama", "tiny_qwen3"])
def test_load_save_reload_round_trip_is_exact(fixtures_dir, tmp_path, name):
    model, _, _ = load_model(fixtures_dir / name)
    src = source_of(model)
    save_hf(model, tmp_path / "out", src.hf_config, prefix=src.prefix)
    original, saved = read_tensors(fixtures_dir / name), read_tensors(tmp_path / "out")
    assert saved.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(saved[key], original[key], err_msg=key)
    again, _, _ = load_model(tmp_path / "out")
    for a, b in zip(
        model.blocks.b0.mlp.up_proj[...], again.blocks.b0.mlp.up_proj[...], strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_conditional_generation_layout_loads_and_saves_whole(qwen_dir, tmp_path):
    """Qwen3.5 release layout: nested text_config, model.language_model.* keys, plus vision and
    MTP tensors that the text model skips on load and copies through on save."""
    text_config = json.loads((qwen_dir / "config.json").read_text())
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"depth": 1},
    }
    (qwen_dir / "config.json").write_text(json.dumps(config))
    extra = {
        "model.visual.patch_embed.proj.weight": np.ones((4, 3), np.float32),
        "mtp.fc.weight": np.full((2, 2), 3.0, np.float32),
    }

    def relayout(tensors):
        out = {
            ("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[6:]): v
            for k, v in tensors.items()
        }
        return {**out, **extra}

    rewrite(qwen_dir, relayout)
    model, cfg, _ = load_model(qwen_dir)
    assert cfg.family == "qwen3_5" and source_of(model).prefix == "model.language_model."
    src = source_of(model)
    save_hf(model, tmp_path / "out", src.hf_config, prefix=src.prefix, source_dir=qwen_dir)
    assert read_tensors(tmp_path / "out").keys() == read_tensors(qwen_dir).keys()
    np.testing.assert_array_equal(
        read_tensors(tmp_path / "out")["mtp.fc.weight"], extra["mtp.fc.weight"]
    )


def test_bare_keys_load(qwen_dir, fixtures_dir):
    rewrite(qwen_dir, lambda t: {k.removeprefix("model."): v for k, v in t.items()})
    model, _, _ = load_model(qwen_dir)
    ref = np.load(fixtures_dir / "tiny_qwen3_5" / "reference.npz")
    logits = model(jnp.asarray(ref["input_ids"][:, :8]))
    # Against transformers' logits, as in test_parity.py: 1e-4 of their scale (measured 1.2e-6).
    assert_close_to_scale(logits, ref["logits"][:, :8], 1e-4)


def test_missing_key_is_named(qwen_dir):
    rewrite(qwen_dir, lambda t: {k: v for k, v in t.items() if "layers.2.mlp.up_proj" not in k})
    with pytest.raises(
        CheckpointError, match=r"missing key 'model\.layers\.2\.mlp\.up_proj\.weight'"
    ):
        load_model(qwen_dir)


def test_unexpected_key_is_named_with_its_file(qwen_dir):
    rewrite(
        qwen_dir, lambda t: {**t, "model.layers.9.mlp.up_proj.weight": np.zeros((1,), np.float32)}
    )
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: unexpected key 'model\.layers\.9"
    ):
        load_model(qwen_dir)


def test_shape_mismatch_is_named_with_its_file(qwen_dir):
    def shrink(t):
        t["model.layers.1.self_attn.o_proj.weight"] = t["model.layers.1.self_attn.o_proj.weight"][
            :, :-1
        ]
        return t

    rewrite(qwen_dir, shrink)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: key 'model\.layers\.1\.self_attn\.o_proj\.weight' has shape \(64, 63\)",
    ):
        load_model(qwen_dir)


def test_config_missing_key_is_named(qwen_dir):
    config = json.loads((qwen_dir / "config.json").read_text())
    del config["linear_num_value_heads"]
    (qwen_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config\.json: missing required key 'linear_num_value_heads'"
    ):
        load_model(qwen_dir)


def test_corrupt_safetensors_is_named(qwen_dir):
    (qwen_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: cannot read safetensors header"
    ):
        load_model(qwen_dir)


def test_sharded_bf16_save_keeps_decay_and_norms_fp32(fixtures_dir, tmp_path):
    model, _, _ = load_model(fixtures_dir / "tiny_qwen3_5")
    src = source_of(model)
    out = save_hf(
        model, tmp_path / "out", src.hf_config, dtype=ml_dtypes.bfloat16, shard_bytes=100_000
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tensors = read_tensors(out)
    assert tensors["model.layers.0.linear_attn.A_log"].dtype == np.float32
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == np.float32
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == ml_dtypes.bfloat16
    again, _, _ = load_model(out, dtype=jnp.bfloat16)
    assert again.blocks.b0.gdn.A_log[...].dtype == jnp.float32
    assert again.blocks.b0.gdn.in_proj_qkv[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(again.blocks.b0.mlp.up_proj[...], np.float32),
        np.asarray(model.blocks.b0.mlp.up_proj[...]).astype(ml_dtypes.bfloat16).astype(np.float32),
    )


def test_config_reads_release_style_qwen3_5(fixtures_dir):
    text = json.loads((fixtures_dir / "tiny_qwen3_5" / "config.json").read_text())
    del text["layer_types"]
    text["full_attention_interval"] = 2
    cfg = ModelConfig.from_hf(
        {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    )
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.rope.rotary_dim == 4 and cfg.period == 2 and cfg.tie_word_embeddings
