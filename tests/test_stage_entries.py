"""The stages' entry functions on a hand-made finished pipeline (tests/handmade.py), in seconds: what `dvc repro` runs
for compare, memory-report, admit, evaluate and audit writes what the next stage reads. The whole pipeline runs them
for real in tests/test_pipeline_e2e.py (the slow tier); these keep them in the quick one."""

from __future__ import annotations

import contextlib
import json

import pytest

from pipelines import admit, audit, compare, evaluate, memory_report
from pipelines.core import plots as core_plots
from pipelines.core.io import read_json, read_jsonl, write_json
from pipelines.evaluation import console
from pipelines.judging import plots
from tests.handmade import correctness, measured_memory, write_pipeline

N = 200


@pytest.fixture()
def finished(tmp_path):
    """fp16; int8 one flip away; awq4 losing 40 math items: compare and route done, dvc.lock written."""
    built = write_pipeline(tmp_path, {"fp16": {d: correctness(N, 150) for d in ("math", "code")},
                                      "int8": {d: correctness(N, 150, lose=1) for d in ("math", "code")},
                                      "awq4": {"math": correctness(N, 150, lose=40), "code": correctness(N, 150)}})
    with contextlib.chdir(tmp_path):
        yield tmp_path, built


def verdicts(report: dict) -> dict:
    return {(name, domain): row["verdict"]
            for name, v in report["variants"].items() for domain, row in v["domains"].items()}


def test_compare_writes_the_verdicts_the_judging_gives_with_its_table_summary_and_charts(finished):
    root, built = finished
    assert compare.main() == 0
    report = read_json(root / "results/compare.json")
    assert verdicts(report) == verdicts(built["report"])
    assert verdicts(report)[("awq4", "math")] == "fail" and verdicts(report)[("int8", "code")] != "fail"
    assert report["dvc_lock_sha256"] == built["report"]["dvc_lock_sha256"]  # what the gate checks the results against
    table = (root / "results/compare.csv").read_text().splitlines()
    assert len(table) == 1 + 4 and table[0].startswith("variant,")  # a row per variant and request type
    summary = read_json(root / "results/summary.json")  # DVC's metrics
    assert summary["verdict"] == {"int8": {"math": "pass", "code": "pass"}, "awq4": {"math": "fail", "code": "pass"}}
    differences = read_json(root / "results/plots/differences.json")
    assert {d["row"] for d in differences} == {"int8 math", "int8 code", "awq4 math", "awq4 code"}
    drawn = plots.plot_all(report, root / "again")
    assert len(drawn) == 3 and all(p.read_bytes()[:4] == b"\x89PNG" for p in drawn)


def test_memory_report_summarizes_what_each_variant_measured_and_names_a_missing_one(finished):
    root, _ = finished

    write_json(root / "results/memory/fp16.json", measured_memory(100_000, 0.0, rounds=12))
    write_json(root / "results/memory/int8.json", measured_memory(60_000, 0.0, rounds=12))
    assert memory_report.main() == 0
    rows = read_json(root / "results/memory_summary.json")["variants"]
    assert rows["int8"]["status"] == "ok" and rows["int8"]["footprint_saving_pct"] == pytest.approx(40.0)
    assert rows["awq4"] == {"status": "failed", "error": "results/memory/awq4.json missing"}
    charts = ("memory_over_rounds.png", "peak_vs_length.png")
    assert all((root / "results/plots" / png).read_bytes()[:4] == b"\x89PNG" for png in charts)


def test_admit_records_a_rejected_or_dead_candidate_as_its_failure_and_succeeds(finished):
    root, _ = finished
    params = (root / "params.yaml").read_text().replace("candidates: {}", "candidates:\n  vendor: {path: vendor}")
    (root / "params.yaml").write_text(params)
    (root / "vendor").mkdir()
    (root / "vendor" / "config.json").write_text("{}")
    (root / "model").mkdir()  # the base model the candidate is checked against (params' default `model`)
    assert admit.main("vendor") == 0
    manifest = read_json(root / "models/variants/vendor/quantgate.json")
    assert manifest["status"] == "failed" and manifest["validation"]["reasons"], manifest
    assert admit.main("vendor", failed_because="the Ray worker died") == 0  # as `quantgate fanout` records it
    manifest = read_json(root / "models/variants/vendor/quantgate.json")
    assert manifest["status"] == "failed" and "the Ray worker died" in json.dumps(manifest)


def test_evaluate_copies_fp16s_records_and_records_a_dead_variant_as_failed(finished):
    root, _ = finished
    (root / "results/eval/fp16.json").rename(root / "results/eval.json")
    baseline = root / "results/baseline"
    baseline.mkdir(parents=True)
    (root / "results/eval.json").rename(baseline / "eval.json")
    (root / "results/eval/fp16/items.jsonl").rename(baseline / "items.jsonl")
    (baseline / "fidelity.jsonl").write_text('{"text": "x"}\n')
    assert evaluate.main("fp16") == 0
    assert read_jsonl(root / "results/eval/fp16/items.jsonl") == read_jsonl(baseline / "items.jsonl")
    assert read_json(root / "results/eval/fp16.json") == read_json(baseline / "eval.json")
    assert evaluate.main("int8", failed_because="killed by the OOM killer") == 0
    failed = read_json(root / "results/eval/int8.json")
    assert failed["status"] == "failed" and failed["error"] == "killed by the OOM killer"
    assert read_jsonl(root / "results/eval/int8/items.jsonl") == []
    result = {"status": "ok", "probes": {}, "fidelity": {"math": {"per_text": [{"text": "a"}], "kl": {"mean": 0.1}},
                                                         "code": {"per_text": [{"text": "b"}]}}}
    assert console.pop_texts(result) == [{"text": "a"}, {"text": "b"}]  # into fidelity.jsonl, out of <variant>.json
    assert result["fidelity"] == {"math": {"kl": {"mean": 0.1}}, "code": {}}


def test_audit_refuses_a_workspace_that_differs_from_dvc_lock_and_says_so(finished, capsys):
    root, _ = finished
    items = root / "results/eval/int8/items.jsonl"
    items.write_text(items.read_text().replace('"correct": false', '"correct": true', 1))
    assert audit.main(seed=7) == 2
    said = capsys.readouterr().out
    assert "seed 7" in said and "REFUSED (exit 2)" in said and "results/eval" in said
    assert read_json(root / "results/audit.json")["verdict"] == "refused"


def test_a_chart_is_written_whole_or_not_at_all(tmp_path):
    path = core_plots.grouped_bars(tmp_path / "c.png", ["math", "code"], {"int8": [0.9, 0.8]}, "agreement", "share")
    before = path.read_bytes()
    fig, _ = core_plots.plt.subplots()

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    fig.savefig = disk_full
    with pytest.raises(OSError, match="No space left"):
        core_plots.save(fig, path)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]  # no half chart, no temp file left
    assert core_plots.plt.get_fignums() == []  # and no figure left open
