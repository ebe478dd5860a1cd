"""pipelines/store/promotion.py via `quantgate gate --promote`: what moves the production alias and what does not."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from pipelines import cli, record
from pipelines.core.io import sha256_file, write_json
from pipelines.core.params import Params
from pipelines.store import promotion, registry
from tests.handmade import correctness, write_pipeline
from tests.store_helpers import N, answers, run_gate, sqlite_store, stored_checkpoint, write_recordable


def record_run(repo, results):
    built = write_recordable(repo, results)
    return record.record_pipeline(built["params"], sqlite_store(repo), built["digest"], {}, root=repo,
                                  artifact_root=repo / "artifacts")


def aliases(repo):
    client = MlflowClient(sqlite_store(repo))
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
    stored = stored_checkpoint(sqlite_store(repo), summary["children"]["int8"]) / "tokenizer.json"
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
    uri = sqlite_store(repo)
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


def test_a_registry_without_a_candidate_version_promotes_nothing(tmp_path):
    uri = sqlite_store(tmp_path)
    assert promotion.promote_candidate(uri, "quantgate-reference", {"gated": ["int8"]}, Params(), "0" * 64) == {
        "status": "refused", "detail": "no version of 'quantgate-reference' carries the alias 'candidate': run dvc repro"}
