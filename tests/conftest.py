import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent

# Tests run on the host CPU; keep XLA from grabbing both cores per test-process thread pool.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


def tiny_hf_config(**overrides) -> dict:
    """A small Qwen3.5 text config with mixed layers and grouped value heads (Hv > Hk)."""
    cfg = dict(
        model_type="qwen3_5_text",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    cfg.update(overrides)
    return cfg
