"""Memory stage on the tests' tiny model, on a CPU: footprints, KV slope, the leak detector, the summary."""

from __future__ import annotations

import json
import time

import pytest

from pipelines import memory
from pipelines.core.isolation import run_isolated
from pipelines.core.params_sections import MemoryParams
from pipelines.measure import growth, phases, plots, probes, verdict
from tests.handmade import measured_memory

# trace_rounds=0: the tracer that explains a leak (memray, a third of a leaking soak's time) runs in the deliberate leak's
# test here and in tests/test_memory_attribution.py
FAST = MemoryParams(seq_fractions=[0.25, 0.5, 1.0], warmup_rounds=1, rounds=10, max_rounds=24, tail_rounds=6,
                    alternations=2, burst_size=2, trace_rounds=0)


# the soaks on the tiny variants, measured once for the content they depend on (tests/content_cache.py): each clean
# variant, and the injected leaks the tests below judge
LEAKS = {"traced": {"variant": "fp16", "leak_bytes_per_round": 4 << 20, "trace": True},
         "small": {"variant": "int8", "leak_bytes_per_round": 64 << 10},
         "warm_up": {"variant": "int8", "leak_bytes_per_round": 64 << 10, "leak_rounds": 8}}


@pytest.fixture(scope="module")
def soaks(tiny_variants, tmp_path_factory):
    from tests.content_cache import cached

    def build(_folder) -> dict:
        out = {name: memory.measure_isolated(str(path), FAST, "cpu") for name, path in tiny_variants.items()}
        for name, leak in LEAKS.items():
            # with the tracer (24 rounds, the default) where it says so: a leak the growth rule flags, the tracer confirms
            p = FAST.model_copy(update={"trace_rounds": MemoryParams().trace_rounds}) if leak.get("trace") else FAST
            out[name] = memory.measure_isolated(str(tiny_variants[leak["variant"]]), p, "cpu",
                                                leak_bytes_per_round=leak["leak_bytes_per_round"],
                                                leak_rounds=leak.get("leak_rounds"))
        return out

    return cached(tmp_path_factory, "memory_soaks", build, code=["memory"], helpers=["tests/test_memory.py"],
                  inputs=[next(iter(tiny_variants.values())).parent], settings=[FAST.model_dump(), LEAKS])


@pytest.fixture(scope="module")
def measured(soaks, tiny_variants):
    return {name: soaks[name] for name in tiny_variants}


def test_every_variant_measured_with_the_same_shape(measured):
    shapes = set()
    for name, r in measured.items():
        assert r["status"] == "ok", r.get("error")
        assert r["device"] == "cpu" and "mallinfo2" in r["method"]
        assert FAST.rounds <= len(r["soak"]["rounds"]) <= FAST.max_rounds and len(r["sweep"]["lengths"]) == 3
        shapes.add(tuple(sorted(r["load"]["after"])))
    assert len(shapes) == 1


def test_footprints_ordered_as_the_bit_widths_predict(measured):
    fp = {n: r["load"]["footprint_bytes"] for n, r in measured.items()}
    assert fp["fp16"] > fp["int8"] > fp["awq4"] > fp["gptq3"], fp
    for r in measured.values():  # tensor bytes held vs the manifest's theory
        assert abs(r["load"]["tensor_bytes"] - r["load"]["theoretical_weight_bytes"]) / r["load"]["tensor_bytes"] < 0.05


def test_kv_slope_within_a_factor_of_theory(measured):
    sweep = measured["fp16"]["sweep"]
    theory = sweep["theoretical_kv_bytes_per_token"]
    assert theory == 2 * 1 * 2 * 32 * 2  # K and V, 1 layer, 2 KV heads, head_dim 32, fp16
    assert sweep["kv_cache_bytes_per_token"] == pytest.approx(theory)
    assert theory / 2 <= sweep["fitted_bytes_per_token"] <= theory * 2  # heap bytes held after prefill


def test_clean_workload_is_not_a_leak(measured):
    for name, r in measured.items():
        assert r["leak"]["leak"] is False, (name, r["leak"]["reason"])


def test_deliberate_leak_is_flagged(soaks):
    r = soaks["traced"]
    assert r["leak"]["leak"] is True
    assert r["soak"]["growth_bytes_per_round"] == pytest.approx(4 << 20, rel=0.1)
    assert len(r["soak"]["rounds"]) == FAST.max_rounds  # it kept growing, so the soak ran as long as allowed
    assert r["soak"]["warmup_end_round"] is None


def test_a_small_leak_that_keeps_growing_to_the_last_round_is_flagged(soaks):
    """64 KiB a round: a fraction of a percent of an fp16 7B model a day, on the tiny model's 200 KB a leak."""
    r = soaks["small"]
    assert r["leak"]["leak"] is True and r["leak"]["growth_bytes_per_round"] == pytest.approx(64 << 10, rel=0.2)


def test_warm_up_that_plateaus_is_not_growth(soaks):
    """The int8 pattern on the reference model: growth for a number of rounds, then flat (caches filling)."""
    r = soaks["warm_up"]
    assert r["leak"]["leak"] is False, r["leak"]["reason"]
    assert r["soak"]["growth_last_minus_first"] >= 6 * (64 << 10)  # it did grow during the warm-up ...
    assert r["leak"]["growth_bytes_per_round"] == 0  # ... and then settled
    assert 6 <= r["soak"]["warmup_end_round"] <= 10 and len(r["soak"]["rounds"]) >= r["soak"]["warmup_end_round"] + 6
    summary = verdict.summarize({"fp16": soaks["fp16"], "int8": r}, FAST)
    assert summary["variants"]["int8"]["growth_excess_pct"] == 0


def test_out_of_memory_in_a_phase_is_recorded_with_the_phase(tiny_variants):
    """An allocation that fails at the longest length: torch's own CPU allocator error, caught as an OOM."""
    import torch

    from pipelines.models.loading import load_variant

    model, _ = load_variant(tiny_variants["fp16"])
    real_forward = model.forward

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 200:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 1099511627776 bytes")
        return real_forward(*args, **kwargs)

    model.forward = forward
    probe = probes.make_probe("cpu")
    try:
        swept = phases.sweep(model, probe, [64, 256, 512], 4, model.config.vocab_size, "cpu", 2)
        soaked = phases.soak(model, probe, FAST, 512, model.config.vocab_size, "cpu")
    finally:
        probe.close()
    assert [bool(row.get("oom")) for row in swept["lengths"]] == [False, True, True]
    assert soaked["oom"].startswith("soak round 0: RuntimeError")
    swept["theoretical_kv_bytes_per_token"] = 128
    result = {"status": "ok", "device": "cpu", "load": {"footprint_bytes": 1000, "theoretical_weight_bytes": 1000},
              "sweep": swept, "soak": soaked, "leak": {"leak": None}}
    row = verdict.summarize({"fp16": result}, FAST)["variants"]["fp16"]
    assert row["oom"].startswith("sweep at 256 tokens: RuntimeError") and "soak round 0" in row["oom"]
    assert not phases.is_oom(RuntimeError("shape mismatch")) and phases.is_oom(torch.OutOfMemoryError("CUDA"))


def segfault() -> dict:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a broken kernel would
    return {}


def test_a_worker_that_dies_or_hangs_is_a_recorded_failure(tiny_variants):
    """A segfault in the isolated process ends as a failure naming the signal; a hang as a timeout."""
    result, error = run_isolated(segfault, (), 60, "the test worker")
    assert result is None and error == "the test worker died (killed by SIGSEGV)"
    result, error = run_isolated(time.sleep, (30,), 1, "the test worker")
    assert result is None and error == "the test worker ran past its 1 s timeout and was killed"
    slow = memory.measure_isolated(str(tiny_variants["fp16"]), FAST.model_copy(update={"timeout_seconds": 1}), "cpu")
    assert slow["status"] == "failed" and "timeout and was killed" in slow["error"]


def test_failed_variant_is_recorded(tmp_path):
    (tmp_path / "gptq3").mkdir()
    (tmp_path / "gptq3" / "quantgate.json").write_text(json.dumps(
        {"variant": "gptq3", "status": "failed", "error": "ValueError: boom"}))
    r = memory.measure_isolated(str(tmp_path / "gptq3"), FAST, "cpu")
    assert r["status"] == "failed" and "gptq3 is not usable: ValueError: boom" in r["error"]


def test_summary_sets_growth_against_fp16(tmp_path):
    p = MemoryParams(rounds=10)

    result = measured_memory  # no rounds: the summary reads the fitted growth, not the rounds
    summary = verdict.summarize({"fp16": result(100_000, 50), "gptq3": result(40_000, 500),
                                "int8": {"status": "failed", "error": "x"}}, p)
    # (500 - 50) B/round x 10 rounds / fp16's 100 kB
    assert summary["variants"]["gptq3"]["growth_excess_pct"] == pytest.approx(4.5)
    assert summary["variants"]["gptq3"]["growth_bytes_per_request"] == pytest.approx(500 / 8)
    assert summary["variants"]["gptq3"]["footprint_saving_pct"] == pytest.approx(60.0)
    assert summary["variants"]["int8"] == {"status": "failed", "error": "x"}
    no_base = verdict.summarize({"gptq3": result(400, 50)}, p)
    assert no_base["baseline_ok"] is False and no_base["variants"]["gptq3"]["growth_excess_pct"] is None
    pngs = plots.plot_all({"fp16": result(1000, 10)}, tmp_path)
    assert growth.warmup_end([0, 10, 20, 30, 31, 31, 30, 31, 31, 32, 31, 31], tail=4, floor=2) == 3
    assert growth.warmup_end([0, 10, 20, 30, 40, 50, 60, 70], tail=4, floor=2) is None
    assert growth.warmup_end([5, 4, 6, 5, 5, 4, 6], tail=4, floor=2) == 0
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_a_progress_bars_monitor_thread_is_stopped_before_the_soak_and_stays_stopped():
    """tqdm's monitor wakes every 10 s and allocates between soak rounds: measure() stops it before the rounds."""
    import io
    import threading

    import tqdm

    def monitors():
        return [t for t in threading.enumerate() if isinstance(t, tqdm.std.TMonitor) and t.is_alive()]

    interval = tqdm.tqdm.monitor_interval
    try:
        for _ in tqdm.tqdm(range(2), file=io.StringIO()):
            pass
        assert monitors()  # a bar started one, as a library's bar does in the measuring process
        memory.stop_progress_monitor()
        assert not monitors()
        for _ in tqdm.tqdm(range(2), file=io.StringIO()):  # a bar made during the rounds starts none
            pass
        assert not monitors()
    finally:
        tqdm.tqdm.monitor_interval, tqdm.tqdm.monitor = interval, None
