"""`quantgate gate`: exit codes for pass, fail, NaN metric, missing baseline, a crash, stale and forged inputs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml

from pipelines import gate
from pipelines.core.io import read_json, write_json
from tests.handmade import correctness, rerun_compare, write_pipeline
from tests.store_helpers import GOOD, N, answers, run_gate


def test_pass_for_the_variant_that_passed(repo):
    write_pipeline(repo, answers())
    code, result, report = run_gate("--variant", "int8")
    assert (code, result["verdict"], result["exit_code"]) == (0, "pass", 0)
    assert report.startswith("## quantgate release gate: PASS")
    assert "| int8 | math | **pass** | 400 (1 of 1) | 0.748 (0.750) | -0.003 [" in report


def test_fail_when_any_gated_variant_fails(repo, capsys):
    write_pipeline(repo, answers())
    code, result, report = run_gate()
    assert (code, result["verdict"]) == (1, "fail")
    assert result["variants"]["awq4"] == {"verdict": "fail", "domains": {"math": "fail", "code": "pass"}}
    assert any(r.startswith("awq4 math: accuracy drops 0.150: interval [") for r in result["reasons"])
    assert "quantgate gate: FAIL (exit 1) for int8, awq4" in capsys.readouterr().out


def edit_json(path, change):
    data = read_json(path)
    change(data)
    open(path, "w").write(json.dumps(data))  # json.dumps keeps NaN as NaN


def dvc_commit_force(repo):
    """What a hurried user types to make `dvc status` quiet after editing results by hand."""
    from tests.handmade import dvc_commit

    dvc_commit(repo)


@pytest.mark.parametrize("bad", [math.nan, None, "N/A", 999])
def test_a_nan_or_placeholder_in_the_evaluation_fails(repo, bad):
    """A bad number where compare reads it (the evaluation's KL) makes compare fail the variant."""
    write_pipeline(repo, answers())
    edit_json(repo / "results/eval/int8.json", lambda d: d["fidelity"]["math"]["kl"].update(p99=bad))
    rerun_compare(repo)
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["verdict"]) == (1, "fail")
    assert result["reasons"] == [f"int8 math: KL p99 is missing or not a number ({bad!r})"]


@pytest.mark.parametrize("bad", [math.nan, None, "N/A", 999])
def test_a_nan_or_placeholder_written_into_compare_json_cannot_pass(repo, bad):
    write_pipeline(repo, answers())
    edit_json(repo / "results/compare.json", lambda d: d["variants"]["int8"]["domains"]["math"]["paired"].update(ci_low=bad))
    assert run_gate("--variant", "int8")[0] == 2  # DVC: compare.json modified
    dvc_commit_force(repo)
    code, result, _ = run_gate("--variant", "int8")
    assert code in (1, 2) and result["verdict"] != "pass"


def test_a_missing_baseline_cannot_decide(repo):
    write_pipeline(repo, answers())
    shutil.rmtree(repo / "results/eval/fp16")
    (repo / "results/eval/fp16.json").unlink()
    assert run_gate("--variant", "int8")[0] == 2  # first of all the workspace is not what DVC recorded
    rerun_compare(repo)
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["verdict"]) == (2, "undecided")
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


def test_nothing_to_decide_on_and_unknown_variants(repo):
    assert run_gate()[0] == 2  # no params, no DVC repository, nothing at all
    write_pipeline(repo, answers())
    assert run_gate("--variant", "nope")[0] == 2
    assert run_gate("--variant", "fp16")[0] == 2


def test_inconclusive_cannot_decide(repo):
    write_pipeline(repo, answers(int8={d: correctness(N, 300, lose=16) for d in ("math", "code")}))
    code, result, _ = run_gate("--variant", "int8")  # -0.04 with an interval reaching below -0.05
    assert (code, result["verdict"]) == (2, "undecided")
    assert result["reasons"][0].startswith("int8 math: inconclusive: accuracy interval")
    assert "more items would decide" in result["reasons"][0]


@pytest.mark.parametrize("error, cause, code", [
    ("ModuleNotFoundError: No module named 'awq'", {"cause": "environment", "reason": "awq cannot be imported here",
                                                    "remedy": "install it (bash scripts/setup.sh)"}, 2),
    ("RuntimeError: quantization blew up", {}, 1),
])
def test_could_not_measure_is_undecided_and_the_variants_own_failure_fails(repo, error, cause, code):
    """A quantizer this machine lacks is no evidence against awq4 (every row inconclusive, exit 2, the remedy
    named, nothing routed to it); a quantizer that crashed is awq4's failure (exit 1)."""
    write_pipeline(repo, answers(awq4=GOOD))
    manifest = read_json(repo / "models/variants/awq4/quantgate.json")
    manifest.update(status="failed", error=error, **cause)
    write_json(repo / "models/variants/awq4/quantgate.json", manifest)
    shutil.rmtree(repo / "results/eval/awq4")  # what evaluate leaves for a variant that has no checkpoint
    write_json(repo / "results/eval/awq4.json", {"variant": "awq4", "status": "failed", "error": "awq4 is not usable"})
    _, table = rerun_compare(repo)
    code_got, result, report = run_gate("--variant", "awq4")
    assert (code_got, result["verdict"]) == (code, {1: "fail", 2: "undecided"}[code])
    assert result["variants"]["awq4"]["domains"] == dict.fromkeys(("math", "code"), {1: "fail", 2: "undecided"}[code])
    assert "awq4" not in {r["serve"] for r in table["rows"]}
    if cause:
        assert result["reasons"] == [f"awq4 {d}: not measured on this machine: awq cannot be imported here; remedy: "
                                     "install it (bash scripts/setup.sh)" for d in ("math", "code")]
        assert "| awq4 | math | **inconclusive** |" in report
    else:
        assert all("quantize/admit failed: RuntimeError: quantization blew up" in r for r in result["reasons"])


def test_a_baseline_this_machine_could_not_measure_leaves_the_row_undecided(repo):
    """fp16's code probes were refused here (no sandbox) but int8's ran (bubblewrap installed, then only the
    variants re-evaluated): nothing to pair with, so `inconclusive`, not a fail against int8."""
    write_pipeline(repo, answers(awq4=GOOD))
    edit_json(repo / "results/eval/fp16.json", lambda d: d["probes"].update(code={
        "task": "quantgate_code", "status": "refused", "cause": "environment", "reason": "sandbox isolation unavailable",
        "remedy": "dvc repro --force --downstream baseline"}))
    report, _ = rerun_compare(repo)
    assert report["variants"]["int8"]["domains"]["code"]["verdict"] == "inconclusive"
    assert report["variants"]["int8"]["domains"]["math"]["verdict"] == "pass"
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["variants"]["int8"]["domains"]) == (2, {"math": "pass", "code": "undecided"})


@pytest.mark.parametrize("memory, code", [
    ({"status": "failed", "error": "OutOfMemoryError: CUDA out of memory"}, 1),
    # the machine could not run its format in the memory stage either (compressed-tensors' probe): no evidence
    ({"status": "failed", "error": "CannotRunHere: compressed-tensors group_0 does not run on cpu",
      "cause": "environment"}, 2),
])
def test_a_memory_failure_is_not_excused_by_an_evaluation_this_machine_could_not_run(repo, memory, code):
    write_pipeline(repo, answers(awq4=GOOD))
    write_json(repo / "results/eval/awq4.json", {"variant": "awq4", "status": "failed", "error": "ImportError: lm_eval",
                                                "cause": "environment", "reason": "lm_eval cannot be imported here",
                                                "remedy": "install it"})
    edit_json(repo / "results/memory_summary.json", lambda d: d["variants"].update(awq4=memory))
    rerun_compare(repo)
    got, result, _ = run_gate("--variant", "awq4")
    assert (got, result["verdict"]) == (code, {1: "fail", 2: "undecided"}[code])
    assert any("memory stage failed: OutOfMemoryError" in r for r in result["reasons"]) == (code == 1)


def test_memory_this_machine_could_not_run_leaves_an_evaluated_variant_undecided(repo):
    """Evaluated, but its memory could not be measured here (its compressed-tensors scheme does not run on this
    device): no evidence either way, so every row is inconclusive with the reason and remedy, exit 2."""
    write_pipeline(repo, answers(awq4=GOOD))
    edit_json(repo / "results/memory_summary.json", lambda d: d["variants"].update(awq4={
        "status": "failed", "error": "CannotRunHere: x", "cause": "environment",
        "reason": "compressed-tensors group_0 does not run on cpu", "remedy": "run it where it runs"}))
    rerun_compare(repo)
    code, result, _ = run_gate("--variant", "awq4")
    assert (code, result["verdict"]) == (2, "undecided")
    assert result["reasons"] == [f"awq4 {d}: not measured on this machine: compressed-tensors group_0 does not run on "
                                 "cpu; remedy: run it where it runs" for d in ("math", "code")]


def test_an_edited_could_not_measure_row_cannot_pass(repo):
    """A hurried user marks a failed row `inconclusive` and force-commits: the gate re-derives it and refuses."""
    write_pipeline(repo, answers())
    edit_json(repo / "results/compare.json", lambda d: d["variants"]["awq4"]["domains"]["math"].update(
        verdict="inconclusive", unmeasured={"reason": "no sandbox", "remedy": ""}, paired=None))
    dvc_commit_force(repo)
    code, result, _ = run_gate("--variant", "awq4")
    assert (code, result["verdict"]) == (2, "undecided")
    assert any("awq4 math: compare.json says 'inconclusive', the per-item records in the workspace give 'fail'" in r
               for r in result["reasons"])


@pytest.mark.parametrize("int8, awq4, verdict", [
    (GOOD, GOOD, "pass"),
    (None, None, "fail"),  # awq4 loses 15 points of math
    ({d: correctness(N, 300, lose=16) for d in ("math", "code")}, GOOD, "undecided"),
])
def test_the_dvc_summary_gives_the_gates_verdict(repo, int8, awq4, verdict):
    """results/summary.json (DVC's metrics) says what the gate says on the same results, row by row."""
    from pipelines.judging import comparison

    built = write_pipeline(repo, answers(int8=int8, awq4=awq4))
    summary = comparison.summary(built["report"])
    _, result, _ = run_gate()
    assert summary["gate"] == result["verdict"] == verdict
    assert summary["verdict"]["awq4"] == {d: r["verdict"] for d, r in built["report"]["variants"]["awq4"]["domains"].items()}
    math_row = built["report"]["variants"]["int8"]["domains"]["math"]["paired"]
    assert (summary["difference"]["int8"]["math"], summary["ci_low"]["int8"]["math"], summary["items"]["int8"]["math"]) \
        == (round(math_row["difference"], 3), round(math_row["ci_low"], 3), N)
    assert summary["memory_saving_pct"] == {"int8": 25.0, "awq4": 35.0}


# --- stale and forged inputs, as a hurried user makes them (issue: each of these passed before) ----------

def test_replaced_checkpoint_weights_cannot_pass(repo):
    write_pipeline(repo, answers())
    (repo / "models/variants/int8/model.safetensors").write_bytes(b"other weights")
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "changed deps: models/variants modified" in "\n".join(result["reasons"])


@pytest.mark.parametrize("ci_state_dir", [False, True])
def test_a_file_rewritten_in_place_with_its_mtime_restored_cannot_pass(repo, monkeypatch, ci_state_dir):
    import os

    if ci_state_dir:  # what a CI job that caches DVC's state sets (and DVC fills): no reason to skip the re-hash
        monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(repo / "ci-cache"))
    write_pipeline(repo, answers())
    manifest = repo / "models/variants/int8/quantgate.json"
    before = manifest.stat()
    # one byte changed, same size, the mtime put back: DVC's state database alone would not look again
    manifest.write_text(manifest.read_text().replace(" ", "\t", 1))
    os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "changed deps: models/variants modified" in "\n".join(result["reasons"])
    if ci_state_dir:
        assert os.environ["DVC_SITE_CACHE_DIR"] == str(repo / "ci-cache")  # put back for whoever set it


def test_a_dependency_dropped_from_dvc_yaml_cannot_hide_an_edit(repo):
    write_pipeline(repo, answers())
    dvc_yaml = repo / "dvc.yaml"
    dvc_yaml.write_text(dvc_yaml.read_text().replace("deps: [eval, models/variants,", "deps: [models/variants,"))
    path = repo / "eval/math/items.jsonl"  # DVC's status no longer looks at eval/: dvc.lock still names it
    path.write_text(path.read_text().replace('"id": "math-0003"', '"id": "math-0003", "answer": "42"', 1))
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "  results: dvc.yaml's deps are not the ones dvc.lock recorded (eval)" in result["reasons"]


def test_a_stage_deleted_from_dvc_yaml_cannot_hide_an_edit(repo):
    write_pipeline(repo, answers())
    dvc_yaml = repo / "dvc.yaml"
    stages = yaml.safe_load(dvc_yaml.read_text())
    del stages["stages"]["results"]  # its dvc.lock entry stays, and nothing would check it any more
    dvc_yaml.write_text(yaml.safe_dump(stages))
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and any(r.startswith("  results: in dvc.lock but no longer a stage of dvc.yaml")
                             for r in result["reasons"])


def test_a_stage_run_from_another_folder_is_refused(repo):
    write_pipeline(repo, answers())
    dvc_yaml = repo / "dvc.yaml"
    stages = yaml.safe_load(dvc_yaml.read_text())
    stages["stages"]["results"]["wdir"] = "shadow"  # DVC would hash shadow/'s copies, the gate reads ./results
    dvc_yaml.write_text(yaml.safe_dump(stages))
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and any("wdir is 'shadow', not the repository root" in r for r in result["reasons"])


def test_deleted_evaluation_results_cannot_pass(repo):
    write_pipeline(repo, answers())
    shutil.rmtree(repo / "results/eval/int8")
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "results/eval modified" in "\n".join(result["reasons"])


def test_an_edited_probe_answer_cannot_pass(repo):
    write_pipeline(repo, answers())
    path = repo / "eval/math/items.jsonl"
    path.write_text(path.read_text().replace('"id": "math-0003"', '"id": "math-0003", "answer": "42"', 1))
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "changed deps: eval modified" in "\n".join(result["reasons"])


def test_a_changed_policy_without_repro_cannot_pass(repo):
    write_pipeline(repo, answers())
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["compare"]["policy"] = {"default": {"max_accuracy_drop": 0.001, "max_flip_rate": 0.15, "kl_percentile": "p99",
                                               "max_kl": 1.0, "max_growth_excess_pct": 1.0, "min_memory_saving_pct": 10.0,
                                               "min_agreement": 0.5}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and "  compare: changed deps: params.yaml compare modified" in result["reasons"]


def test_a_forged_difference_with_the_old_verdict_cannot_pass(repo):
    write_pipeline(repo, answers())
    edit_json(repo / "results/compare.json",
              lambda d: d["variants"]["int8"]["domains"]["code"]["paired"].update(difference=-0.30))
    assert run_gate("--variant", "int8")[0] == 2
    dvc_commit_force(repo)  # even after `dvc commit -f` the numbers are re-derived and recomputed
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2
    assert "int8 code: compare.json's difference differ from the per-item records'" in result["reasons"]
    assert any("int8 code: compare.json says 'pass' but its own numbers give 'fail'" in r for r in result["reasons"])


def test_a_forged_chance_level_cannot_pass(repo):
    """A hurried user lowers the chance level (or raises fp16's low end) to make a no-signal row pass: the numbers are
    recomputed from the per-item records, and the edit is named."""
    write_pipeline(repo, answers())
    edit_json(repo / "results/compare.json",
              lambda d: d["variants"]["int8"]["domains"]["code"]["paired"].update(chance=0.9))
    dvc_commit_force(repo)
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2
    assert "int8 code: compare.json's chance differ from the per-item records'" in result["reasons"]
    # 0.9 is above fp16's low end (0.75 of 400 right): the row's own numbers say no signal, not pass
    assert any("int8 code: compare.json says 'pass' but its own numbers give 'inconclusive'" in r for r in result["reasons"])


def test_forged_pass_verdicts_cannot_pass(repo):
    write_pipeline(repo, answers())

    def forge(data):
        data["variants"]["awq4"]["verdict"] = "pass"
        for row in data["variants"]["awq4"]["domains"].values():
            row["verdict"] = "pass"

    edit_json(repo / "results/compare.json", forge)
    dvc_commit_force(repo)
    code, result, report = run_gate("--variant", "awq4")
    assert code == 2 and result["verdict"] == "undecided"
    assert "awq4 math: compare.json says 'pass' but its own numbers give 'fail'" in result["reasons"]
    assert "| awq4 | math | **fail** |" in report  # the report shows what the records say, not the forgery


def test_edited_per_item_records_after_dvc_commit_cannot_pass(repo):
    """Records flipped to correct and `dvc commit -f`: compare.json was made from other upstream results."""
    write_pipeline(repo, answers())
    path = repo / "results/eval/awq4/items.jsonl"
    path.write_text(path.read_text().replace('"correct": false', '"correct": true'))
    dvc_commit_force(repo)
    code, result, _ = run_gate("--variant", "awq4")
    assert code == 2 and len(result["reasons"]) == 1
    assert result["reasons"][0].startswith("results/compare.json was not made from the results dvc.lock records")
    # the stage whose outputs were edited, forced: re-running it writes the records the model really gives
    assert result["reasons"][0].endswith("re-run what changed and everything after it: "
                                         "dvc repro --force --downstream results")
    edit_json(repo / "results/compare.json", lambda d: d["dvc_lock_stages"].update(results="what it is now"))
    dvc_commit_force(repo)  # stage digests forged to name nothing (or another stage): everything is re-run
    assert run_gate("--variant", "awq4")[1]["reasons"][0].endswith("dvc repro --force")


def test_a_frozen_stage_cannot_be_vouched_for(repo):
    """DVC's status skips a frozen stage's dependencies: the gate refuses to decide over it."""
    from dvc.repo import Repo

    write_pipeline(repo, answers())
    with Repo(str(repo)) as dvc_repo:
        dvc_repo.freeze("results")
    (repo / "models/variants/int8/model.safetensors").write_bytes(b"other weights")
    code, result, _ = run_gate("--variant", "int8")
    assert code == 2 and any("results: frozen" in r for r in result["reasons"])


def test_results_without_a_dvc_lock_cannot_pass():
    """No dvc.lock, so no record of what made compare.json: undecided, and the reason says so."""
    from pipelines.core.params import Params
    from pipelines.gate import decide

    result = decide({"variants": {}}, {"variants": {}}, Params(), [], None)
    assert result["verdict"] == "undecided"
    assert result["reasons"] == ["no dvc.lock: these results were not made by dvc repro; run dvc repro"]


def test_the_rerun_names_the_stages_that_changed_after_the_comparison():
    from pipelines.core.lineage import digest_of_stages
    from pipelines.gate import rerun_command

    judged = {"reference": "a", "evaluate@int8": "b", "evaluate@awq4": "c"}
    now = {"reference": "a", "evaluate@int8": "B", "evaluate@awq4": "C", "evaluate@gptq3": "d"}
    assert (rerun_command(judged, digest_of_stages(judged), now)
            == "dvc repro --force --downstream evaluate@int8 evaluate@awq4 evaluate@gptq3")
    assert rerun_command(None, None, now) == "dvc repro --force"  # a compare.json from before it named its stages
    assert rerun_command(judged, digest_of_stages(judged), {"reference": "a"}) == "dvc repro --force"  # a stage gone
    # stage digests edited in compare.json so that the command would force an innocent stage: not trusted
    edited = {**judged, "reference": "x"}
    assert rerun_command(edited, digest_of_stages(judged), now) == "dvc repro --force"
    assert rerun_command(["reference"], digest_of_stages(judged), now) == "dvc repro --force"

