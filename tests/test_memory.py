"""Memory stage on the tests' tiny model, on a CPU: footprints, KV slope, the leak detector, the summary."""

from __future__ import annotations

import json

import pytest

from pipelines import memory
from pipelines.params import MemoryParams

FAST = MemoryParams(seq_fractions=[0.25, 0.5, 1.0], warmup_rounds=1, rounds=10, alternations=2, burst_size=2)


@pytest.fixture(scope="module")
def measured(tiny_variants):
    return {name: memory.measure_isolated(str(path), FAST, "cpu") for name, path in tiny_variants.items()}


def test_every_variant_measured_with_the_same_shape(measured):
    shapes = set()
    for name, r in measured.items():
        assert r["status"] == "ok", r.get("error")
        assert r["device"] == "cpu" and "mallinfo2" in r["method"]
        assert len(r["soak"]["rounds"]) == 10 and len(r["sweep"]["lengths"]) == 3
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


def test_deliberate_leak_is_flagged(tiny_variants):
    r = memory.measure_isolated(str(tiny_variants["fp16"]), FAST, "cpu", leak_bytes_per_round=4 << 20)
    assert r["leak"]["leak"] is True
    assert r["soak"]["growth_bytes_per_round"] == pytest.approx(4 << 20, rel=0.1)
    assert r["soak"]["growth_last_minus_first"] >= 9 * (4 << 20)


def test_failed_variant_is_recorded(tmp_path):
    (tmp_path / "gptq3").mkdir()
    (tmp_path / "gptq3" / "quantgate.json").write_text(json.dumps(
        {"variant": "gptq3", "status": "failed", "error": "ValueError: boom"}))
    r = memory.measure_isolated(str(tmp_path / "gptq3"), FAST, "cpu")
    assert r["status"] == "failed" and "gptq3 is not usable: ValueError: boom" in r["error"]


def test_summary_sets_growth_against_fp16(tmp_path):
    def result(footprint, growth):
        return {"status": "ok", "device": "cpu", "load": {"footprint_bytes": footprint, "theoretical_weight_bytes": 1},
                "sweep": {"lengths": [{"tokens": 8, "decode_peak_increase": 5}], "fitted_bytes_per_token": 1.0,
                          "theoretical_kv_bytes_per_token": 1},
                "soak": {"growth_bytes_per_round": growth / 9, "fragmentation": {"one_minus_allocated_over_reserved": 0.1},
                         "rounds": [], "signal": "allocated"},
                "leak": {"leak": False, "projected_growth_bytes": growth}}

    summary = memory.summarize({"fp16": result(1000, 10), "gptq3": result(400, 50), "int8": {"status": "failed",
                                                                                              "error": "x"}})
    assert summary["variants"]["gptq3"]["growth_excess_pct"] == pytest.approx(4.0)  # (50 - 10) / 1000
    assert summary["variants"]["gptq3"]["footprint_saving_pct"] == pytest.approx(60.0)
    assert summary["variants"]["int8"] == {"status": "failed", "error": "x"}
    no_base = memory.summarize({"gptq3": result(400, 50)})
    assert no_base["baseline_ok"] is False and no_base["variants"]["gptq3"]["growth_excess_pct"] is None
    pngs = memory.plot_all({"fp16": result(1000, 10)}, tmp_path)
    assert all(p.stat().st_size > 1000 for p in pngs)
