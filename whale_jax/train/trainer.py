"""The SFT update of RSFT: fp32 master weights, AdamW, sharded jitted steps, gradient accumulation.

``Trainer(model, TrainConfig(...), mesh)`` takes the model's weights as fp32 master copies laid out
on the mesh by the logical-axis table (FSDP by default), and an optax AdamW state beside them.
``Trainer.update(rows)`` runs one optimizer step over one minibatch of rows:

1. the rows become fixed-shape microbatches (``packing.microbatches``, packed by default), with as
   many microbatches on every host;
2. each microbatch adds the gradient of its summed NLL to an fp32 accumulator (one jitted call;
   the weights are cast to ``compute_dtype`` inside it, so bf16 compute keeps fp32 masters);
3. the accumulated gradient is divided by the minibatch's trained-token count (the token mean of
   ``loss.py``), clipped by global norm and applied by AdamW, unless the loss or the gradient is
   not finite: then weights and optimizer state stay as they were and the step reports it.

Rematerialisation is chosen per call (``TrainConfig.remat``), not frozen in the model. Shapes are
static per layout: a run compiles the apply step once and the accumulate step once per sequence
shape (bucketed: per bucket) and loss width (at most ``loss_buckets`` per sequence length: the
trained positions per sequence, rounded up, one width per step for all hosts);
``compile_counts`` says how many.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from whale_jax.models.transformer import Transformer, split_groups
from whale_jax.sharding import logical_spec, make_mesh, process_max, process_sum
from whale_jax.train.loss import nll_sum
from whale_jax.train.packing import Microbatch, microbatches, pad_fraction
from whale_jax.train.rows import Row

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Parameters without weight decay: norms' scales, biases and the GDN decay parameters.
_NO_DECAY = ("norm", "bias", "A_log", "dt_bias")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup, then a constant, cosine or linear schedule to
    ``learning_rate * end_ratio`` at ``decay_steps`` (counted in optimizer steps)."""

    learning_rate: float = 1e-7  # the paper's for Qwen3.5-2B/4B
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear
    decay_steps: int = 0
    end_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm clipping; 0 turns it off

    def __post_init__(self):
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"schedule must be constant, cosine or linear, got {self.schedule!r}")
        if self.schedule != "constant" and self.decay_steps <= 0:
            raise ValueError(f"a {self.schedule} schedule needs decay_steps > 0")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    optim: OptimConfig = OptimConfig()
    seq_len: int = 2048  # longest row; packed sequences have this length
    micro_tokens: int = 16384  # token positions per microbatch (gradient accumulation unit)
    pack: bool = True  # pack rows (one shape) or bucket them by length
    compute_dtype: str = "float32"  # float32 | bfloat16; master weights stay fp32
    # Rematerialise each layer group in the backward pass (scanned groups); off, the groups run
    # unrolled and keep their activations (faster where memory allows).
    remat: bool = True
    loss_chunk: int = 256  # tokens per row whose logits exist at once
    loss_buckets: int = 4  # loss widths per sequence length: trained positions per row, rounded up

    def __post_init__(self):
        if self.compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(_DTYPES)}")
        if self.seq_len < 2 or self.micro_tokens < 1 or self.loss_chunk < 1:
            raise ValueError("seq_len >= 2, micro_tokens >= 1 and loss_chunk >= 1 are required")
        if self.loss_buckets < 1:
            raise ValueError(f"loss_buckets must be at least 1, got {self.loss_buckets}")


def make_schedule(c: OptimConfig) -> optax.Schedule:
    if c.schedule == "constant":
        after = optax.constant_schedule(c.learning_rate)
    elif c.schedule == "cosine":
        after = optax.cosine_decay_schedule(c.learning_rate, c.decay_steps, alpha=c.end_ratio)
    else:
        after = optax.linear_schedule(c.learning_rate, c.learning_rate * c.end_ratio, c.decay_steps)
    if c.warmup_steps <= 0:
        return after
    warmup = optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps)
    return optax.join_schedules([warmup, after], [c.warmup_steps])


def _decays(path) -> bool:
    name = jax.tree_util.keystr(path)
    return not any(tag in name for tag in _NO_DECAY)


def make_adamw(c: OptimConfig, params) -> optax.GradientTransformation:
    """AdamW with the schedule and weight decay of ``c`` (no clipping)."""
    mask = jax.tree_util.tree_map_with_path(lambda p, _: _decays(p), params)
    return optax.adamw(
        make_schedule(c), b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=mask
    )


def make_optimizer(c: OptimConfig, params) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW: the optimizer whose state the trainer keeps and
    checkpoints. (``Trainer``'s apply step runs the same arithmetic in one pass: it takes the
    norm it reports anyway and scales the gradient by the clip factor before AdamW.)"""
    adamw = make_adamw(c, params)
    if c.max_grad_norm <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(c.max_grad_norm), adamw)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(state, mesh: Mesh):
    """A tree like ``state`` whose leaves are the NamedShardings the logical-axis table gives."""

    def one(v):
        axes = v.get_metadata().get("axes") or (None,) * v.get_value().ndim
        return v.replace(NamedSharding(mesh, logical_spec(v.get_value().shape, axes, mesh)))

    return jax.tree.map(one, state, is_leaf=_is_var)


@dataclasses.dataclass
class UpdateMetrics:
    rows: int
    trained_tokens: int  # over all hosts
    microbatches: int
    loss: float  # token-mean NLL before the update
    grad_norm: float  # before clipping
    learning_rate: float
    applied: bool  # False: non-finite loss or gradient, nothing changed
    pad_fraction: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Trainer:
    """Master weights, optimizer state and the compiled steps for one model on one mesh."""

    def __init__(self, model: Transformer, config: TrainConfig = TrainConfig(), mesh=None):
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh()
        self.cfg = model.cfg
        compute = _DTYPES[config.compute_dtype]
        _, state = nnx.split(model)

        # The compute model: the same graph with activations (and cast weights) in compute_dtype;
        # its abstract state is the template of which weights are cast (norm scales, A_log and
        # dt_bias stay fp32, as the model builds them).
        def graph(dtype):
            abstract = nnx.eval_shape(lambda: Transformer(model.cfg, dtype=dtype, rngs=nnx.Rngs(0)))
            return nnx.split(abstract)

        self._compute_graphdef, template = graph(compute)
        self._compute_dtypes = jax.tree.map(lambda a: a.dtype, template)
        self._master_graphdef = graph(jnp.float32)[0]  # ``model()``: fp32 weights and activations
        self.shardings = param_shardings(state, self.mesh)
        # A jitted copy: the masters never alias the model's arrays (updates donate them).
        self.params = jax.jit(
            lambda s: jax.tree.map(lambda a: a.astype(jnp.float32), s),
            out_shardings=self.shardings,
        )(state)
        self.tx = make_optimizer(config.optim, self.params)
        self._adamw = make_adamw(config.optim, self.params)  # tx without its clipping stage
        replicated = NamedSharding(self.mesh, PartitionSpec())
        abstract_opt = jax.eval_shape(self.tx.init, self.params)
        self.opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, s: s,
            abstract_opt,
            self.shardings,
            transform_non_params=lambda _: replicated,
        )
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        self.schedule = make_schedule(config.optim)
        self.step = 0  # optimizer updates applied
        self._replicate = None  # model_state's jit, built on the first call across hosts
        self.batch_shards = int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp")]))
        self._batch_sharding = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp"), None))
        # [B, T, D] activations: rows over data x fsdp, like the batch (see Transformer.hidden).
        self._act_sharding = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp"), None, None))
        self._signatures: dict[str, set] = {}
        self._build()

    # -- compiled steps --------------------------------------------------------------------------
    def _build(self) -> None:
        c = self.config
        cgraph, dtypes = self._compute_graphdef, self._compute_dtypes
        zero = NamedSharding(self.mesh, PartitionSpec())

        head = "embed" if self.cfg.tie_word_embeddings else "lm_head"
        head_sharding = self.shardings[head].get_value()

        def loss_sum(params, groups, tokens, segments, pick, weight):
            cast = jax.tree.map(lambda a, d: a.astype(d), params, dtypes)
            if groups is not None:
                groups = [
                    jax.tree.map(lambda a, d: a.astype(d), g, dtypes["blocks"]) for g in groups
                ]
            model = nnx.merge(cgraph, cast)
            return nll_sum(
                model,
                tokens,
                segments,
                pick,
                weight,
                chunk=c.loss_chunk,
                remat=c.remat,
                act_sharding=self._act_sharding,
                head_sharding=head_sharding,
                groups=groups,
            )  # (sum, count)

        grad_fn = jax.value_and_grad(loss_sum, argnums=(0, 1), has_aux=True)

        def accumulate(params, acc, nll, tokens, segments, pick, weight):
            # Without remat the layer groups run unrolled over per-group weight slices, cut here
            # outside the differentiated function (inside it, each slice's gradient would be a
            # zero-padded full stack) and the groups' gradients stacked back. With XLA:CPU's
            # scan, every residual of a group lives in a scan-stacked array that is zero-filled
            # and copied in and out; unrolled they are plain buffers (Qwen3.5 small, one core:
            # forward + backward 6.3 s with remat -> 5.2 s; a scan without remat 6.1 s).
            groups = None if c.remat else list(split_groups(params["blocks"]))
            (total, _), (grads, group_grads) = grad_fn(
                params, groups, tokens, segments, pick, weight
            )
            if group_grads is not None:  # (the stacked blocks' own gradient is zero: unused)
                grads["blocks"] = jax.tree.map(lambda *g: jnp.stack(g), *group_grads)
            acc = jax.tree.map(jnp.add, acc, grads)
            return acc, nll + total

        max_norm = c.optim.max_grad_norm

        def apply(params, opt_state, acc, nll, count):
            # = self.tx (clip_by_global_norm, then AdamW) on acc / count, in one pass over the
            # weights: the norm is read off the accumulator, the token mean and the clip factor
            # become one scale applied inside AdamW's pass, and a non-finite step skips the update
            # (lax.cond) instead of computing it and selecting the old values (0.84 -> 0.28 s for
            # SmolLM2 on one core).
            denom = jnp.maximum(count, 1.0)
            loss = nll / denom
            # (the division fuses into the reduction; squaring acc itself could overflow first)
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g / denom)) for g in jax.tree.leaves(acc)))
            finite = jnp.isfinite(loss) & jnp.isfinite(norm)
            scale = 1.0 / denom
            if max_norm > 0:  # optax.clip_by_global_norm's rule
                scale = jnp.where(norm < max_norm, scale, scale * max_norm / norm)

            def step(operands):
                params, opt_state, acc = operands
                grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), acc)
                inner = opt_state[1] if max_norm > 0 else opt_state
                updates, inner = self._adamw.update(grads, inner, params)
                new_opt = (opt_state[0], inner) if max_norm > 0 else inner
                return optax.apply_updates(params, updates), new_opt

            def skip(operands):
                return operands[0], operands[1]

            new_params, new_opt = jax.lax.cond(finite, step, skip, (params, opt_state, acc))
            return new_params, new_opt, loss, norm, finite

        ps, os_ = self.shardings, self.opt_shardings
        self._accumulate = jax.jit(accumulate, out_shardings=(ps, zero), donate_argnums=(1, 2))
        self._apply = jax.jit(
            apply, out_shardings=(ps, os_, zero, zero, zero), donate_argnums=(0, 1)
        )
        self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=ps)

    @property
    def compile_counts(self) -> dict[str, int]:
        """Distinct input shapes each compiled step has seen (each is one compilation)."""
        return {k: len(v) for k, v in self._signatures.items()}

    def _global(self, array: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self._batch_sharding, array)

    # -- one optimizer step ----------------------------------------------------------------------
    def microbatches(self, rows: Sequence[Row], min_microbatches: int = 0) -> list[Microbatch]:
        c = self.config
        return microbatches(
            rows,
            seq_len=c.seq_len,
            micro_tokens=c.micro_tokens,
            pack=c.pack,
            batch_multiple=max(self.batch_shards // jax.process_count(), 1),
            min_microbatches=min_microbatches,
        )

    def _accumulate_rows(self, rows: Sequence[Row]):
        """Summed NLL gradient, summed NLL and the global trained-token count over this host's
        rows, through the same number of microbatches on every host."""
        batches = self.microbatches(rows)
        n_micro = process_max(len(batches))
        if n_micro > len(batches):  # another host has more: pad with empty microbatches
            batches = self.microbatches(rows, min_microbatches=n_micro)
        count = process_sum(sum(b.trained_tokens for b in batches))
        if count == 0:
            return None, None, count, batches
        # Loss positions per sequence: one width for the whole step and every host (one shape per
        # sequence length; a bucket shorter than the width takes all its positions).
        width = process_max(max(b.pick_width(self.config.loss_buckets) for b in batches))
        acc = self._zeros(self.params)
        nll = jnp.zeros((), jnp.float32)
        for b in batches:
            pick, weight = b.picks(min(width, b.tokens.shape[1]))
            self._signatures.setdefault("accumulate", set()).add((b.tokens.shape, pick.shape))
            acc, nll = self._accumulate(
                self.params,
                acc,
                nll,
                self._global(b.tokens),
                self._global(b.segments),
                self._global(pick),
                self._global(weight),
            )
        return acc, nll, count, batches

    def loss_and_grad(self, rows: Sequence[Row]):
        """(token-mean loss, its gradient w.r.t. the master weights) over ``rows``, without
        updating anything: what ``update`` would apply before clipping and AdamW."""
        acc, nll, count, _ = self._accumulate_rows(rows)
        if count == 0:
            return float("nan"), jax.tree.map(jnp.zeros_like, self.params)
        return float(nll) / count, jax.tree.map(lambda g: g / count, acc)

    def update(self, rows: Sequence[Row]) -> UpdateMetrics:
        """One optimizer step on this host's ``rows`` (all hosts call it together)."""
        t0 = time.perf_counter()
        acc, nll, count, batches = self._accumulate_rows(rows)
        lr = float(self.schedule(self.step))
        if count == 0:  # nothing to learn from: AdamW's momentum and decay would still move
            return UpdateMetrics(
                rows=len(rows), trained_tokens=0, microbatches=0, loss=float("nan"),
                grad_norm=0.0, learning_rate=lr, applied=False, pad_fraction=0.0,
                seconds=time.perf_counter() - t0,
            )  # fmt: skip
        self._signatures.setdefault("apply", set()).add(())
        self.params, self.opt_state, loss, norm, finite = self._apply(
            self.params, self.opt_state, acc, nll, jnp.float32(count)
        )
        applied = bool(finite)
        self.step += applied  # the schedule's count: optax's state did not move on a skip
        return UpdateMetrics(
            rows=len(rows),
            trained_tokens=int(count),
            microbatches=len(batches),
            loss=float(loss),
            grad_norm=float(norm),
            learning_rate=lr,
            applied=applied,
            pad_fraction=pad_fraction(batches),
            seconds=time.perf_counter() - t0,
        )

    # -- weights out -----------------------------------------------------------------------------
    def model_state(self):
        """The master weights as an ``nnx.State`` of the model (fp32, on the trainer's mesh); an
        engine's ``set_params`` casts and moves them into its own layout. Across hosts, each
        host's engine needs the whole weights: they are replicated over the mesh (a collective,
        which every host makes at the same point of the step) and this host's copy returned.
        Leaf by leaf, each waited for: a device holds one more whole leaf at a time beside its
        shards, not a whole extra model (fp32 4B: 16 GB)."""
        if jax.process_count() == 1:
            return self.params
        if self._replicate is None:  # built once: a new jit per call would compile every step
            self._replicate = jax.jit(
                lambda p: p, out_shardings=NamedSharding(self.mesh, PartitionSpec())
            )
        return jax.tree.map(
            lambda a: self._replicate(a).addressable_data(0).block_until_ready(), self.params
        )

    def model(self) -> Transformer:
        return nnx.merge(self._master_graphdef, self.params)
