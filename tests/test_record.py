"""Recording a hand-made pipeline result into a temporary MLflow store, read back through the MLflow client."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

import yaml

from pipelines import lineage, record
from pipelines.params import load_params
from tests.handmade import correctness, write_pipeline

N = 400


@pytest.fixture()
def recorded(tmp_path):
    """int8 passes both domains, awq4 fails math; recorded once."""
    built = write_pipeline(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                      "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                      "awq4": {"math": correctness(N, 300, lose=60), "code": correctness(N, 300)}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = record.record_pipeline(built["params"], uri, built["digest"], {"commit": "abc123", "dirty": False},
                                     root=tmp_path, artifact_root=tmp_path / "artifacts")
    return tmp_path, built, uri, summary


def runs_of(uri, experiment="handmade"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, exp, client.search_runs([exp.experiment_id])


def test_parent_and_child_runs_with_metrics_params_and_tags(recorded):
    root, built, uri, summary = recorded
    client, exp, runs = runs_of(uri)
    assert summary["status"] == "recorded" and len(runs) == 4
    parent = client.get_run(summary["parent_run_id"])
    assert parent.data.tags["quantgate.results_digest"] == built["digest"]
    assert parent.data.tags["git.commit"] == "abc123"
    assert parent.data.params["variants.awq4.bits"] == "4" and parent.data.params["evaluate.domains"] == '["math", "code"]'
    assert exp.artifact_location == (root / "artifacts").resolve().as_uri()
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"fp16", "int8", "awq4"}
    int8 = children["int8"]
    assert int8.data.metrics["math/accuracy"] == pytest.approx(299 / 400)
    assert int8.data.metrics["math/difference"] == pytest.approx(-1 / 400)
    assert int8.data.metrics["math/correct_to_wrong"] == 1
    assert int8.data.metrics["memory/footprint_bytes"] == 1_500_000
    assert int8.data.metrics["code/kl/p99"] == pytest.approx(0.2)
    assert int8.data.metrics["code/same_top1"] == 0.95 and int8.data.metrics["code/stderr"] == 0.03
    assert int8.data.metrics["memory/peak_by_tokens/64"] == 100_000 and int8.data.metrics["memory/leak"] == 0
    assert int8.data.metrics["memory/vs_fp16/footprint_delta_bytes"] == -500_000
    assert "math/ci_low" in int8.data.metrics and "math/ci_low" not in children["fp16"].data.metrics
    assert int8.data.params["settings.method"] == "bnb-int8" and int8.data.params["library.torch"] == "2.13.0+cpu"
    assert (int8.data.tags["verdict"], int8.data.tags["verdict.math"]) == ("pass", "pass")
    awq4 = children["awq4"]
    assert (awq4.data.tags["verdict"], awq4.data.tags["verdict.math"], awq4.data.tags["verdict.code"]) == ("fail", "fail", "pass")
    assert "accuracy drops 0.150" in awq4.data.tags["reasons.math"]
    assert children["fp16"].data.tags["verdict"] == "baseline"
    assert children["fp16"].data.metrics["math/accuracy"] == 0.75
    artifacts = {a.path for a in client.list_artifacts(int8.info.run_id, "results")}
    assert artifacts == {"results/int8.json", "results/quantgate.json"}
    assert [a.path for a in client.list_artifacts(int8.info.run_id, "eval")] == ["eval/items.jsonl"]
    assert [a.path for a in client.list_artifacts(int8.info.run_id, "plots")] == ["plots/pareto.png"]


def test_tables_and_dataset_inputs(recorded):
    root, built, uri, summary = recorded
    with record.using_store(uri) as client:  # load_table downloads through the process-wide tracking URI
        compare_table = client.load_table(summary["experiment_id"], "tables/compare.json", run_ids=[summary["parent_run_id"]])
        routing = client.load_table(summary["experiment_id"], "tables/routing_table.json", run_ids=[summary["parent_run_id"]])
    assert len(compare_table) == 4  # 2 variants x 2 domains
    assert set(compare_table[compare_table.variant == "awq4"].verdict) == {"fail", "pass"}
    assert len(routing) == 4  # 2 domains x 2 buckets; awq4 fails math but is the cheapest that passes code
    assert dict(zip(routing.domain, routing.serve)) == {"math": "int8", "code": "awq4"}
    from pipelines.io import sha256_file

    inputs = client.get_run(summary["parent_run_id"]).inputs.dataset_inputs
    by_name = {i.dataset.name: {t.key: t.value for t in i.tags} for i in inputs}
    assert by_name["calibration-math"]["sha256"] == sha256_file(root / "calibration_sets/built/math.jsonl")
    assert by_name["calibration-math"]["mlflow.data.context"] == "calibration"
    assert by_name["probes-code"]["mlflow.data.context"] == "evaluation"


def test_passing_variants_are_registered_and_candidate_points_at_the_newest(recorded):
    root, built, uri, summary = recorded
    client = MlflowClient(uri)
    versions = client.search_model_versions("name = 'quantgate-reference'")
    assert [v.tags["variant"] for v in versions] == ["int8"]  # awq4 failed: not registered
    candidate = client.get_model_version_by_alias("quantgate-reference", "candidate")
    assert candidate.version == versions[0].version and candidate.run_id == summary["children"]["int8"]
    assert candidate.source == str((root / "models/variants/int8").resolve())
    assert candidate.tags["verdict"] == "pass" and candidate.tags["quantgate.results_digest"] == built["digest"]


def test_recording_the_same_lock_twice_writes_nothing(recorded):
    root, built, uri, _ = recorded
    again = record.record_pipeline(built["params"], uri, built["digest"], {"commit": "abc123", "dirty": False},
                                   root=root, artifact_root=root / "artifacts")
    assert again["status"] == "already recorded"
    _, _, runs = runs_of(uri)
    assert len(runs) == 4
    assert len(MlflowClient(uri).search_model_versions("name = 'quantgate-reference'")) == 1


def test_a_changed_verdict_is_a_new_parent_run_and_moves_the_registry(recorded):
    """The policy tightened so that nothing passes: a new parent run, the verdicts in it, and no candidate left."""
    from tests.handmade import rerun_compare

    root, built, uri, first = recorded
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["compare"]["policy"] = {"default": {"max_accuracy_drop": 0.001, "max_flip_rate": 0.15, "kl_percentile": "p99",
                                               "max_kl": 1.0, "max_growth_excess_pct": 1.0, "min_memory_saving_pct": 10.0}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    rerun_compare(root)
    digest = lineage.results_digest(root / "dvc.lock")
    assert digest != built["digest"]  # the upstream stages did not change, compare's verdicts did
    summary = record.record_pipeline(load_params(root / "params.yaml"), uri, digest, {}, root=root,
                                     artifact_root=root / "artifacts")
    assert summary["status"] == "recorded" and summary["parent_run_id"] != first["parent_run_id"]
    client = MlflowClient(uri)
    int8 = next(r for r in client.search_runs([client.get_experiment_by_name("handmade").experiment_id])
                if r.data.tags.get("mlflow.parentRunId") == summary["parent_run_id"] and r.info.run_name == "int8")
    assert int8.data.tags["verdict"] != "pass"
    assert "candidate" not in client.get_registered_model("quantgate-reference").aliases
    # params set back: those results were recorded already, nothing new is written, and the alias follows
    again = record.record_pipeline(built["params"], uri, built["digest"], {}, root=root, artifact_root=root / "artifacts")
    assert again["status"] == "already recorded"
    assert client.get_model_version_by_alias("quantgate-reference", "candidate").tags["variant"] == "int8"


def test_a_half_written_recording_is_replaced(tmp_path):
    built = write_pipeline(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                      "int8": {d: correctness(N, 300) for d in ("math", "code")},
                                      "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = record.experiment_id(client, "handmade", tmp_path / "artifacts")
    crashed = client.create_run(exp_id, tags={record.KIND_TAG: "pipeline", record.DIGEST_TAG: built["digest"]})
    client.set_terminated(crashed.info.run_id, "FAILED")
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    assert summary["status"] == "recorded"
    parents = record.find_recorded(client, exp_id, built["digest"])
    assert [p.info.run_id for p in parents] == [summary["parent_run_id"]]


def test_a_crash_while_registering_is_mended_by_the_next_record(tmp_path, monkeypatch):
    built = write_pipeline(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                      "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                      "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    real = MlflowClient.create_model_version
    calls = []

    def crash_on_the_second(self, *args, **kwargs):  # the store goes away after the first version
        calls.append(args)
        if len(calls) == 2:
            raise ConnectionError("tracking server went away")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_model_version", crash_on_the_second)
    with pytest.raises(ConnectionError):
        record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path, artifact_root=tmp_path / "artifacts")
    monkeypatch.setattr(MlflowClient, "create_model_version", real)
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    assert summary["status"] == "recorded"  # not "already recorded": the first one never finished registering
    name = built["params"].registered_model_name()
    versions = client.search_model_versions(f"name = '{name}'")
    assert sorted(v.tags["variant"] for v in versions) == ["awq4", "int8"]  # each once: the partial one is gone
    assert all(v.run_id in summary["children"].values() for v in versions)
    candidate = client.get_model_version_by_alias(name, "candidate")
    assert candidate.tags["variant"] == summary["registered"][-1]["variant"]


def test_recording_leaves_the_process_tracking_uri_as_it_was(recorded, monkeypatch):
    import os

    assert "MLFLOW_TRACKING_URI" not in os.environ  # a later `dvc repro` subprocess must not inherit the test store
