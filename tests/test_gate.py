"""`quantgate gate`: exit codes for pass, fail, NaN metric, missing baseline, a crash; promotion in the registry."""

from __future__ import annotations

import json
import math

import pytest
from mlflow import MlflowClient

from pipelines import cli, gate, record
from pipelines.io import read_json, write_json
from tests.handmade import correctness, write_pipeline

N = 400
GOOD = {d: correctness(N, 300, lose=1) for d in ("math", "code")}


def answers(int8=None, awq4=None):
    return {"fp16": {d: correctness(N, 300) for d in ("math", "code")}, "int8": int8 or GOOD,
            "awq4": awq4 or {"math": correctness(N, 300, lose=60), "code": correctness(N, 300)}}


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def run_gate(*args):
    code = cli.main(["gate", *args])
    with open("results/report.md") as report:
        return code, read_json("results/gate.json"), report.read()


def test_pass_for_the_variant_that_passed(repo):
    write_pipeline(repo, answers())
    code, result, report = run_gate("--variant", "int8")
    assert (code, result["verdict"], result["exit_code"]) == (0, "pass", 0)
    assert report.startswith("## quantgate release gate: PASS")
    assert "| int8 | math | **pass** | 0.748 (0.750) | -0.003 [" in report


def test_fail_when_any_gated_variant_fails(repo, capsys):
    write_pipeline(repo, answers())
    code, result, report = run_gate()
    assert (code, result["verdict"]) == (1, "fail")
    assert result["variants"]["awq4"] == {"verdict": "fail", "domains": {"math": "fail", "code": "pass"}}
    assert "awq4 math: accuracy drops 0.150 > margin 0.050" in result["reasons"]
    assert "quantgate gate: FAIL (exit 1) for int8, awq4" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [math.nan, None, "N/A", 999])
def test_a_nan_or_placeholder_metric_fails_even_if_compare_said_pass(repo, bad):
    write_pipeline(repo, answers())
    report = read_json("results/compare.json")
    report["variants"]["int8"]["domains"]["math"]["paired"]["ci_low"] = bad
    open("results/compare.json", "w").write(json.dumps(report))  # json.dumps keeps NaN as NaN
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["verdict"]) == (1, "fail")
    assert result["reasons"] == [f"int8 math: ci_low is missing or not a number ({bad!r})"]


def test_too_few_items_fails(repo):
    write_pipeline(repo, answers())
    report = read_json("results/compare.json")
    report["variants"]["int8"]["domains"]["code"]["paired"]["items"] = N - 1
    write_json("results/compare.json", report)
    code, result, _ = run_gate("--variant", "int8")
    assert code == 1 and result["reasons"] == [f"int8 code: scored over {N - 1} items, expected {N}"]


def test_missing_baseline_fails(repo):
    write_pipeline(repo, answers())
    report = read_json("results/compare.json")
    report["fp16"] = {"status": "failed", "error": "no evaluation results"}
    write_json("results/compare.json", report)
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["verdict"]) == (1, "fail")
    assert result["reasons"] == ["baseline fp16 missing or failed: no evaluation results"]


def test_a_crash_inside_the_gate_exits_2(repo, monkeypatch):
    write_pipeline(repo, answers())

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(gate, "decide", boom)
    code, result, report = run_gate()
    assert (code, result["verdict"]) == (2, "undecided")
    assert result["reasons"] == ["the gate could not finish: RuntimeError: disk on fire"]
    assert "UNDECIDED" in report


def test_stale_or_missing_results_and_inconclusive_cannot_decide(repo):
    assert run_gate()[0] == 2  # nothing at all
    write_pipeline(repo, answers())
    (repo / "dvc.lock").write_text("stages: {a: 2}\n")  # something re-ran after compare
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "not made from the current dvc.lock" in result["reasons"][0]
    write_pipeline(repo, answers(int8={d: correctness(N, 300, lose=16) for d in ("math", "code")}))
    code, result, _ = run_gate("--variant", "int8")  # -0.04 with an interval reaching below -0.05
    assert (code, result["verdict"]) == (2, "undecided")
    assert result["reasons"][0].startswith("int8 math: inconclusive: accuracy interval")
    assert run_gate("--variant", "nope")[0] == 2


def record_run(repo, results, lock):
    built = write_pipeline(repo, results, lock_text=lock)
    return record.record_pipeline(built["params"], f"sqlite:///{repo / 'mlflow.db'}", built["digest"], {}, root=repo,
                                  artifact_root=repo / "artifacts")


def aliases(repo):
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    return {a: str(client.get_model_version_by_alias("quantgate-reference", a).version) for a in ("candidate", "production")
            if a in client.get_registered_model("quantgate-reference").aliases}


def test_promotion_refuses_a_regression_and_takes_a_clean_improvement(repo):
    first = {d: correctness(N, 300, gain=20) for d in ("math", "code")}  # 320 right: better than fp16
    summary = record_run(repo, answers(int8=first), "stages: {run: 1}\n")
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert code == 0 and result["promotion"]["status"] == "promoted"
    assert aliases(repo) == {"candidate": "1", "production": "1"}
    assert run_gate("--variant", "int8", "--promote")[1]["promotion"]["status"] == "unchanged"

    # 298 right: passes against fp16 (-0.005) but is 22 items (-0.055) below production
    record_run(repo, answers(int8={d: correctness(N, 300, lose=2) for d in ("math", "code")}), "stages: {run: 2}\n")
    code, result, report = run_gate("--variant", "int8", "--promote")
    assert (code, result["verdict"], result["promotion"]["status"]) == (1, "fail", "refused")
    assert "regresses against production version 1 (int8)" in result["promotion"]["detail"]
    assert "math: accuracy 0.745 vs production 0.800" in result["promotion"]["detail"]
    assert aliases(repo) == {"candidate": "2", "production": "1"}
    assert "### Promotion" in report

    # 325 right: better than production too
    record_run(repo, answers(int8={d: correctness(N, 300, gain=25) for d in ("math", "code")}), "stages: {run: 3}\n")
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert (code, result["promotion"]["status"]) == (0, "promoted")
    assert result["promotion"]["detail"].endswith("(replaces version 1)")
    assert aliases(repo) == {"candidate": "3", "production": "3"}
    assert summary["registered"] == [{"variant": "int8", "version": "1"}]


def test_promotion_needs_a_passing_gate_and_this_runs_candidate(repo):
    record_run(repo, answers(), "stages: {run: 1}\n")
    code, result, _ = run_gate("--promote")  # awq4 fails: nothing moves
    assert code == 1 and result["promotion"]["status"] == "refused"
    assert aliases(repo) == {"candidate": "1"}
    write_pipeline(repo, answers(), lock_text="stages: {run: 9}\n")  # new results, not recorded
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert code == 1 and "registered from other results than the current dvc.lock" in result["promotion"]["detail"]
