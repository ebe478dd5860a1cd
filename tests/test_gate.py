"""`quantgate gate`: exit codes for pass, fail, NaN metric, missing baseline, a crash; promotion in the registry."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml
from mlflow import MlflowClient

from pipelines import cli, gate, record
from pipelines.core.io import read_json, sha256_file, write_json
from pipelines.store import registry
from tests.handmade import correctness, rerun_compare, write_pipeline
from tests.test_record import stored_checkpoint, write_recordable

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
    assert "| int8 | math | **pass** | 400 (1 of 1) | 0.748 (0.750) | -0.003 [" in report


def test_fail_when_any_gated_variant_fails(repo, capsys):
    write_pipeline(repo, answers())
    code, result, report = run_gate()
    assert (code, result["verdict"]) == (1, "fail")
    assert result["variants"]["awq4"] == {"verdict": "fail", "domains": {"math": "fail", "code": "pass"}}
    assert any(r.startswith("awq4 math: accuracy drops 0.150 > margin 0.050") for r in result["reasons"])
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


def test_a_memory_failure_is_not_excused_by_an_evaluation_this_machine_could_not_run(repo):
    write_pipeline(repo, answers(awq4=GOOD))
    write_json(repo / "results/eval/awq4.json", {"variant": "awq4", "status": "failed", "error": "ImportError: lm_eval",
                                                "cause": "environment", "reason": "lm_eval cannot be imported here",
                                                "remedy": "install it"})
    edit_json(repo / "results/memory_summary.json", lambda d: d["variants"].update(
        awq4={"status": "failed", "error": "OutOfMemoryError: CUDA out of memory"}))
    rerun_compare(repo)
    code, result, _ = run_gate("--variant", "awq4")
    assert (code, result["verdict"]) == (1, "fail")
    assert any("memory stage failed: OutOfMemoryError" in r for r in result["reasons"])


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
                                               "max_kl": 1.0, "max_growth_excess_pct": 1.0, "min_memory_saving_pct": 10.0}}
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


def record_run(repo, results):
    built = write_recordable(repo, results)
    return record.record_pipeline(built["params"], f"sqlite:///{repo / 'mlflow.db'}", built["digest"], {}, root=repo,
                                  artifact_root=repo / "artifacts")


def aliases(repo):
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    return {a: str(client.get_model_version_by_alias("quantgate-reference", a).version) for a in ("candidate", "production")
            if a in client.get_registered_model("quantgate-reference").aliases}


def test_promotion_refuses_a_regression_and_takes_a_clean_improvement(repo):
    first = {d: correctness(N, 300, gain=20) for d in ("math", "code")}  # 320 right: better than fp16
    summary = record_run(repo, answers(int8=first))
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert code == 0 and result["promotion"]["status"] == "promoted"
    assert aliases(repo) == {"candidate": "1", "production": "1"}
    assert run_gate("--variant", "int8", "--promote")[1]["promotion"]["status"] == "unchanged"

    # 298 right: passes against fp16 (-0.005) but is 22 items (-0.055) below production
    record_run(repo, answers(int8={d: correctness(N, 300, lose=2) for d in ("math", "code")}))
    code, result, report = run_gate("--variant", "int8", "--promote")
    assert (code, result["verdict"], result["promotion"]["status"]) == (1, "fail", "refused")
    assert "regresses against production version 1 (int8)" in result["promotion"]["detail"]
    assert "math: accuracy 0.745 vs production 0.800" in result["promotion"]["detail"]
    assert aliases(repo) == {"candidate": "2", "production": "1"}
    assert "### Promotion" in report

    # 325 right: better than production too
    record_run(repo, answers(int8={d: correctness(N, 300, gain=25) for d in ("math", "code")}))
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert (code, result["promotion"]["status"]) == (0, "promoted")
    assert result["promotion"]["detail"].endswith("(replaces version 1)")
    assert aliases(repo) == {"candidate": "3", "production": "3"}
    assert summary["registered"] == [{"variant": "int8", "version": "1"}]


def test_promotion_needs_a_passing_gate_and_this_runs_candidate(repo):
    record_run(repo, answers())
    code, result, _ = run_gate("--promote")  # awq4 fails: nothing moves
    assert code == 1 and result["promotion"]["status"] == "refused"
    assert aliases(repo) == {"candidate": "1"}
    write_pipeline(repo, answers(int8={d: correctness(N, 300, lose=3) for d in ("math", "code")}))  # new results, not recorded
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert code == 1 and "registered from other results than the current dvc.lock" in result["promotion"]["detail"]


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_promotion_refuses_a_version_whose_stored_checkpoint_is_not_the_gated_one(repo, damage):
    summary = record_run(repo, answers())
    stored = stored_checkpoint(f"sqlite:///{repo / 'mlflow.db'}", summary["children"]["int8"]) / "tokenizer.json"
    if damage == "delete":
        stored.unlink()
    else:
        stored.write_bytes(stored.read_bytes().replace(b"int8", b"int9"))
    code, result, report = run_gate("--variant", "int8", "--promote")
    assert (code, result["verdict"], result["promotion"]["status"]) == (1, "fail", "refused")
    detail = result["promotion"]["detail"]
    assert detail.startswith("quantgate-reference version 1 (int8): its stored checkpoint is not the one gated")
    assert ("tokenizer.json: missing" if damage == "delete" else "tokenizer.json: sha256 ") in detail
    assert aliases(repo) == {"candidate": "1"}  # production was not moved
    assert "tokenizer.json" in report


def test_promotion_refuses_a_registry_rewritten_to_other_bytes_with_matching_hashes(repo):
    """Someone with write access to the store replaces a file, its checkpoint.json and the version's tag
    together: the stored copy is self-consistent, but it is not what the workspace DVC vouches for was."""
    summary = record_run(repo, answers())
    uri = f"sqlite:///{repo / 'mlflow.db'}"
    stored = stored_checkpoint(uri, summary["children"]["int8"])
    (stored / "tokenizer.json").write_bytes((stored / "tokenizer.json").read_bytes().replace(b"int8", b"int9"))
    files = {p.relative_to(stored).as_posix(): sha256_file(p) for p in stored.rglob("*") if p.is_file()}
    write_json(stored.parent / registry.CHECKPOINT_HASHES, {"sha256": registry.checkpoint_digest(files), "files": files})
    client = MlflowClient(uri)
    client.set_model_version_tag("quantgate-reference", "1", registry.CHECKPOINT_TAG, registry.checkpoint_digest(files))
    assert registry.verify_version(client, client.get_model_version("quantgate-reference", "1"))  # self-consistent
    code, result, _ = run_gate("--variant", "int8", "--promote")
    assert (code, result["promotion"]["status"]) == (1, "refused")
    assert "is not the gated checkpoint's" in result["promotion"]["detail"]
    assert aliases(repo) == {"candidate": "1"}


def test_promotion_after_the_workspace_is_overwritten_promotes_the_stored_bytes(repo):
    """The workspace folder changes after record (dvc status then refuses the gate until dvc repro); what
    production names is the stored copy, verified, not the folder."""
    summary = record_run(repo, answers())
    assert run_gate("--variant", "int8", "--promote")[1]["promotion"]["status"] == "promoted"
    gated = (repo / "models/variants/int8/model.safetensors").read_bytes()
    (repo / "models/variants/int8/model.safetensors").write_bytes(b"overwritten")
    assert cli.main(["fetch", "production", "--dest", str(repo / "prod")]) == 0
    assert (repo / "prod/model.safetensors").read_bytes() == gated
    assert summary["registered"] == [{"variant": "int8", "version": "1"}]


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
