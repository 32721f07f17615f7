"""Parity oracle: tiny random Hugging Face checkpoints and their reference logits.

This module is the *independent* side of the JAX parity tests. It builds tiny models with
transformers' own PyTorch implementations (``Qwen3_5ForCausalLM``, ``LlamaForCausalLM``,
``Qwen3ForCausalLM``), overwrites every parameter with seeded random values, runs a float32
eager forward pass and records the logits. Nothing here imports ``whale_jax``.

Importing this module has no side effects and does not need torch: torch, transformers and
safetensors are imported inside the functions that use them.

Public API (used by the tests)::

    build(name)            -> {"config", "state_dict", "input_ids", "attention_mask", "logits", ...}
    write(name, out_dir)   -> writes config.json, model.safetensors, reference*.npz
    verify(name, out_dir)  -> reloads with AutoModelForCausalLM and checks the logits bit-exactly
    main()                 -> CLI: python tests/oracle/make_fixtures.py [--out DIR] [--only NAME]

Regenerating is deterministic: running the script twice gives byte-identical files (the npz
archives are written with a fixed zip timestamp, and torch runs single-threaded while building).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "fixtures"

# Each fixture: the config class and kwargs, the model class, the seed and the inputs.
# `pad_left` (optional) adds a second reference, reference_padded.npz, where row 1 is
# left-padded by that many positions.
FIXTURES: dict[str, dict] = {
    "tiny_qwen3_5": {
        "config_cls": "Qwen3_5TextConfig",
        "model_cls": "Qwen3_5ForCausalLM",
        "seed": 3505,
        "batch": 2,
        "seq_len": 80,  # > 64, the chunk size of the chunked gated delta rule
        "pad_left": 7,
        "zero_centered_norms": True,  # Qwen3.5 RMSNorm computes x_hat * (1 + w)
        "config": {
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "layer_types": [
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
    },
    "tiny_llama": {
        "config_cls": "LlamaConfig",
        "model_cls": "LlamaForCausalLM",
        "seed": 1103,
        "batch": 2,
        "seq_len": 80,
        "zero_centered_norms": False,
        "config": {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
    },
    "tiny_qwen3": {
        "config_cls": "Qwen3Config",
        "model_cls": "Qwen3ForCausalLM",
        "seed": 3003,
        "batch": 2,
        "seq_len": 48,
        "zero_centered_norms": False,
        "config": {
            "vocab_size": 384,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # num_heads * head_dim = 128 != hidden_size, as in real Qwen3
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        },
    },
}

NAMES = tuple(FIXTURES)

# Kernel packages that would replace transformers' pure-torch GDN / conv paths.
_KERNEL_PACKAGES = ("fla", "causal_conv1d")


# --------------------------------------------------------------------------------------------
# helpers


def _versions() -> np.ndarray:
    import safetensors
    import torch
    import transformers

    return np.array(
        [
            f"transformers={transformers.__version__}",
            f"torch={torch.__version__}",
            f"safetensors={safetensors.__version__}",
            f"numpy={np.__version__}",
        ]
    )


def _check_torch_paths() -> None:
    present = [p for p in _KERNEL_PACKAGES if importlib.util.find_spec(p) is not None]
    if present:
        raise RuntimeError(
            f"kernel packages {present} are installed; the oracle must use transformers' "
            "pure-torch paths (chunked gated delta rule, F.conv1d). Use an environment "
            "without them."
        )


@contextlib.contextmanager
def _single_thread():
    """Run torch single-threaded (reproducible reductions, light on shared CPUs), then restore."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _param_generator(seed: int, name: str):
    import torch

    g = torch.Generator()
    # One stream per parameter, keyed on its name: independent of module registration order
    # and of how many draws transformers' own initialisation made.
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _random_value(name: str, shape, spec: dict, gen):
    """The value for one parameter, chosen by its role."""
    import math

    import torch

    def randn(std=1.0, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        # A = exp(A_log) log-uniform on [0.05, 16]: slow-decay heads carry the recurrent state
        # across the chunk boundary at t = 64, fast ones forget it.
        u = torch.rand(shape, generator=gen, dtype=torch.float32)
        return u * (math.log(16.0) - math.log(0.05)) + math.log(0.05)
    if leaf == "dt_bias":
        return randn()
    if "conv1d" in name:
        return randn(0.3)
    if name.endswith("linear_attn.norm.weight"):
        return randn(0.1, 1.0)  # gated RMSNorm multiplies by w (not 1 + w)
    if leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]:
        # input_layernorm, post_attention_layernorm, q_norm, k_norm, final norm
        return randn(0.1, 0.0 if spec["zero_centered_norms"] else 1.0)
    if "embed_tokens" in name:
        return randn(0.25 if spec["config"].get("tie_word_embeddings") else 1.0)
    if leaf == "bias":
        return randn(0.1)
    if leaf == "weight" and len(shape) == 2:  # nn.Linear [out, in]
        return randn(1.0 / math.sqrt(shape[1]))
    raise ValueError(f"no perturbation rule for parameter {name} {tuple(shape)}")


def _make_model(name: str):
    """Construct the model for fixture `name`, with every parameter overwritten."""
    if name not in FIXTURES:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(NAMES)}")
    _check_torch_paths()
    import torch
    import transformers

    spec = FIXTURES[name]
    torch.manual_seed(spec["seed"])
    config_cls = getattr(transformers, spec["config_cls"])
    model_cls = getattr(transformers, spec["model_cls"])
    config = config_cls(**json.loads(json.dumps(spec["config"])))
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation

    with torch.no_grad():
        for pname, param in model.named_parameters():  # tied parameters appear once
            value = _random_value(pname, param.shape, spec, _param_generator(spec["seed"], pname))
            param.copy_(value)
    for pname, param in model.named_parameters():
        t = param.detach()
        if not torch.isfinite(t).all():
            raise AssertionError(f"{pname} is not finite")
        if t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            raise AssertionError(f"{pname} is constant after perturbation")
        if not bool((t != 0).any()):
            raise AssertionError(f"{pname} is all zeros after perturbation")
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


def _inputs(name: str):
    """(input_ids [B,T] int64, padded dict or None), from a generator seeded per fixture."""
    import torch

    spec = FIXTURES[name]
    vocab = spec["config"]["vocab_size"]
    g = torch.Generator()
    g.manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, vocab, (spec["batch"], spec["seq_len"]), generator=g)
    padded = None
    if spec.get("pad_left"):
        p = spec["pad_left"]
        # Row 0: unchanged, unpadded. Row 1: p junk tokens (not a special pad id, so leakage
        # from pad positions would show) followed by the first T - p tokens of row 1.
        junk = torch.randint(0, vocab, (p,), generator=g)
        pids = ids.clone()
        pids[1] = torch.cat([junk, ids[1, : spec["seq_len"] - p]])
        mask = torch.ones_like(ids)
        mask[1, :p] = 0
        # Positions count real tokens only (what generate() uses); pad positions get 0.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        padded = {"input_ids": pids, "attention_mask": mask, "position_ids": pos}
    return ids, padded


def _forward(model, input_ids, attention_mask=None, position_ids=None) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
    logits = out.logits.detach().to(torch.float32).numpy()
    if not np.isfinite(logits).all():
        raise AssertionError("non-finite logits")
    return logits


def _references(name: str, model) -> dict[str, dict[str, np.ndarray]]:
    """{"reference": {...}, "reference_padded": {...}?} as numpy arrays."""
    ids, padded = _inputs(name)
    refs = {
        "reference": {
            "input_ids": ids.numpy().astype(np.int32),
            "logits": _forward(model, ids),
        }
    }
    if padded is not None:
        logits = _forward(model, **padded)
        refs["reference_padded"] = {
            "input_ids": padded["input_ids"].numpy().astype(np.int32),
            "attention_mask": padded["attention_mask"].numpy().astype(np.int32),
            "position_ids": padded["position_ids"].numpy().astype(np.int32),
            "logits": logits,
        }
    return refs


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez equivalent with a fixed zip timestamp, so the bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def _save_checkpoint(model, out_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """save_pretrained into out_dir, check it, return (config.json dict, safetensors tensors)."""
    from safetensors.numpy import load_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.safetensors*"):
        stale.unlink()
    model.save_pretrained(out_dir, safe_serialization=True)
    files = sorted(p.name for p in out_dir.glob("*.safetensors*"))
    if files != ["model.safetensors"]:
        raise AssertionError(f"expected one unsharded model.safetensors, got {files}")
    state = load_file(out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())

    # The saved keys are exactly the model's parameters, with a tied lm_head written once.
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    if set(state) != set(expected):
        raise AssertionError(
            f"saved keys differ: missing {sorted(set(expected) - set(state))}, "
            f"extra {sorted(set(state) - set(expected))}"
        )
    for k, v in state.items():
        if v.dtype != np.float32 or not np.array_equal(v, expected[k].detach().numpy()):
            raise AssertionError(f"saved tensor {k} differs from the model")
    return config, state


# --------------------------------------------------------------------------------------------
# public API


def build(name: str) -> dict:
    """Build fixture `name` in memory.

    Returns {"config": config.json dict, "state_dict": {hf_key: float32 array} exactly as
    save_pretrained writes it, "input_ids": int32 [B,T], "attention_mask": None (unpadded),
    "logits": float32 [B,T,V], "padded": {input_ids, attention_mask, position_ids, logits} or
    None, "versions": str array}.
    """
    with _single_thread():
        model = _make_model(name)
        refs = _references(name, model)
        with tempfile.TemporaryDirectory() as tmp:
            config, state = _save_checkpoint(model, Path(tmp))
    ref = refs["reference"]
    return {
        "config": config,
        "state_dict": state,
        "input_ids": ref["input_ids"],
        "attention_mask": None,
        "logits": ref["logits"],
        "padded": refs.get("reference_padded"),
        "versions": _versions(),
    }


def write(name: str, out_dir) -> Path:
    """Write fixture `name` into out_dir/<name>/ (or out_dir itself if it is named <name>)."""
    out_dir = Path(out_dir)
    if out_dir.name != name:
        out_dir = out_dir / name
    with _single_thread():
        model = _make_model(name)
        refs = _references(name, model)
        _save_checkpoint(model, out_dir)
    versions = _versions()
    for stale in out_dir.glob("reference*.npz"):
        stale.unlink()
    for fname, arrays in refs.items():
        _save_npz(out_dir / f"{fname}.npz", {**arrays, "versions": versions})
    return out_dir


def load_reference(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def verify(name: str, out_dir) -> dict[str, float]:
    """Reload out_dir/<name> with AutoModelForCausalLM and recompute every stored reference.

    Raises unless the logits match bit for bit. Returns diagnostics (max abs diffs).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if out_dir.name != name:
        out_dir = out_dir / name
    info: dict[str, float] = {}
    with _single_thread():
        model = AutoModelForCausalLM.from_pretrained(
            out_dir, attn_implementation="eager", dtype=torch.float32
        ).eval()
        if type(model).__name__ != FIXTURES[name]["model_cls"]:
            raise AssertionError(f"reloaded as {type(model).__name__}")
        refs = {p.stem: load_reference(p) for p in sorted(out_dir.glob("reference*.npz"))}
        for stem, ref in refs.items():
            kwargs = {"input_ids": torch.from_numpy(ref["input_ids"].astype(np.int64))}
            for k in ("attention_mask", "position_ids"):
                if k in ref:
                    kwargs[k] = torch.from_numpy(ref[k].astype(np.int64))
            logits = _forward(model, **kwargs)
            diff = float(np.abs(logits - ref["logits"]).max())
            info[f"{stem}.reload_max_abs_diff"] = diff
            if diff != 0.0:
                raise AssertionError(f"{name}/{stem}: reloaded logits differ by {diff}")

        # The padded row must agree (to float tolerance) with the unpadded run of its real tokens.
        if "reference_padded" in refs:
            p = FIXTURES[name]["pad_left"]
            base, pad = refs["reference"], refs["reference_padded"]
            d1 = float(np.abs(pad["logits"][1, p:] - base["logits"][1, :-p]).max())
            d0 = float(np.abs(pad["logits"][0] - base["logits"][0]).max())
            info["padded_row1_vs_unpadded_max_abs_diff"] = d1
            info["padded_row0_vs_unpadded_max_abs_diff"] = d0
            if d1 > 1e-4 or d0 > 1e-4:
                raise AssertionError(f"{name}: padded reference inconsistent ({d0}, {d1})")
    return info


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="fixtures folder")
    parser.add_argument("--only", choices=NAMES, action="append", help="fixture(s) to write")
    parser.add_argument("--no-verify", action="store_true", help="skip the reload check")
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    out = Path(args.out)
    for name in args.only or NAMES:
        path = write(name, out)
        line = f"{name}: {_tree_size(path) / 1024:.1f} KiB"
        for f in sorted(path.iterdir()):
            line += f"\n  {f.name:24s} {f.stat().st_size:>9d} B"
        if not args.no_verify:
            for k, v in verify(name, out).items():
                line += f"\n  {k} = {v:.3g}"
        print(line, flush=True)
    if out.exists():
        print(f"total {out}: {_tree_size(out) / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
