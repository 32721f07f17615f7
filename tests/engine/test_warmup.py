"""Compiling the engine's programs ahead (``Engine.warm_up``, whale_jax/engine/warmup.py): a warmed
shape runs without a compile, the shape space matches the buckets the engine pads to, a run's
record round-trips through its file, and a record from other flags is skipped."""

from __future__ import annotations

import json
import textwrap
import threading

import jax
import pytest
from jax import monitoring

from tests.conftest import run_on_devices
from tests.engine.test_engine import greedy, prompts_for
from whale_jax.engine import Engine, EngineConfig, Request, warmup

_compiles: list[str] = []
_listening = threading.Event()


def _on_event(event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and _listening.is_set():
        _compiles.append(str(kwargs.get("fun_name", "?")))


monitoring.register_event_duration_secs_listener(_on_event)


def compiled_during(fn):
    """(fn's result, the names of the programs XLA compiled while it ran, in any thread)."""
    _compiles.clear()
    _listening.set()
    try:
        out = fn()
    finally:
        _listening.clear()
    return out, list(_compiles)


CONFIG = EngineConfig(slots=3, max_len=64, steps=4, prefill_batch=2, min_kv_bucket=32,
                      min_kept_tokens=0, cache_rows=12)  # fmt: skip


def workload(engine, vocab):
    """First turns parked, repeats served from the store, second turns resumed: every step."""
    prompts = prompts_for(vocab, lengths=(5, 20, 9, 33, 12), seed=3)
    first = engine.generate([Request(prompt_ids=p, sampling=greedy(5), park=f"s{i}")
                             for i, p in enumerate(prompts)])  # fmt: skip
    again = engine.generate([Request(prompt_ids=p, sampling=greedy(3)) for p in prompts[:2]])
    turns = [p + c.token_ids + (1, 2) for p, c in zip(prompts, first, strict=True)]
    second = engine.generate([Request(prompt_ids=t, sampling=greedy(4), park=f"s{i}")
                              for i, t in enumerate(turns)])  # fmt: skip
    return [c.token_ids for c in first + again + second]


def test_every_shape_the_flags_allow_compiles_ahead(tiny_llama):
    """``everything``: afterwards a workload of every step compiles nothing but its resumes
    (left out of the flags' set: too many), so the shape space holds every bucket the engine
    pads to. The control run, without a warm-up, shows the listener sees the compiles."""
    model, cfg, _ = tiny_llama
    jax.clear_caches()
    with Engine(model, CONFIG, eos_ids=()) as cold:
        want, names = compiled_during(lambda: workload(cold, cfg.vocab_size))
        met = cold.device.signatures
    assert {"jit(_prefill_placed)", "jit(_generate)", "jit(_resume_placed)", "jit(_park)"} <= set(
        names
    )
    assert set(met) == {"prefill", "resume", "insert_stored", "generate", "park"}
    jax.clear_caches()
    with Engine(model, CONFIG, eos_ids=()) as engine:
        space = engine.shape_space()
        for name, sigs in met.items():  # every shape met lies in the space
            assert sigs <= space[name], name
        result = engine.warm_up(everything=True, workers=2)
        planned = sum(len(v) for k, v in space.items() if k != "resume")
        assert result | {"seconds": 0} == {"compiled": planned, "failed": 0, "taken": 0,
                                           "unfit": 0, "left": 0, "seconds": 0}  # fmt: skip
        got, names = compiled_during(lambda: workload(engine, cfg.vocab_size))
        assert got == want  # compiled ahead or as met: the same programs, the same tokens
        assert names and set(names) == {"jit(_resume_placed)"}, names
        # What it met is recorded, not what it warmed: the record is of the run.
        assert engine.shape_record() == engine.device.signatures == met
        assert engine.warm_up(everything=True)["compiled"] == 0  # nothing twice


def test_a_record_warms_exactly_what_the_run_met(tiny_qwen3_5, tmp_path):
    """A hybrid model (Gated DeltaNet states in the prefixes): a run's record, written and read
    back, warms a fresh engine so that the same workload compiles nothing at all."""
    model, cfg, _ = tiny_qwen3_5
    jax.clear_caches()
    with Engine(model, CONFIG, eos_ids=()) as first:
        want = workload(first, cfg.vocab_size)
        record = first.shape_record()
    path = tmp_path / warmup.RECORD_FILE
    warmup.write_record(str(path), record)
    assert warmup.read_record(str(path)) == record
    assert json.loads(path.read_text())["format"] == warmup.FORMAT
    jax.clear_caches()
    with Engine(model, CONFIG, eos_ids=()) as engine:
        result, names = compiled_during(lambda: engine.warm_up(warmup.read_record(str(path))))
        assert result["compiled"] == sum(map(len, record.values())) == len(names)
        assert result["failed"] == result["unfit"] == 0
        got, names = compiled_during(lambda: workload(engine, cfg.vocab_size))
        assert names == [] and got == want
        assert engine.shape_record() == record  # met again, by the calls (not the warm-up)


def test_a_record_from_other_flags_is_skipped(tiny_llama):
    """Shapes this configuration cannot meet (other slots, a length that is no bucket, a step
    that does not exist) are counted and never compiled."""
    model, _, _ = tiny_llama
    with Engine(model, CONFIG, eos_ids=()) as engine:
        record = {"generate": [[3, 32], [4, 32], [3, 40]], "prefill": [[[2, 20]]],
                  "no_such_step": [[1]]}  # fmt: skip
        result = engine.warm_up(record, workers=1)
        assert (result["compiled"], result["unfit"], result["failed"]) == (1, 4, 0)
        assert engine.shape_record() == {}  # compiled ahead, not met


def test_a_failing_compile_is_counted_not_raised(tiny_llama):
    model, _, _ = tiny_llama
    with Engine(model, CONFIG, eos_ids=()) as engine:
        dev = engine.device
        done = []
        handle = warmup.WarmUp([(dev, "generate", (3, 32)), (dev, "no_such_step", (1,))],
                               workers=2, on_done=done.append)  # fmt: skip
        counts = handle.result()
        assert (counts["compiled"], counts["failed"], counts["left"]) == (1, 1, 0)
        assert [d | {"seconds": 0} for d in done] == [counts | {"seconds": 0}]


STEPS = {"jit(_prefill_placed)", "jit(_resume_placed)", "jit(_insert_stored)", "jit(_generate)",
         "jit(_park)"}  # fmt: skip


def test_a_background_warm_up_never_compiles_a_shape_twice(tiny_llama):
    """Requests come while the warm-up runs (as in a run: the executor starts meanwhile): each
    shape is compiled once, by the warm-up or (queued there still) by the engine; same tokens."""
    model, cfg, _ = tiny_llama
    with Engine(model, CONFIG, eos_ids=()) as first:
        want = workload(first, cfg.vocab_size)
        record = first.shape_record()
    jax.clear_caches()
    with Engine(model, CONFIG, eos_ids=()) as engine:

        def both():
            handle = engine.warm_up(record, workers=1, background=True)
            return workload(engine, cfg.vocab_size), handle.result()

        (got, counts), names = compiled_during(both)
        assert got == want
        total = sum(map(len, record.values()))
        assert counts["compiled"] + counts["taken"] == total and counts["failed"] == 0
        steps = [n for n in names if n in STEPS]
        assert len(steps) == total, (counts, sorted(steps))  # each shape once


def test_a_step_takes_over_a_queued_compile_and_waits_for_a_running_one(tiny_llama):
    """``DeviceEngine.note``, the engine's side of a warm-up: a compile not started yet is
    dropped (the step's call compiles the shape itself); one under way is waited for."""
    from concurrent.futures import Future

    model, _, _ = tiny_llama
    with Engine(model, CONFIG, eos_ids=()) as engine:
        dev = engine.device
        queued, running = Future(), Future()
        running.set_running_or_notify_cancel()
        dev.ahead[("generate", (3, 32))] = queued
        dev.ahead[("generate", (3, 48))] = running
        dev.note("generate", 3, 32)
        assert queued.cancelled()
        waiter = threading.Thread(target=dev.note, args=("generate", 3, 48))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # waiting for the warm-up's compile
        running.set_result(True)
        waiter.join(10)
        assert not waiter.is_alive()
        assert dev.signatures["generate"] == {(3, 32), (3, 48)}


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{", "not a shape record"),
        ('{"format": 2, "shapes": {}}', "expected {'format': 1"),
        ('{"format": 1, "shapes": []}', "'shapes' must map"),
        ('{"format": 1, "shapes": {"generate": 3}}', "shapes['generate'] must be a list"),
        ('{"format": 1, "shapes": {"generate": [[3, "32"]]}}', "shapes['generate']: a shape"),
        ('{"format": 1, "shapes": {"generate": [[3, true]]}}', "shapes['generate']: a shape"),
    ],
)
def test_a_bad_record_names_its_file(tmp_path, text, problem):
    path = tmp_path / "engine_shapes.json"
    path.write_text(text)
    with pytest.raises(warmup.RecordError, match="engine_shapes.json") as e:
        warmup.read_record(str(path))
    assert problem in str(e.value)


def test_no_record_is_none(tmp_path):
    assert warmup.read_record(str(tmp_path / "absent.json")) is None


POOL_SCRIPT = textwrap.dedent(
    """
    import jax
    from jax import monitoring
    from whale_jax import load_model
    from whale_jax.engine import EngineConfig, Request, Sampling
    from whale_jax.engine.pool import EnginePool
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda e, s, **kw: compiles.append(kw.get("fun_name"))
        if e == "/jax/core/compile/backend_compile_duration" else None)
    model = load_model("tests/fixtures/tiny_llama").model
    config = EngineConfig(slots=4, max_len=64, steps=4, min_kv_bucket=32, cache_rows=8,
                          min_kept_tokens=0)
    reqs = [Request(prompt_ids=(3 + i, 9, 20, 31, 7) * (1 + i), identity=(i,),
                    sampling=Sampling(temperature=0.0, max_new_tokens=5), park=f"s{i}")
            for i in range(6)]
    with EnginePool(model, config, jax.local_devices()) as pool:
        want = [c.token_ids for c in pool.generate(reqs)]
        record = pool.shape_record()
    jax.clear_caches()
    with EnginePool(model, config, jax.local_devices()) as pool:
        result = pool.warm_up(record, workers=2)
        # A program per device: each engine compiles its own.
        assert result["compiled"] == 2 * sum(map(len, record.values())), (result, record)
        compiles.clear()
        got = [c.token_ids for c in pool.generate(reqs)]
        assert got == want and compiles == [], compiles
        assert pool.shape_record() == record
    print("POOL WARM OK")
    """
)


def test_a_pool_warms_every_device():
    assert "POOL WARM OK" in run_on_devices(POOL_SCRIPT, devices=2).stdout


def test_the_runs_warm_up_reads_its_record(tiny_llama, tmp_path):
    """whale_jax.loop.build.warm_up, as a run starts: "auto" is off on the CPU; "recorded"
    warms the run directory's record in the background and says when it is done; a record that
    cannot be read is named, and the run goes on without it."""
    from whale_jax.loop.build import warm_up

    model, _, _ = tiny_llama
    lines = []
    with Engine(model, CONFIG, eos_ids=()) as engine:
        assert warm_up(engine, str(tmp_path), "recorded", 1, lines.append) is None  # no record
        warmup.write_record(str(tmp_path / warmup.RECORD_FILE), {"generate": {(3, 32), (9, 32)}})
        assert warm_up(engine, str(tmp_path), "auto", 1, lines.append) is None  # the CPU
        assert warm_up(engine, str(tmp_path), "off", 1, lines.append) is None
        assert lines == []
        handle = warm_up(engine, str(tmp_path), "recorded", 1, lines.append)
        counts = handle.result()
        assert (counts["compiled"], counts["unfit"]) == (1, 1)
        assert lines[0].startswith("engine warm-up: compiling the 2 shapes this run met before")
        assert "1 programs ready" in lines[-1] and "1 recorded shapes do not fit" in lines[-1]
        (tmp_path / warmup.RECORD_FILE).write_text("{")
        lines.clear()
        assert warm_up(engine, str(tmp_path), "recorded", 1, lines.append) is None
        assert warmup.RECORD_FILE in lines[0] and "not a shape record" in lines[0]


def test_the_runs_record_only_grows_and_a_failed_write_is_reported(tiny_llama, tmp_path):
    """whale_jax.loop.saving.save_shape_record: the engine's shapes are added to the file (a
    start that met fewer loses nothing); a bad file is replaced; a write that fails is said,
    never raised (a checkpoint save must not stop for it), and leaves no temporary file."""
    import types

    from whale_jax.loop.saving import save_shape_record

    model, cfg, _ = tiny_llama
    path = tmp_path / warmup.RECORD_FILE
    lines = []
    with Engine(model, CONFIG, eos_ids=()) as engine:
        engine.generate([Request(prompt_ids=(1, 2, 3), sampling=greedy(2))])
        run = types.SimpleNamespace(root=str(tmp_path), client=types.SimpleNamespace(engine=engine),
                                    say=lines.append)  # fmt: skip
        path.write_text("{")  # unreadable: replaced
        save_shape_record(run)
        met = engine.shape_record()
        assert warmup.read_record(str(path)) == met
        warmup.write_record(str(path), {"generate": {(3, 48)}})  # an earlier start's
        save_shape_record(run)
        assert warmup.read_record(str(path)) == warmup.merge(met, {"generate": {(3, 48)}})
        path.unlink()
        path.mkdir()  # cannot be written
        save_shape_record(run)
        assert len(lines) == 1 and "could not write the engine's shapes" in lines[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == [warmup.RECORD_FILE]


def test_a_merged_record_drops_steps_the_engine_no_longer_has():
    """An older engine recorded its keep and insert calls as steps of their own ("store_put",
    "insert"); they now run inside prefill and resume, so a run's file sheds them at its next
    save instead of reporting them as unfit at every start."""
    old = {"prefill": {((2, 16),)}, "insert": {(2, 16, 3)}, "store_put": {(2, 16, 2)}}
    assert warmup.merge(old, {"generate": {(3, 32)}}) == {"prefill": {((2, 16),)},
                                                         "generate": {(3, 32)}}  # fmt: skip
