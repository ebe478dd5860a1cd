"""Recording a hand-made pipeline result into a temporary MLflow store, read back through the MLflow client."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipelines import record
from pipelines.core import lineage
from pipelines.core.io import write_json
from pipelines.core.params import load_params
from pipelines.store import client as store_client
from pipelines.store import layout, registry
from tests.handmade import correctness
from tests.store_helpers import N, fetch, runs_of, sqlite_store, write_recordable


def test_parent_and_child_runs_with_metrics_params_and_tags(recorded):
    root, built, uri, summary = recorded
    client, exp, runs = runs_of(uri)
    assert summary["status"] == "recorded" and len(runs) == 4  # no results/shadow.json (older results): no shadow child
    assert summary["shadow_run_id"] is None
    parent = client.get_run(summary["parent_run_id"])
    assert parent.data.tags["quantgate.results_digest"] == built["digest"]
    assert parent.data.tags["git.commit"] == "abc123"
    assert parent.data.params["variants.awq4.bits"] == "4" and parent.data.params["evaluate.domains"] == '["math", "code"]'
    assert exp.artifact_location == (root / "artifacts").resolve().as_uri()
    children = {r.data.tags["quantgate.variant"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"fp16", "int8", "awq4"}
    # the name is what MLflow's runs table shows without choosing columns: the verdicts, failing request types first
    assert {n: r.info.run_name for n, r in children.items()} == {
        "fp16": "fp16 · baseline", "int8": "int8 · pass: math, code", "awq4": "awq4 · fail: math · pass: code"}
    assert {r.data.tags["mlflow.runType"] for r in children.values()} == {"evaluation"}  # parents open expanded
    assert "mlflow.runType" not in parent.data.tags
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
    with store_client.using_store(uri) as client:  # load_table downloads through the process-wide tracking URI
        compare_table = client.load_table(summary["experiment_id"], "tables/compare.json", run_ids=[summary["parent_run_id"]])
        routing = client.load_table(summary["experiment_id"], "tables/routing_table.json", run_ids=[summary["parent_run_id"]])
    assert len(compare_table) == 4  # 2 variants x 2 domains
    assert set(compare_table[compare_table.variant == "awq4"].verdict) == {"fail", "pass"}
    assert len(routing) == 4  # 2 domains x 2 buckets; awq4 fails math but is the cheapest that passes code
    assert dict(zip(routing.domain, routing.serve)) == {"math": "int8", "code": "awq4"}
    from pipelines.core.io import sha256_file

    inputs = client.get_run(summary["parent_run_id"]).inputs.dataset_inputs
    by_name = {i.dataset.name: {t.key: t.value for t in i.tags} for i in inputs}
    assert by_name["calibration-math"]["sha256"] == sha256_file(root / "calibration_sets/built/math.jsonl")
    assert by_name["calibration-math"]["mlflow.data.context"] == "calibration"
    assert by_name["probes-code"]["mlflow.data.context"] == "evaluation"


def test_recording_the_same_lock_twice_writes_nothing(recorded):
    root, built, uri, _ = recorded
    again = record.record_pipeline(built["params"], uri, built["digest"], {"commit": "abc123", "dirty": False},
                                   root=root, artifact_root=root / "artifacts")
    assert again["status"] == "already recorded"
    _, _, runs = runs_of(uri)
    assert len(runs) == 4
    assert len(MlflowClient(uri).search_model_versions("name = 'quantgate-reference'")) == 1
    assert len(list((root / "artifacts").rglob("model.safetensors"))) == 1  # the checkpoint was uploaded once


def test_the_classifiers_accuracy_is_logged_on_the_parent_run(tmp_path):
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    measured = {"accuracy": 0.625, "types": {"math": {"accuracy": 0.5}, "code": {"accuracy": 0.75},
                                             "chat": {"accuracy": None}}}
    write_json(tmp_path / "results/calibration/classifier.json", measured)
    (tmp_path / "results/calibration/classifier_confusion.png").write_bytes(b"\x89PNG not really")
    uri = sqlite_store(tmp_path)
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    client = MlflowClient(uri)
    metrics = client.get_run(summary["parent_run_id"]).data.metrics
    assert {k: v for k, v in metrics.items() if k.startswith("classifier")} == {
        "classifier_accuracy": 0.625, "classifier_accuracy.math": 0.5, "classifier_accuracy.code": 0.75}
    artifacts = {a.path for a in client.list_artifacts(summary["parent_run_id"], "results")}
    assert "results/classifier.json" in artifacts
    plots = {a.path for a in client.list_artifacts(summary["parent_run_id"], "plots")}
    assert "plots/classifier_confusion.png" in plots


def test_a_variants_memory_flame_graph_is_on_its_child_run(tmp_path):
    """What the memory stage's tracer left (results/memory/traces/<variant>/) goes to that variant's run only."""
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    from pipelines.memory import write_trace_index

    traces = tmp_path / "results/memory/traces"
    (traces / "int8").mkdir(parents=True)
    (traces / "awq4").mkdir()
    (traces / "int8" / "flamegraph.html").write_text("<html>after_round</html>")
    (traces / "int8" / "trace.bin.partial").write_text("a capture a killed trace left")  # not listed: not logged
    write_trace_index(traces / "int8", {"variant": "int8", "growth_cause": {"tracer": "memray", "class": "leak"}})
    write_trace_index(traces / "awq4", {"variant": "awq4"})
    uri = sqlite_store(tmp_path)
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    client = MlflowClient(uri)
    runs = {r.data.tags["quantgate.variant"]: r.info.run_id for r in client.search_runs(
        [summary["experiment_id"]]) if "quantgate.variant" in r.data.tags}
    assert [a.path for a in client.list_artifacts(runs["int8"], "memory")] == ["memory/flamegraph.html"]
    assert client.list_artifacts(runs["awq4"], "memory") == [] == client.list_artifacts(runs["fp16"], "memory")


def test_the_shadow_replay_is_a_child_run_with_its_numbers_tables_plots_and_rollout(tmp_path):
    from tests.handmade import rerun_compare, write_shadow
    from tests.store_helpers import answers

    built = write_recordable(tmp_path, answers())
    write_shadow(tmp_path, {"int8": {"math": 0.9, "code": 0.8}, "awq4": {"code": 0.3}})
    rerun_compare(tmp_path)  # route listens: awq4 is refused for code
    for name in ("shadow_agreement.png", "shadow_latency.png"):
        (tmp_path / "results/plots" / name).write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "results/rollout.yaml").write_text("types: {}\n")
    (tmp_path / "results/kserve").mkdir()
    (tmp_path / "results/kserve/math.yaml").write_text("kind: InferenceService\n")
    uri = sqlite_store(tmp_path)
    summary = record.record_pipeline(built["params"], uri, lineage.results_digest(tmp_path / "dvc.lock"), {},
                                     root=tmp_path, artifact_root=tmp_path / "artifacts")
    client = MlflowClient(uri)
    shadow = client.get_run(summary["shadow_run_id"])
    assert shadow.info.run_name == "shadow" and shadow.data.tags["mlflow.parentRunId"] == summary["parent_run_id"]
    assert shadow.data.tags["quantgate.kind"] == "shadow" and shadow.data.tags["shadow.int8.status"] == "ok"
    assert "| int8 | math | 40 | 0.900 [0.800, 1.000] |" in shadow.data.tags["mlflow.note.content"]
    assert shadow.data.params["traffic.sha256"] == "ab" * 32 and shadow.data.params["max_new_tokens"] == "16"
    assert (shadow.data.params["max_batch"], shadow.data.params["store"]) == ("8", "masked")
    metrics = shadow.data.metrics
    assert metrics["agreement/int8/math/exact_share"] == 0.9 and metrics["agreement/awq4/code/exact_low"] == pytest.approx(0.2)
    assert metrics["agreement/int8/code/similarity_mean"] == 0.9 and "agreement/int8/code/outcome_share" not in metrics
    assert (metrics["latency/int8/ttft_ms_p99"], metrics["latency/fp16/tpot_ms_p50"], metrics["latency/awq4/tokens_per_s"]) == (40, 2, 1000)
    assert (metrics["memory/int8/peak_bytes"], metrics["memory/int8/growth_pct"]) == (1000, 900)
    assert metrics["memory/awq4/replay_saving_pct"] == 40 and "memory/fp16/replay_saving_pct" not in metrics
    with store_client.using_store(uri) as c:
        agreement = c.load_table(summary["experiment_id"], "tables/shadow_agreement.json", run_ids=[shadow.info.run_id])
        latency = c.load_table(summary["experiment_id"], "tables/shadow_latency.json", run_ids=[shadow.info.run_id])
        routing = c.load_table(summary["experiment_id"], "tables/routing_table.json", run_ids=[summary["parent_run_id"]])
    assert len(agreement) == 6 and set(agreement.bucket) == {"64", "all"}  # 3 (variant, type) cells x 2 buckets
    assert list(agreement[agreement.model == "awq4"].exact_share) == pytest.approx([0.3, 0.3])
    assert sorted(latency.model) == ["awq4", "fp16", "int8"] and set(latency.status) == {"ok"}
    assert dict(zip(routing.domain, routing.serve)) == {"math": "int8", "code": "int8"}
    assert sorted(routing.shadow_exact_share) == pytest.approx([0.8, 0.8, 0.9, 0.9])
    artifacts = {a.path for d in ("plots", "results", "rollout", "rollout/kserve")
                 for a in client.list_artifacts(shadow.info.run_id, d)}
    assert {"plots/shadow_agreement.png", "plots/shadow_latency.png", "results/shadow.json", "results/shadow_metrics.json",
            "rollout/rollout.yaml", "rollout/kserve/math.yaml"} <= artifacts
    assert set(summary["children"]) == {"fp16", "int8", "awq4"}  # the registry's children: the variants only


def test_a_format_2_recording_is_recorded_again_with_the_verdict_names(recorded):
    """Recorded before run names carried verdicts and the parent the per-type numbers: `record` replaces it."""
    root, built, uri, first = recorded
    client = MlflowClient(uri)
    client.set_tag(first["parent_run_id"], layout.FORMAT_TAG, "2")
    again = record.record_pipeline(built["params"], uri, built["digest"], {}, root=root, artifact_root=root / "artifacts")
    assert again["status"] == "recorded" and again["parent_run_id"] != first["parent_run_id"]
    names = {client.get_run(i).info.run_name for i in again["children"].values()}
    assert names == {"fp16 · baseline", "int8 · pass: math, code", "awq4 · fail: math · pass: code"}
    assert "math/awq4/difference" in client.get_run(again["parent_run_id"]).data.metrics


def test_a_recording_in_the_old_format_is_recorded_again(recorded):
    """A store recorded before checkpoints were stored (its versions name a workspace folder) is replaced, but
    never its production version."""
    root, built, uri, first = recorded
    client = MlflowClient(uri)
    client.delete_tag(first["parent_run_id"], layout.FORMAT_TAG)
    client.set_registered_model_alias("quantgate-reference", "production", "1")
    again = record.record_pipeline(built["params"], uri, built["digest"], {}, root=root, artifact_root=root / "artifacts")
    assert again["status"] == "recorded" and again["parent_run_id"] != first["parent_run_id"]
    assert again["registered"] == [{"variant": "int8", "version": "2"}]
    assert aliases_of(client) == {"candidate": "2", "production": "1"}
    assert record.record_pipeline(built["params"], uri, built["digest"], {}, root=root,
                                  artifact_root=root / "artifacts")["status"] == "already recorded"


def aliases_of(client):
    model = client.get_registered_model("quantgate-reference")
    return {a: str(v) for a, v in model.aliases.items()}


def test_a_changed_verdict_is_a_new_parent_run_and_moves_the_registry(recorded):
    """The policy tightened so that nothing passes: a new parent run, the verdicts in it, and no candidate left."""
    from tests.handmade import rerun_compare

    root, built, uri, first = recorded
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["compare"]["policy"] = {"default": {"max_accuracy_drop": 0.001, "max_flip_rate": 0.15, "kl_percentile": "p99",
                                               "max_kl": 1.0, "max_growth_excess_pct": 1.0, "min_memory_saving_pct": 10.0,
                                               "min_agreement": 0.5}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    rerun_compare(root)
    digest = lineage.results_digest(root / "dvc.lock")
    assert digest != built["digest"]  # the upstream stages did not change, compare's verdicts did
    summary = record.record_pipeline(load_params(root / "params.yaml"), uri, digest, {}, root=root,
                                     artifact_root=root / "artifacts")
    assert summary["status"] == "recorded" and summary["parent_run_id"] != first["parent_run_id"]
    client = MlflowClient(uri)
    int8 = next(r for r in client.search_runs([client.get_experiment_by_name("handmade").experiment_id])
                if r.data.tags.get("mlflow.parentRunId") == summary["parent_run_id"] and r.data.tags["quantgate.variant"] == "int8")
    assert int8.data.tags["verdict"] != "pass"
    assert "candidate" not in client.get_registered_model("quantgate-reference").aliases
    # params set back: those results were recorded already, nothing new is written, and the alias follows
    again = record.record_pipeline(built["params"], uri, built["digest"], {}, root=root, artifact_root=root / "artifacts")
    assert again["status"] == "already recorded"
    assert client.get_model_version_by_alias("quantgate-reference", "candidate").tags["variant"] == "int8"


def test_a_half_written_recording_is_replaced(tmp_path):
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    uri = sqlite_store(tmp_path)
    client = MlflowClient(uri)
    exp_id = store_client.experiment_id(client, "handmade", tmp_path / "artifacts")
    crashed = client.create_run(exp_id, tags={layout.KIND_TAG: "pipeline", registry.DIGEST_TAG: built["digest"]})
    client.set_terminated(crashed.info.run_id, "FAILED")
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    assert summary["status"] == "recorded"
    parents = record.find_recorded(client, exp_id, built["digest"])
    assert [p.info.run_id for p in parents] == [summary["parent_run_id"]]


def test_a_crash_while_registering_is_mended_by_the_next_record(tmp_path, monkeypatch):
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    uri = sqlite_store(tmp_path)
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


@pytest.fixture()
def server(tmp_path):
    """A real `mlflow server` on localhost whose artifacts live in its own folder (proxied, mlflow-artifacts:/):
    what a team's shared server does, its folder standing in for object storage."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
                             f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination", str(tmp_path / "bucket"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", tmp_path / "bucket"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


def test_through_a_tracking_server_the_checkpoint_lives_in_the_servers_store(tmp_path, server, monkeypatch, capsys):
    """The server validates the version's source (runs:/ of its own run) and keeps the bytes; another folder
    fetches them over HTTP, verified, and a byte changed on the server is named."""
    uri, bucket = server
    root = tmp_path / "repo"
    root.mkdir()
    built = write_recordable(root, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                    "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                    "awq4": {"math": correctness(N, 300, lose=60), "code": correctness(N, 300)}})
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=root, artifact_root=root / "artifacts")
    client = MlflowClient(uri)
    assert client.get_experiment_by_name("handmade").artifact_location.startswith("mlflow-artifacts:/")
    assert not (root / "artifacts").exists()  # nothing on the recording machine's disk
    version = client.get_model_version_by_alias("quantgate-reference", "candidate")
    assert version.source == f"runs:/{summary['children']['int8']}/checkpoint"
    stored = next(p for p in bucket.rglob("checkpoint") if p.is_dir())
    assert (stored / "model.safetensors").read_bytes() == (root / "models/variants/int8/model.safetensors").read_bytes()
    with store_client.using_store(uri) as c:
        assert registry.verify_version(c, version)["files"] == 4
    elsewhere = tmp_path / "other-machine"
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(elsewhere)) == 0
    assert (elsewhere / "config.json").read_bytes() == (root / "models/variants/int8/config.json").read_bytes()
    (stored / "config.json").write_bytes(b'{"model_type": "llamb"}')
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(tmp_path / "again")) == 2
    assert "config.json: sha256 " in capsys.readouterr().err


def test_a_dataset_logged_by_another_pipeline_at_the_same_moment_is_linked_not_lost(tmp_path, monkeypatch):
    """Two recordings logging the same calibration set race in the store (both insert it); the loser's call is
    rolled back whole and repeated, and its run gets the input once. Any other store error is not retried."""
    import mlflow
    from mlflow.exceptions import MlflowException

    monkeypatch.setattr(record.time, "sleep", lambda s: None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_store(tmp_path))
    data = tmp_path / "code.jsonl"
    data.write_text('{"id": "a", "text": "x = 1  # one"}\n')
    real, calls = mlflow.log_input, []

    def racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # what the PostgreSQL store answered in CI
            raise MlflowException('(psycopg.errors.UniqueViolation) duplicate key value violates unique constraint '
                                  '"dataset_pk"')
        return real(*args, **kwargs)

    monkeypatch.setattr(record.mlflow, "log_input", racing)
    with mlflow.start_run() as run:
        record._dataset_inputs([("calibration-code", data)], "calibration")
    inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    assert len(calls) == 2 and [i.dataset.name for i in inputs] == ["calibration-code"]

    def broken(*args, **kwargs):
        calls.append(1)
        raise MlflowException("INVALID_PARAMETER_VALUE: something else")

    monkeypatch.setattr(record.mlflow, "log_input", broken)
    calls.clear()
    with mlflow.start_run(), pytest.raises(MlflowException, match="something else"):
        record._dataset_inputs([("calibration-code", data)], "calibration")
    assert len(calls) == 1
