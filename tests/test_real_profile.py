"""benchmarks/real_profile.py's bookkeeping (the run itself is a benchmark, never a test): which rows differ between
a fanned-out and a sequential run, and the docs showing that comparison only beside the runs it was made with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import real_profile  # noqa: E402
from pipelines.core.paths import PROFILE_MARKER  # noqa: E402
from scripts.docsgen.measured_blocks import render_real_profile  # noqa: E402
from scripts.docsgen.sources import Context  # noqa: E402


def run_folder(where: Path, commit: str, verdict: str, serve: str) -> Path:
    """A workspace as a run leaves it: its marker, compare.json and routing_table.json."""
    (where / "results").mkdir(parents=True)
    (where / PROFILE_MARKER).write_text(json.dumps({"synced_from": {"commit": commit, "dirty": False}}))
    (where / "results/compare.json").write_text(json.dumps({"variants": {"int8": {"domains": {"math": {
        "verdict": verdict, "paired": {"items": 200, "difference": 0.01, "ci_low": -0.02}}}}}}))
    (where / "results/routing_table.json").write_text(json.dumps({"rows": [{
        "domain": "math", "max_context_tokens": 256, "serve": serve, "fallback_under_memory_pressure": "fp16",
        "considered": [{"variant": "int8", "verdict": verdict}]}]}))
    return where


def test_the_rows_that_differ_are_named_and_a_run_stopped_part_way_is_no_crash(tmp_path):
    fan = run_folder(tmp_path / "fanned-out/smollm2", "a" * 40, "pass", "int8")
    seq = run_folder(tmp_path / "sequential/smollm2", "b" * 40, "fail", "fp16")
    numbers: dict = {}
    real_profile.compare_runs(seq, fan, numbers)
    assert numbers["differs_from_other_mode"] == {"other": "fanned-out", "other_commit": "aaaaaaa",
                                                  "rows": ["int8 math", "math 256"]}
    (fan / "results/routing_table.json").unlink()  # the other run stopped before route
    real_profile.compare_runs(seq, fan, numbers)
    assert "routing_table.json" in numbers["differs_from_other_mode"]["error"]
    numbers = {}
    real_profile.compare_runs(seq, tmp_path / "no-such-run/smollm2", numbers)
    assert numbers == {}


def measured(root: Path, name: str, commit: str, results: dict) -> None:
    (root / "docs/measured").mkdir(parents=True, exist_ok=True)
    (root / f"docs/measured/{name}.json").write_text(json.dumps({"date": "2026-12-03", "command": "x", "commit": commit,
                                                                 "results": results}))


def test_the_docs_show_a_comparison_only_beside_the_run_it_was_made_with(tmp_path):
    fanned = {"profile": "smollm2", "goal_minutes": 45.0, "fresh_minutes": 44.0, "fresh_parallel": True, "gate_exit": 1}
    measured(tmp_path, "real_profile", "aaaaaaa", fanned)
    seq = {"profile": "smollm2", "sequential_minutes": 75.0,
           "differs_from_other_mode": {"other": "fanned-out", "other_commit": "aaaaaaa", "rows": ["int8 math"]}}
    measured(tmp_path, "real_profile_sequential", "bbbbbbb", seq)
    text = "\n".join(render_real_profile(Context(tmp_path), "", []))
    assert "75.0 min" in text and "| verdict and routing rows that differ, fanned out vs sequential | int8 math |" in text
    measured(tmp_path, "real_profile", "ccccccc", fanned)  # the fanned-out run made again: the comparison is stale
    text = "\n".join(render_real_profile(Context(tmp_path), "", []))
    assert "75.0 min" in text and "differ" not in text


def test_the_compressed_tensors_run_is_tabled_per_model_with_what_it_serves(tmp_path):
    """--ct-candidates: each model's verdicts with KL, its footprint against theory, what it holds once its weights
    are unpacked (only where that differs), and the routing rows it serves."""
    run = run_folder(tmp_path / "ct/smollm2", "a" * 40, "pass", "int8")
    (run / "results/compare.json").write_text(json.dumps({"variants": {
        "int8": {"kind": "variant", "domains": {"math": {"verdict": "pass", "fidelity": {"kl": {"mean": 0.0123}}}}},
        "fp8-dynamic": {"kind": "candidate", "domains": {"math": {"verdict": "inconclusive", "fidelity": None}}}}}))
    (run / "results/memory_summary.json").write_text(json.dumps({"variants": {
        "int8": {"footprint_bytes": 1000, "theoretical_weight_bytes": 990},
        "fp8-dynamic": {"footprint_bytes": 700, "theoretical_weight_bytes": 700, "serving_tensor_bytes": 1300}}}))
    header, rows = real_profile.ct_table(real_profile.ct_rows(run))
    assert header == ["model", "math: verdict (KL mean)", "footprint (tensor bytes)", "theory",
                      "held after the first forward", "routed (type@tokens)"]
    assert rows == [["int8 (variant)", "pass (0.012)", "1,000", "990", "same", "math@256"],
                    ["fp8-dynamic (candidate)", "inconclusive", "700", "700", "1,300", "none"]]
