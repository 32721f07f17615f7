"""The WHALE run: ``python -m whale_jax.main --flagfile=experiments/math.flags``.

Flags exist only here: they become one frozen ``RunConfig`` (whale_jax/loop/config.py), checked
as a whole (each numeric flag against its range as it is parsed), then everything the run needs is
tried before the model loads (whale_jax/loop/preflight.py; ``--dry_run`` stops there), and the
loop (whale_jax/loop/run.py) takes it from there. Rerunning the same command on the same
--run_dir resumes from its last complete checkpoint. ``--helpfull`` lists every flag;
experiments/README.md and docs/loop.md explain them.

Exit status: 0 done (or the dry run passed); 2 bad input, before any work: an unknown or
malformed flag, a value out of range, contradictions, missing or malformed data, model files, API
keys, an initial harness that fails its checks, a directory that cannot be written, an
unreachable retrieval server, a sandbox mode this machine refuses, a foreign checkpoint (the
message names the flag or file and the fix); 1 the run failed while working (a checkpoint save,
the run directory's mirror, a host: the last complete checkpoint stands, rerun to resume); 143
stopped by SIGTERM (preemption; rerun the same command to resume).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from whale_jax.loop import config as cfg

F = flags.FLAGS

# Run.
flags.DEFINE_string("run_dir", "", "Run directory (metrics, archive, checkpoints, report). "
                    "Default: runs/<domain>-<method>-seed<seed>.")  # fmt: skip
flags.DEFINE_integer("seed", 0, "Run seed: sampling identities, data order, proposer choices.")
flags.DEFINE_string("initial_harness", "", "Harness file to start from (default: the domain's h0).")
# Hosts (docs/loop.md, "Several hosts"): every process of a job joins jax.distributed, from the
# cluster's own description (--distributed: TPU slices, SLURM, Open MPI) or the three flags.
flags.DEFINE_string("coordinator_address", "", "host:port of process 0's coordinator: this job "
                    "is one of --num_processes processes (jax.distributed.initialize).")  # fmt: skip
flags.DEFINE_integer("num_processes", 1, "Processes in the job (with --coordinator_address).")
flags.DEFINE_integer("process_id", 0, "This process's index, 0 .. --num_processes - 1.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() with the cluster's "
                  "own description (SLURM, Open MPI, TPU pods, GKE) instead of the three flags.")  # fmt: skip
flags.DEFINE_bool("dry_run", False, "Check everything the run needs (flags, directories, data, "
                  "model files, API keys, the initial harness in the sandbox, the retrieval "
                  "server), print the plan, and exit without loading the model.")  # fmt: skip
flags.DEFINE_bool("allow_config_change", False, "Resume even if the config differs from the "
                  "checkpoint's (the differences are logged).")  # fmt: skip
# Data.
flags.DEFINE_string("domain", "arith", "Task domain: a folder of harness/domains (arith, math, "
                    "searchqa, chess) or of --domain_dir.")  # fmt: skip
flags.DEFINE_string("domain_dir", "", "A directory of your own domain folders (docs/domains.md).")
flags.DEFINE_string("data_dir", "", "Real data fetched by `python -m whale_jax.fetch_data`, "
                    "a local directory or gs://bucket/path (staged to this host's disk first; "
                    "empty: the domain's offline tasks).")  # fmt: skip
flags.DEFINE_integer("split_seed", 0, "Seed of the disjoint splits (keyed hash of each task).")
flags.DEFINE_integer("train_size", 0, "Weight-training tasks (0: all that remain).")
flags.DEFINE_integer("search_size", 256, "Harness-search split size (the paper: 256).")
flags.DEFINE_integer("validation_size", 256, "Validation split size (chooses the reported pair).")
flags.DEFINE_integer("test_size", 256, "Test split size for generated/offline domains and chess "
                     "(math tests on AIME 2024+2025, searchqa on its seven sets).")  # fmt: skip
flags.DEFINE_integer("test_per_source", 100, "Searchqa: test tasks per benchmark (0: all).")
flags.DEFINE_integer("arith_difficulty", 1, "Arith level (1: a + b with a, b in 2..30).")
flags.DEFINE_integer("arith_pool", 2000, "Generated problems before splitting (arith, offline "
                     "math).")  # fmt: skip
flags.DEFINE_string("retriever_url", "", "Searchqa: a Search-R1 retrieval server's /retrieve URL "
                    "(empty: BM25 over the corpus in process).")  # fmt: skip
flags.DEFINE_bool("math_verify", False, "Math: accept answers math-verify proves equal.")
flags.DEFINE_enum("judge", "", ["", "openai", "gemini"], "Searchqa: an LLM judge asked when exact "
                  "match fails (temperature 0, 3 tries, exact match when it cannot say).")  # fmt: skip
flags.DEFINE_string("judge_model", "", "Searchqa: the judge's model name.")
flags.DEFINE_string("judge_base_url", "", "Searchqa: the judge's endpoint (empty: the provider's).")
flags.DEFINE_string("judge_api_key_env", "", "Searchqa: the variable holding the judge's API key "
                    "(empty: OPENAI_API_KEY or GEMINI_API_KEY).")  # fmt: skip
# Model, engine, sampling, sandbox.
flags.DEFINE_string("model", "smollm2", "Checkpoint: directory, .gguf, hub id, or smollm2.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Engine weights/activations.")
flags.DEFINE_integer("engine_slots", 64, "Sequences the engine decodes at once, over all its "
                     "devices (a multiple of their number).")  # fmt: skip
flags.DEFINE_integer("engine_devices", 0, "This host's devices the rollouts run on, one engine "
                     "each with its share of the slots and a copy of the weights (0: every "
                     "local device; N: the first N).")  # fmt: skip
flags.DEFINE_integer("max_len", 2048, "Tokens per engine slot (prompt + completion of a call).")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (the paper: 1.0).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling (the paper: 1.0).")
flags.DEFINE_integer("top_k", 20, "Top-k sampling (the paper: 20; 0: off).")
flags.DEFINE_integer("max_new_tokens", 1024, "Default completion length of a model call.")
flags.DEFINE_integer("concurrency", 0, "Episodes in flight (0: twice --engine_slots).")
flags.DEFINE_integer("engine_cache_rows", 0, "Decode states the engine keeps (parked sessions, "
                     "prompt prefixes; each costs a slot's memory). 0: two per episode in "
                     "flight, fewer if they would take over a quarter of the memory left after "
                     "the weights, optimizer state and slots, never fewer than --engine_slots.")  # fmt: skip
flags.DEFINE_integer("engine_steps", 0, "Decode steps per engine call (0: by backend, 8 on "
                     "the CPU, 16 on accelerators).")  # fmt: skip
flags.DEFINE_integer("engine_prefill_batch", 0, "Most prompts one prefill or resume call "
                     "computes (0: by backend, 8 on the CPU, 64 on accelerators).")  # fmt: skip
flags.DEFINE_integer("engine_prompt_mib", 0, "Device memory one prefill or resume call may "
                     "take, in MiB; a batch that would need more goes in smaller calls (0: half "
                     "the memory free once the engine's slots and cache are allocated).")  # fmt: skip
flags.DEFINE_enum("sandbox", "", ["", "strict", "shared_uid", "landlock"], "Sandbox mode "
                  "(empty: $WHALE_SANDBOX or strict); docs/harness.md.")  # fmt: skip
# RSFT.
flags.DEFINE_integer("prompt_batch", 256, "Tasks per RSFT step (the paper: 256).")
flags.DEFINE_integer("samples", 8, "Episodes per task per RSFT step (the paper: 8).")
flags.DEFINE_float("reward_threshold", 0.5, "Keep episodes with reward above this.")
flags.DEFINE_integer(
    "minibatch_episodes", 64, "Kept episodes per optimizer update (the paper: 64)."
)
flags.DEFINE_float("lr", 1e-7, "AdamW learning rate (the paper: 1e-7 for Qwen3.5-2B/4B).")
flags.DEFINE_integer("warmup_steps", 0, "Linear warmup, in optimizer updates.")
flags.DEFINE_enum("lr_schedule", "constant", ["constant", "cosine", "linear"], "After warmup.")
flags.DEFINE_integer("decay_steps", 0, "Cosine/linear schedule length in optimizer updates.")
flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
flags.DEFINE_float("max_grad_norm", 1.0, "Global-norm clipping (0: off).")
flags.DEFINE_integer("seq_len", 2048, "Longest training row, in tokens.")
flags.DEFINE_integer("micro_tokens", 16384, "Token positions per microbatch (accumulation unit).")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Training compute dtype "
                  "(master weights stay fp32).")  # fmt: skip
flags.DEFINE_bool("remat", True, "Rematerialise each layer group in the backward pass.")
# Schedule and method.
flags.DEFINE_enum("method", "whale", list(cfg.METHODS), "whale, weight-only, harness-only, "
                  "fast-slow (prompt-only search), stagewise.")  # fmt: skip
flags.DEFINE_enum("schedule", "fixed", list(cfg.SCHEDULES), "Phase switching: fixed (E, I) or "
                  "adaptive (patience).")  # fmt: skip
flags.DEFINE_float("epochs", 6.0, "Weight-training budget in epochs (math 6, searchqa/chess 4).")
flags.DEFINE_float("weight_epochs", 0.6, "E: weight-phase length in epochs (fixed schedule).")
flags.DEFINE_integer("harness_iterations", 6, "I: iterations per harness phase, the incoming "
                     "harness's evaluation counted (fixed schedule).")  # fmt: skip
flags.DEFINE_float("adaptive_window", 0.2, "Adaptive: reward window W, in epochs.")
flags.DEFINE_float("adaptive_burn_in", 0.2, "Adaptive: burn-in B, in epochs.")
flags.DEFINE_float("adaptive_patience", 0.2, "Adaptive: patience P, in epochs.")
flags.DEFINE_integer(
    "search_min_proposals", 5, "Adaptive harness phase: proposal iterations at least."
)
flags.DEFINE_integer("search_patience", 2, "Adaptive harness phase: iterations without a new best.")
flags.DEFINE_integer(
    "search_max_proposals", 15, "Adaptive harness phase: proposal iterations at most."
)
flags.DEFINE_integer("harness_phases", 0, "Harness-only: phases (0: one phase of "
                     "--harness_budget iterations, as the reference; more: phases of "
                     "--harness_iterations).")  # fmt: skip
flags.DEFINE_integer("harness_budget", 0, "Harness-only and stagewise: iterations of the single "
                     "harness phase, the incoming harness's evaluation counted (the reference: "
                     "40 searchqa and chess, 60 math; 0: every iteration WHALE's fixed schedule "
                     "would make).")  # fmt: skip
# Meta-Harness search.
flags.DEFINE_enum("proposer", "offline", list(cfg.PROPOSERS), "Proposer backend.")
flags.DEFINE_string("proposer_model", "", "Gemini/OpenAI-compatible model name.")
flags.DEFINE_string("proposer_base_url", "", "OpenAI-compatible endpoint (empty: the provider).")
flags.DEFINE_string("proposer_api_key_env", "", "Environment variable with the proposer's key.")
flags.DEFINE_string("proposer_command", "", "Command proposer template ({prompt}/{prompt_file}).")
flags.DEFINE_float("proposer_timeout_s", 1800.0, "Wall-clock budget of one proposal.")
flags.DEFINE_integer("slots", 3, "Candidates per proposal iteration (the paper: 3).")
flags.DEFINE_integer("search_samples", 1, "Episodes per search task (the paper: 1).")
flags.DEFINE_integer("audit_tasks", 4, "Search tasks each stand-in model runs in the audit.")
flags.DEFINE_bool("require_significant", False, "Accept a new harness only when its gain over "
                  "the incoming one is outside sampling noise (paired interval).")  # fmt: skip
flags.DEFINE_enum("search_cost", "turns", ["turns", "tokens", "calls"], "The Pareto frontier's "
                  "cost axis beside success: mean turns (the paper), prompt + completion tokens "
                  "or model calls per episode.")  # fmt: skip
# Evaluation.
flags.DEFINE_integer("eval_samples", 8, "Episodes per task for mean@k (8: mean@8).")
flags.DEFINE_float("eval_every_epochs", 0.1, "Periodic evaluation in weight phases (0: phase "
                   "boundaries only).")  # fmt: skip
flags.DEFINE_bool("eval_test", True, "Evaluate on the test split.")
flags.DEFINE_bool("eval_validation", True, "Evaluate on the validation split.")
# Checkpoints and reporting.
flags.DEFINE_string("checkpoint_dir", "", "Orbax directory, local or gs:// (default: "
                    "<run_dir_mirror>/checkpoints with a mirror, else <run_dir>/checkpoints).")  # fmt: skip
flags.DEFINE_string("run_dir_mirror", "", "Keep a copy of the run directory here (gs://bucket/"
                    "path or a local path), pushed before every checkpoint save and at the end, "
                    "and restored when the local run directory has not started: a run on a VM "
                    "that lost its disk resumes with the same command (docs/loop.md).")  # fmt: skip
flags.DEFINE_integer("checkpoint_keep", 2, "Checkpoints kept: the last N plus validation-best.")
flags.DEFINE_integer("checkpoint_every_steps", 0, "Also save every N RSFT steps (0: off).")
flags.DEFINE_float("checkpoint_every_minutes", 30.0, "Also save after this long since the last "
                  "(0: off).")  # fmt: skip
flags.DEFINE_float("preemption_grace_s", 25.0, "On SIGTERM, save only if a save (as long as "
                   "the last one took) fits in what is left of this grace.")  # fmt: skip
flags.DEFINE_enum("engine_warm_up", "auto", list(cfg.WARM_UPS), "Engine programs compiled "
                  "on --compile_workers background threads as the run starts: recorded (the "
                  "shapes this run met before it stopped, from <run_dir>/engine_shapes.json), "
                  "all (those and every shape the flags allow but the resumes: minutes), off; "
                  "auto: recorded on accelerators, off on the CPU.")  # fmt: skip
flags.DEFINE_integer("compile_workers", 0, "Threads of the engine's warm-up (0: half the "
                     "host's cores, at most 8).")  # fmt: skip
flags.DEFINE_string("compilation_cache_dir", "", "JAX's persistent compilation cache: a resumed "
                    "or repeated run loads compiled programs instead of compiling them again "
                    "(default: <run_dir>/compile_cache; 'none': off).")  # fmt: skip
flags.DEFINE_bool("report", True, "Write the Markdown + PNG report at the end.")
flags.DEFINE_bool("tensorboard", True, "Write TensorBoard event files.")
flags.DEFINE_bool("progress", True, "Progress bars on stderr.")


# Every numeric flag's range (whale_jax/loop/config.py, RANGES), checked as the flags are parsed.
for _flag, _range in cfg.RANGES.items():
    flags.register_validator(_flag, _range.ok, message=_range.describe())


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parse, with bad input ending in exit 2 (as every other bad input does), and
    ``--only_check_args`` checking the whole config before absl exits 0."""
    try:
        args = F(argv)
    except flags.Error as e:
        print(f"error: {e}\nPass --helpfull to see every flag.", file=sys.stderr)
        sys.exit(2)
    if F["only_check_args"].value:
        try:
            config_from_flags()
        except cfg.ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    return args


def config_from_flags(f=F) -> cfg.RunConfig:
    """The frozen run config the flags describe (checked by ``cfg.validate``)."""
    from harness.search.phase import SearchConfig
    from harness.search.validate import ValidationConfig
    from whale_jax.train.rsft import RSFTConfig
    from whale_jax.train.trainer import OptimConfig, TrainConfig

    def built(flags_: tuple[str, ...], make):
        """A part's own config; its ValueError names the field, the message adds its flags."""
        try:
            return make()
        except ValueError as e:
            raise cfg.ConfigError(f"{e} (flags: {', '.join('--' + x for x in flags_)})") from None

    run_dir = f.run_dir or f"runs/{f.domain}-{f.method}-seed{f.seed}"
    # The flags of each part whose own config checks its values (named in its errors).
    rsft_flags = ("prompt_batch", "samples", "reward_threshold", "minibatch_episodes")
    train_flags = ("lr", "warmup_steps", "lr_schedule", "decay_steps", "seq_len",
                   "micro_tokens", "compute_dtype")  # fmt: skip
    search_flags = ("harness_iterations", "slots", "search_samples", "schedule", "search_cost",
                    "search_min_proposals", "search_patience", "search_max_proposals")  # fmt: skip
    config = cfg.RunConfig(
        run_dir=run_dir,
        mirror=f.run_dir_mirror,
        seed=f.seed,
        initial_harness=f.initial_harness,
        data=cfg.DataConfig(
            domain=f.domain, data_dir=f.data_dir, split_seed=f.split_seed,
            train_size=f.train_size, search_size=f.search_size,
            validation_size=f.validation_size, test_size=f.test_size,
            test_per_source=f.test_per_source, arith_difficulty=f.arith_difficulty,
            arith_pool=f.arith_pool, retriever_url=f.retriever_url, math_verify=f.math_verify,
            judge=f.judge, judge_model=f.judge_model, judge_base_url=f.judge_base_url,
            judge_api_key_env=f.judge_api_key_env, domain_dir=f.domain_dir,
        ),
        model=cfg.ModelSettings(
            model=f.model, dtype=f.dtype, engine_slots=f.engine_slots,
            engine_devices=f.engine_devices, max_len=f.max_len,
            temperature=f.temperature, top_p=f.top_p, top_k=f.top_k,
            max_new_tokens=f.max_new_tokens, concurrency=f.concurrency, sandbox=f.sandbox,
            engine_cache_rows=f.engine_cache_rows, engine_warm_up=f.engine_warm_up,
            compile_workers=f.compile_workers, engine_steps=f.engine_steps,
            engine_prefill_batch=f.engine_prefill_batch, engine_prompt_mib=f.engine_prompt_mib,
        ),
        rsft=built(rsft_flags, lambda: RSFTConfig(
            prompt_batch=f.prompt_batch, samples=f.samples, reward_threshold=f.reward_threshold,
            minibatch_episodes=f.minibatch_episodes, seed=f.seed)),
        train=built(train_flags, lambda: TrainConfig(
            optim=OptimConfig(learning_rate=f.lr, warmup_steps=f.warmup_steps,
                              schedule=f.lr_schedule, decay_steps=f.decay_steps,
                              weight_decay=f.weight_decay, max_grad_norm=f.max_grad_norm),
            seq_len=f.seq_len, micro_tokens=f.micro_tokens, compute_dtype=f.compute_dtype,
            remat=f.remat)),
        search=built(search_flags, lambda: SearchConfig(
            iterations=f.harness_iterations, slots=f.slots, samples=f.search_samples,
            require_significant=f.require_significant, cost=f.search_cost,
            validation=ValidationConfig(audit_tasks=f.audit_tasks),
            schedule=f.schedule, min_proposals=f.search_min_proposals,
            patience=f.search_patience, max_proposals=f.search_max_proposals)),
        schedule=cfg.ScheduleConfig(
            method=f.method, schedule=f.schedule, epochs=f.epochs, weight_epochs=f.weight_epochs,
            harness_iterations=f.harness_iterations, window_epochs=f.adaptive_window,
            burn_in_epochs=f.adaptive_burn_in, patience_epochs=f.adaptive_patience,
            harness_phases=f.harness_phases, harness_budget=f.harness_budget,
        ),
        eval=cfg.EvalConfig(samples=f.eval_samples, every_epochs=f.eval_every_epochs,
                            test=f.eval_test, validation=f.eval_validation),
        checkpoint=cfg.CheckpointConfig(
            directory=f.checkpoint_dir, keep=f.checkpoint_keep,
            every_steps=f.checkpoint_every_steps, every_minutes=f.checkpoint_every_minutes,
            preemption_grace_s=f.preemption_grace_s,
        ),
        proposer=cfg.ProposerConfig(
            kind=f.proposer, model=f.proposer_model, base_url=f.proposer_base_url,
            api_key_env=f.proposer_api_key_env, command=f.proposer_command,
            timeout_s=f.proposer_timeout_s,
        ),
        report=f.report,
        tensorboard=f.tensorboard,
        progress=f.progress,
    )  # fmt: skip
    cfg.validate(config)
    return config


def enable_compilation_cache(directory: str, run_dir: str) -> str | None:
    """Points JAX's persistent compilation cache at ``directory`` (default under the run
    directory; 'none': off) before anything compiles, every program included however quick its
    compile: a preempted run restarts without recompiling its engine and train steps."""
    if directory.lower() == "none":
        return None
    import jax

    directory = directory or os.path.join(run_dir, "compile_cache")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def init_hosts(f=F) -> None:
    """Joins the job's other processes before anything touches a device (a no-op alone)."""
    if not (f.coordinator_address or f.distributed):
        if f.num_processes != 1 or f.process_id != 0:
            raise cfg.ConfigError("--num_processes/--process_id: need --coordinator_address")
        return
    import jax

    if f.coordinator_address:
        if f.num_processes < 1 or not 0 <= f.process_id < f.num_processes:
            raise cfg.ConfigError(f"--process_id={f.process_id}: must be in 0 .. "
                                  f"--num_processes - 1 = {f.num_processes - 1}")  # fmt: skip
    # CPU processes exchange collectives through gloo (without it, none across processes); the
    # setting touches only the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if jax.distributed.is_initialized():  # e.g. a caller that joined before main
        return
    if f.coordinator_address:
        jax.distributed.initialize(f.coordinator_address, num_processes=f.num_processes,
                                   process_id=f.process_id)  # fmt: skip
    else:
        jax.distributed.initialize()


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"unexpected arguments {argv[1:]} (flags are --name=value)", file=sys.stderr)
        return 2
    from absl import logging

    from whale_jax.loop.checkpoint import CheckpointMismatch, SaveFailed
    from whale_jax.loop.hosts import PhaseFailed
    from whale_jax.loop.mirror import MirrorError, MirrorRefused
    from whale_jax.loop.preflight import preflight
    from whale_jax.loop.run import PREEMPTED_EXIT, Preempted, run

    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO

    try:
        config = config_from_flags()
        if F.dry_run:
            return dry_run(config, preflight)
        init_hosts()
        enable_compilation_cache(F.compilation_cache_dir, config.run_dir)
        summary = run(config, allow_config_change=F.allow_config_change)
    except (cfg.ConfigError, CheckpointMismatch, MirrorRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (MirrorError, PhaseFailed) as e:
        print(f"error: {e}; the last complete checkpoint stands, rerun to resume", file=sys.stderr)
        return 1
    except Preempted:
        print("stopped by SIGTERM; rerun the same command to resume", file=sys.stderr)
        return PREEMPTED_EXIT
    except SaveFailed as e:
        print(f"error: {e}; the saves before it stand, rerun to resume from the last one",
              file=sys.stderr)  # fmt: skip
        # Orbax's threads of the failed save wait for its signals forever: an exit that joins
        # them would never end (and a supervisor would see a run that is not running).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _print_summary(summary)
    return 0


def dry_run(config: cfg.RunConfig, preflight) -> int:
    """The preflight alone: what it checked and the plan, then exit 0 (a failure raised)."""
    from whale_jax.loop.schedule import phase_list

    checked = preflight(config)
    print("dry run: every check passed; nothing was written and the model was not loaded")
    for line in checked.lines:
        print(f"  {line}")
    phases = phase_list(checked.plan)
    if phases is None:
        print("  phases: weight and harness phases alternate; the adaptive schedule decides "
              "their lengths as the run goes")  # fmt: skip
    else:
        unit = {"weight": "steps", "harness": "iterations"}
        print("  phases: " + ", ".join(f"{kind} {n} {unit.get(kind, '')}".rstrip()
                                       for kind, n in phases))  # fmt: skip
    return 0


def _print_summary(summary: dict) -> None:
    def score(line):
        if not line:
            return "-"
        parts = [f"{k} {line[k]:.3f}" for k in ("test", "validation") if k in line]
        return ", ".join(parts) + f" (step {line['step']}, harness {line['harness']})"

    best = summary.get("best", {})
    print("\n== WHALE run finished ==")
    print(f"run directory:        {summary['run_dir']}")
    print(f"initial pair mean@k:  {score(summary.get('initial'))}")
    print(f"final pair mean@k:    {score(summary.get('final'))}")
    if "test" in best:
        print(f"best test mean@k:     {best['test']:.3f} at {best['test_at']}")
    if best.get("test_at_validation_best") is not None:
        print(f"test at validation-best: {best['test_at_validation_best']:.3f} at "
              f"{best['validation_at']}")  # fmt: skip
    if summary.get("report"):
        print(f"report:               {summary['report']}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
