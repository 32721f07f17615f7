"""Orbax checkpoints of a WHALE run: the trainer's fp32 master weights and AdamW state as arrays,
and the loop's state (counters, schedule and patience state, data cursor, accepted harness, cost
counters, best scores, config hash) as JSON, in one Orbax step directory per save.

- Saves are asynchronous: ``save`` returns once the arrays are copied off the training path;
  the write finishes in the background and is committed (Orbax's finalize) only when complete,
  so a crash mid-write leaves no directory that looks like a checkpoint.
- Retention: the last ``keep`` saves plus the validation-best one (named in the state).
- ``restore`` tries the newest save first; one that cannot be read (truncated, corrupt) is
  reported, moved aside as ``<index>.corrupt`` and the one before it is tried.
- Paths may be local or ``gs://bucket/...`` (Orbax writes through tensorstore; see docs/loop.md).

Arrays are stored as a flat dict keyed by leaf index (``00000`` ...) of the (params, opt_state)
tree, with the leaf paths and shapes in the JSON state, so a checkpoint of a different model is
refused by name rather than by a shape error deep inside Orbax.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp


def _tree_leaves(trainer) -> tuple[list[Any], Any, list[str]]:
    tree = (trainer.params, trainer.opt_state)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_paths]
    names = [jax.tree_util.keystr(p) for p, _ in with_paths]
    return leaves, treedef, names


ASSUMED_WRITE_BPS = 200e6


class CheckpointMismatch(ValueError):
    """The save holds another model's tree: a configuration error, not a corrupt save."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (the message names the directory and the cause). The
    saves before it stand; Orbax's threads of the failed save wait forever for its signals, so the
    process must end without waiting for its threads (``whale_jax.main``)."""


class Checkpoints:
    def __init__(self, directory: str, *, keep: int, log: Callable[[str], None] = print):
        # Orbax wants absolute paths; URLs (gs://...) pass as they are.
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.keep = keep
        self.log = log
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=True, create=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.last_save_s: float | None = None  # the whole write of the last save (blocking + async)
        self._pending: tuple[int, float] | None = None
        self._best: int | None = None

    # ---- writing -------------------------------------------------------------------------------

    def save(self, index: int, state: dict[str, Any], trainer=None, *, best: int | None) -> None:
        """Start saving; returns before the write completes (``wait`` blocks until it has). Older
        saves beyond the retention are deleted once this one is complete, never before."""
        self.wait()
        self._best = best
        t0 = time.monotonic()
        items: dict[str, Any] = {"state": ocp.args.JsonSave(state)}
        if trainer is not None:
            leaves, _, names = _tree_leaves(trainer)
            state["arrays"] = {"names": names, "shapes": [list(x.shape) for x in leaves]}
            items["arrays"] = ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(leaves)})
        try:
            self.manager.save(index, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._failed(index, e) from e
        self._pending = (index, t0)

    def _failed(self, index: int | None, e: Exception) -> SaveFailed:
        which = f"checkpoint {index}" if index is not None else "a checkpoint"
        return SaveFailed(f"--checkpoint_dir={self.directory}: writing {which} failed "
                          f"({type(e).__name__}: {e})")  # fmt: skip

    def estimate_s(self, trainer=None) -> float:
        """How long the next save will take: the last one's duration, or before any save the
        bytes to write at ``ASSUMED_WRITE_BPS`` (a conservative local-disk rate)."""
        if self.last_save_s is not None:
            return self.last_save_s
        if trainer is None:
            return 1.0
        leaves, _, _ = _tree_leaves(trainer)
        return sum(x.size * x.dtype.itemsize for x in leaves) / ASSUMED_WRITE_BPS

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            index, self._pending = (self._pending or (None, 0.0))[0], None
            raise self._failed(index, e) from e
        if self._pending is not None:
            self.last_save_s = time.monotonic() - self._pending[1]
            self._pending = None
            self.prune(self._best)

    def prune(self, best: int | None) -> None:
        steps = sorted(self.manager.all_steps())
        keep = set(steps[-self.keep :]) | ({best} if best is not None else set())
        for step in steps:
            if step not in keep:
                self.manager.delete(step)

    def close(self) -> None:
        self.wait()
        self.manager.close()

    # ---- reading -------------------------------------------------------------------------------

    def indices(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, trainer=None) -> tuple[int, dict[str, Any]] | None:
        """(index, state) of the newest readable save, with the trainer's weights and optimizer
        state replaced from it; None when there is no save."""
        for index in reversed(self.indices()):
            try:
                state = self._restore(index, trainer)
            except CheckpointMismatch:
                raise
            except Exception as e:  # an unreadable save: fall back to the one before
                self.log(
                    f"checkpoint {self.directory}/{index} cannot be read ({type(e).__name__}: "
                    f"{str(e)[:300]}); moving it aside and falling back to the one before"
                )
                self._set_aside(index)
                continue
            return index, state
        return None

    def _restore(self, index: int, trainer) -> dict[str, Any]:
        state = self.manager.restore(index, args=ocp.args.Composite(state=ocp.args.JsonRestore()))[
            "state"
        ]
        if trainer is None:
            return state
        leaves, treedef, names = _tree_leaves(trainer)
        saved = state.get("arrays") or {}
        if saved.get("names") != names or saved.get("shapes") != [list(x.shape) for x in leaves]:
            raise CheckpointMismatch(
                f"{self.directory}/{index}: the saved weights/optimizer tree differs from this "
                "run's model (another --model or optimizer setting?); use another --run_dir or "
                "--checkpoint_dir"
            )
        abstract = {
            f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            for i, x in enumerate(leaves)
        }
        arrays = self.manager.restore(
            index, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
        )["arrays"]
        params, opt_state = jax.tree_util.tree_unflatten(
            treedef, [arrays[f"{i:05d}"] for i in range(len(leaves))]
        )
        trainer.params, trainer.opt_state = params, opt_state
        trainer.step = int(state["trainer_step"])
        return state

    def _set_aside(self, index: int) -> None:
        from etils import epath

        path = epath.Path(self.directory) / str(index)
        target = epath.Path(self.directory) / f"{index}.corrupt-{int(time.time())}"
        try:
            path.rename(target)
        except OSError as e:
            self.log(f"could not move {path} aside ({e}); deleting it")
            self.manager.delete(index)
        self.manager.reload()
