"""A run's trained weights as a Hugging Face checkpoint:

    python -m whale_jax.export --run_dir=runs/math-whale-seed0 --which=last --out=exported/math

``--which=last`` takes the newest checkpoint, ``best`` the validation-best one the run kept. The
output directory gets the safetensors in the layout of the model the run started from (a
Qwen3.5 checkpoint keeps its vision tower and MTP tensors, copied from the source), its
``config.json``, ``generation_config.json`` when the source has one, and the tokenizer; it loads
with ``transformers.AutoModelForCausalLM.from_pretrained`` and with ``whale_jax.load_model``.

Only the weights are read from the checkpoint (the AdamW moments stay on disk), as fp32 master
weights; ``--dtype=bfloat16`` writes them in bf16. Exit status 2 names the flag at fault.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from absl import app, flags

F = flags.FLAGS


def define_flags() -> None:
    """The program's flags, defined when it runs (``whale_jax.main`` defines some of the same
    names, and a process may import both modules)."""
    flags.DEFINE_string("run_dir", "", "The run directory to export from (its config.json names "
                        "the model and the checkpoint directory).")  # fmt: skip
    flags.DEFINE_enum("which", "last", ["last", "best"], "The newest checkpoint, or the "
                      "validation-best one.")  # fmt: skip
    flags.DEFINE_string("out", "", "Output directory (created; must be empty or absent).")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of the written "
                      "weights.")  # fmt: skip
    flags.DEFINE_string("checkpoint_dir", "", "Where the checkpoints are, when not where the "
                        "run's config.json says (a copied run directory, say).")  # fmt: skip


class ExportError(ValueError):
    """Bad input (the message names the flag or file)."""


def run_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        return {"config": saved["config"], "checkpoint_dir": saved["checkpoint_dir"]}
    except FileNotFoundError:
        raise ExportError(f"--run_dir={run_dir}: no config.json (not a run directory, or a run "
                          "that never started)") from None  # fmt: skip
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ExportError(f"{path}: not a run's config ({e!r})") from None


def pick(checkpoints, which: str) -> tuple[int, dict[str, Any]]:
    """(index, loop state) of the checkpoint ``which`` names."""
    import orbax.checkpoint as ocp

    indices = checkpoints.indices()
    if not indices:
        raise ExportError(f"--run_dir: no checkpoint in {checkpoints.directory}")

    def state_of(index: int) -> dict[str, Any]:
        args = ocp.args.Composite(state=ocp.args.JsonRestore())
        return checkpoints.manager.restore(index, args=args)["state"]

    last = state_of(indices[-1])
    if which == "last":
        return indices[-1], last
    best = last.get("best_checkpoint")
    if best is None or best not in indices:
        raise ExportError(f"--which=best: the run has no validation-best checkpoint in "
                          f"{checkpoints.directory} (kept: {indices}); --which=last")  # fmt: skip
    return best, state_of(best)


def trained_weights(checkpoints, index: int, state: dict[str, Any], model):
    """The model's weights as the checkpoint holds them: its fp32 masters, read alone (the
    optimizer's moments are not), checked leaf by leaf against the model's tree."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    graphdef, params = nnx.split(model)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    # The checkpoint's leaves are those of (params, opt_state): the weights' names start "[0]".
    names = ["[0]" + jax.tree_util.keystr(p) for p, _ in with_paths]
    saved = state.get("arrays") or {}
    where = {n: i for i, n in enumerate(saved.get("names") or [])}
    missing = [n for n in names if n not in where]
    if missing:
        raise ExportError(f"{checkpoints.directory}/{index}: holds no weight {missing[0]} of the "
                          f"run's model ({len(missing)} missing)")  # fmt: skip
    shapes = saved["shapes"]
    item = {}
    for n, (_, leaf) in zip(names, with_paths, strict=True):
        i = where[n]
        if list(leaf.shape) != shapes[i]:
            raise ExportError(f"{checkpoints.directory}/{index}: {n} has shape {shapes[i]}, the "
                              f"model's is {list(leaf.shape)}")  # fmt: skip
        item[f"{i:05d}"] = jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
    restored = checkpoints.manager.restore(
        index,
        args=ocp.args.Composite(arrays=ocp.args.PyTreeRestore(
            item=item, restore_args=jax.tree.map(
                lambda _: ocp.ArrayRestoreArgs(restore_type=np.ndarray), item),
            partial_restore=True)),
    )["arrays"]  # fmt: skip
    leaves = [restored[f"{where[n]:05d}"] for n in names]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


def export(run_dir: str, out: str, *, which: str = "last", dtype: str = "float32",
           checkpoint_dir: str = "", log=print) -> dict[str, Any]:  # fmt: skip
    """Writes the run's ``which`` checkpoint to ``out`` as an HF checkpoint; returns what it
    wrote (``index``, ``step``, ``harness``, ``out``)."""
    import jax.numpy as jnp

    from whale_jax.io.load import load_model, source_of
    from whale_jax.io.safetensors import save_hf
    from whale_jax.loop.checkpoint import Checkpoints

    saved = run_config(run_dir)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"--out={out}: exists and is not an empty directory")
    directory = checkpoint_dir or saved["checkpoint_dir"]
    if "://" not in directory and not os.path.isdir(directory):
        raise ExportError(f"--checkpoint_dir={directory}: no such directory (pass "
                          "--checkpoint_dir where the run's checkpoints are now)")  # fmt: skip
    spec = saved["config"]["model"]["model"]
    checkpoints = Checkpoints(directory, keep=1_000_000, log=log)
    try:
        index, state = pick(checkpoints, which)
        log(f"checkpoint {index} (step {state.get('step')}, harness "
            f"{(state.get('harness') or {}).get('id')}) of {directory}")  # fmt: skip
        model = load_model(spec, dtype=jnp.float32).model  # the tree, and its source's layout
        source = source_of(model)
        trained = trained_weights(checkpoints, index, state, model)
    finally:
        checkpoints.manager.close()
    out_dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(trained, tmp, source.hf_config, prefix=source.prefix, source_dir=source.directory,
            dtype=out_dtype)  # fmt: skip
    write_tokenizer(spec, source, tmp)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above)
    os.replace(tmp, out)
    log(f"wrote {out}")
    return {"index": index, "step": state.get("step"), "out": out,
            "harness": (state.get("harness") or {}).get("id")}  # fmt: skip


def write_tokenizer(spec: str, source, out: str) -> None:
    """The source's tokenizer files (and generation config), or, for a GGUF, its tokenizer as
    transformers writes it."""
    if source.directory is not None:
        for name in sorted(os.listdir(source.directory)):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "chat_template",
                                "generation_config", "added_tokens")):  # fmt: skip
                shutil.copy2(os.path.join(source.directory, name), os.path.join(out, name))
        return
    from whale_jax.io.gguf import read_gguf
    from whale_jax.io.gguf_tokenizer import tokenizer_from_gguf
    from whale_jax.io.load import resolve_model

    tokenizer_from_gguf(read_gguf(resolve_model(spec))).save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"unexpected arguments {argv[1:]} (flags are --name=value)", file=sys.stderr)
        return 2
    for name in ("run_dir", "out"):
        if not F[name].value:
            print(f"error: --{name} is required", file=sys.stderr)
            return 2
    try:
        export(F.run_dir, F.out, which=F.which, dtype=F.dtype, checkpoint_dir=F.checkpoint_dir)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
