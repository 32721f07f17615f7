"""Sharding policy: one mesh with axes (data, fsdp, tp) and one table from logical axis names to mesh
axes. Every parameter declares its logical axes (``Param(..., axes=...)``); this file alone decides
where they go. FSDP is the default: the model dimension is split over ``fsdp``, heads and MLP
columns over ``tp``, batches over ``data`` x ``fsdp``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tp")

# logical name -> mesh axis (or axes); None replicates.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "gdn_v": "tp",  # GDN value channels (z projection, out projection)
    "gdn_qkv": None,  # fused q|k|v conv channels: a tp cut would straddle q, k and v
    "layers": None,
    "norm": None,
}


def on_device(device):
    """The sharding that places an array whole on ``device``: jax 0.12's
    ``make_single_device_sharding`` where it exists (``SingleDeviceSharding`` is deprecated
    there), the class itself before."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def make_mesh(data: int = 1, fsdp: int = -1, tp: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tp) mesh over ``devices`` (default: all); one size may be -1 (the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tp]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh sizes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(AXES, sizes, strict=True))} needs {int(np.prod(sizes))} "
            f"devices, have {len(devices)}"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), AXES)


def logical_spec(shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` with logical ``axes``. A mesh axis is used at most
    once, and only where it divides the dimension (tiny test models simply replicate)."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {tuple(axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, axes, strict=True):
        target = LOGICAL_RULES.get(name) if name else None
        if name and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_RULES")
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        chosen = []
        for ax in mesh_axes:
            size = int(np.prod([mesh.shape[a] for a in chosen + [ax]]))
            if ax not in used and mesh.shape[ax] > 1 and dim % size == 0:
                chosen.append(ax)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def param_sharding(variable: nnx.Variable, mesh: Mesh) -> NamedSharding:
    value = variable.get_value()
    axes = variable.get_metadata().get("axes") or (None,) * len(value.shape)
    return NamedSharding(mesh, logical_spec(value.shape, axes, mesh))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every parameter of ``model`` on ``mesh`` by the table (in place; returns the model)."""
    for _, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Variable):
            variable.set_value(jax.device_put(variable.get_value(), param_sharding(variable, mesh)))
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for [batch, ...] inputs: batch over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


# ---- agreement across hosts (every host must run the same steps, shapes and choices) ----------


def process_max(value: int) -> int:
    """The largest ``value`` over all hosts (every host must run the same steps and shapes)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int64(value))))


def process_gather_json(value) -> list:
    """``value`` (anything JSON can hold) from every host, in process order."""
    if jax.process_count() == 1:
        return [value]
    import json

    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
    width = process_max(raw.size)
    padded = np.zeros(width + 8, np.uint8)
    padded[:8] = np.frombuffer(np.int64(raw.size).tobytes(), np.uint8)
    padded[8 : 8 + raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(r[8 : 8 + int(np.frombuffer(r[:8].tobytes(), np.int64)[0])]))
            for r in rows]  # fmt: skip


def process_sum(value: float) -> float:
    if jax.process_count() == 1:
        return float(value)
    from jax.experimental import multihost_utils

    return float(np.sum(multihost_utils.process_allgather(np.float64(value))))
