"""Model configuration: one frozen dataclass for every supported family, read from HF config.json.

Families:
- ``qwen3_5``: Qwen3.5's hybrid text model (Gated DeltaNet linear attention + gated full attention,
  zero-centred RMSNorm, partial RoPE).
- ``dense``: the Llama / Qwen2 / Qwen3 / SmolLM decoder (full attention only, plain RMSNorm,
  optional q/k norm and qkv bias).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

FULL = "full_attention"
LINEAR = "linear_attention"

_DENSE_TYPES = {"llama", "qwen2", "qwen3", "mistral", "smollm", "smollm2"}
_QWEN3_5_TYPES = {"qwen3_5", "qwen3_5_text"}

# SmolLM2's vocabulary and special ids on a 2-layer, 32-wide dense model: with SmolLM2's tokenizer
# and chat template, random weights of this shape run every program in seconds (the loop tests) and
# leave the host's work alone on the clock (the rollout benchmark's CPU proxy, --model=tiny).
TINY_SMOLLM2_HF: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}  # fmt: skip


def tiny_qwen3_5_hf(**overrides: Any) -> dict[str, Any]:
    """A small Qwen3.5 text config (HF keys) with mixed layers and grouped value heads (Hv > Hk):
    the tests' hybrid model and the quick runs of the device benchmarks."""
    cfg: dict[str, Any] = dict(
        model_type="qwen3_5_text", vocab_size=96, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=[LINEAR, FULL] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip
    cfg.update(overrides)
    return cfg


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding: which dims rotate, at what base, and how frequencies are rescaled."""

    theta: float = 10000.0
    rotary_dim: int = 0  # leading dims of each head that rotate (NeoX halves); the rest pass
    scaling: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self) -> np.ndarray:
        """fp32 inverse frequencies of the rotated half-dims, after any configured rescaling."""
        dim = self.rotary_dim
        # Computed in fp32 like the reference implementation, so positions agree to the last bit.
        exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        inv = (np.float32(1.0) / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.scaling == "default":
            return inv
        if self.scaling == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.scaling == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        raise ValueError(f"unsupported rope scaling {self.scaling!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str  # "qwen3_5" | "dense"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0  # 1.0 for zero-centred (1 + w) RMSNorm
    attn_output_gate: bool = False  # q_proj holds [q | gate] per head; output *= sigmoid(gate)
    qk_norm: bool = False
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Gated DeltaNet (linear attention) layers.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def period(self) -> int:
        """Smallest p such that layer_types repeats every p layers (the scanned layer group)."""
        n = self.num_layers
        for p in range(1, n + 1):
            if n % p == 0 and all(self.layer_types[i] == self.layer_types[i % p] for i in range(n)):
                return p
        return n

    @property
    def num_groups(self) -> int:
        return self.num_layers // self.period

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def num_params(self) -> int:
        d, f = self.hidden_size, self.intermediate_size
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for kind in self.layer_types:
            total += 3 * d * f + 2 * d
            if kind == FULL:
                q = self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)
                kv = 2 * self.num_kv_heads * self.head_dim
                total += d * (q + kv) + self.num_heads * self.head_dim * d
                total += 2 * self.head_dim if self.qk_norm else 0
            else:
                hv = self.linear_num_value_heads
                total += d * (self.gdn_conv_dim + self.gdn_value_dim + 2 * hv)
                total += self.linear_conv_kernel * self.gdn_conv_dim + 2 * hv
                total += self.linear_value_head_dim + self.gdn_value_dim * d
        return total

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Reads an HF config dict (transformers 4.x or 5.x spelling). ``source`` names it in errors."""
        model_type = hf.get("model_type")
        if model_type == "qwen3_5" and "text_config" in hf:
            text = dict(hf["text_config"])
            # The LM head belongs to the outer (conditional-generation) model: its flag decides.
            if "tie_word_embeddings" in hf:
                text["tie_word_embeddings"] = hf["tie_word_embeddings"]
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                if text.get(key) is None and key in hf:
                    text[key] = hf[key]
            return cls.from_hf(text, source=f"{source}:text_config")
        if model_type not in _QWEN3_5_TYPES | _DENSE_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; supported: "
                f"{sorted(_QWEN3_5_TYPES | _DENSE_TYPES)}"
            )

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ValueError(
                    f"{source}: missing required key {key!r} (model_type {model_type})"
                )
            return hf[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = int(hf.get("head_dim") or hidden // heads)
        num_layers = int(need("num_hidden_layers"))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        common = dict(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=hf.get("pad_token_id"),
        )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if model_type in _QWEN3_5_TYPES:
            layer_types = hf.get("layer_types")
            if layer_types is None:
                interval = int(hf.get("full_attention_interval", 4))
                layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
            if len(layer_types) != num_layers:
                raise ValueError(
                    f"{source}: layer_types has {len(layer_types)} entries, "
                    f"num_hidden_layers is {num_layers}"
                )
            bad = sorted(set(layer_types) - {FULL, LINEAR})
            if bad:
                raise ValueError(f"{source}: unknown layer_types {bad}")
            return cls(
                family="qwen3_5",
                layer_types=tuple(layer_types),
                rope=_rope_from_hf(hf, head_dim, source, default_partial=0.25),
                norm_offset=1.0,
                attn_output_gate=True,
                qk_norm=True,
                linear_num_key_heads=int(need("linear_num_key_heads")),
                linear_num_value_heads=int(need("linear_num_value_heads")),
                linear_key_head_dim=int(need("linear_key_head_dim")),
                linear_value_head_dim=int(need("linear_value_head_dim")),
                linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
                **common,
            )
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        return cls(
            family="dense",
            layer_types=(FULL,) * num_layers,
            rope=_rope_from_hf(hf, head_dim, source, default_partial=1.0),
            qk_norm=model_type == "qwen3",
            **common,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(hf, source=str(path))


def _rope_from_hf(hf: Mapping[str, Any], head_dim: int, source: str, *, default_partial: float):
    # transformers 5 nests everything under rope_parameters; 4.x used rope_theta + rope_scaling.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: rope_type {kind!r} is not supported (default, linear, llama3)")
    rotary_dim = int(head_dim * float(partial))
    rotary_dim -= rotary_dim % 2
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rotary_dim,
        scaling=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
