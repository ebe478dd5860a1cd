"""Recording a hand-made pipeline result into a temporary MLflow store, read back through the MLflow client."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipelines import cli, record
from pipelines.core import lineage
from pipelines.core.io import read_json, sha256_file, write_json
from pipelines.core.params import load_params
from pipelines.store import client as store_client
from pipelines.store import layout, registry
from tests.handmade import correctness, rerun_compare, write_pipeline

N = 400


def write_checkpoints(root, built: dict) -> dict:
    """Real checkpoint files for every variant but fp16, listed with their sha256 in its manifest (the hand-made
    manifests list made-up hashes of files that are not there), then compare and dvc.lock made again."""
    for folder in sorted((root / "models/variants").iterdir()):
        if folder.name == "fp16":
            continue
        files = {"model.safetensors": bytes(range(256)) * 64 + folder.name.encode(), "config.json": b'{"model_type": "llama"}',
                 "tokenizer.json": f'{{"variant": "{folder.name}"}}'.encode()}
        for name, data in files.items():
            (folder / name).write_bytes(data)
        manifest = read_json(folder / "quantgate.json")
        manifest["files"] = {name: sha256_file(folder / name) for name in files}
        write_json(folder / "quantgate.json", manifest)
    report, table = rerun_compare(root)
    return {**built, "digest": lineage.results_digest(root / "dvc.lock"), "report": report, "table": table}


def write_recordable(root, answers: dict) -> dict:
    """write_pipeline with real checkpoint files behind its manifests."""
    return write_checkpoints(root, write_pipeline(root, answers))


@pytest.fixture()
def recorded(tmp_path):
    """int8 passes both domains, awq4 fails math; recorded once."""
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
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


def test_parent_run_carries_each_variants_numbers_per_request_type(recorded):
    """What MLflow's comparison of two pipeline runs (two experiments) puts side by side."""
    root, built, uri, summary = recorded
    parent = MlflowClient(uri).get_run(summary["parent_run_id"])
    m = parent.data.metrics
    assert m["math/awq4/accuracy"] == pytest.approx(240 / 400) and m["math/awq4/accuracy_fp16"] == pytest.approx(0.75)
    assert m["math/awq4/difference"] == pytest.approx(-60 / 400) and m["math/awq4/items"] == 400
    assert m["math/awq4/ci_low"] < m["math/awq4/difference"] < m["math/awq4/ci_high"]
    assert m["math/awq4/flip_rate"] == pytest.approx(60 / 400)
    assert m["code/int8/difference"] == pytest.approx(-1 / 400) and m["code/fp16/accuracy"] == pytest.approx(0.75)
    assert not any(k.startswith("math/fp16/") and k != "math/fp16/accuracy" for k in m)
    t = parent.data.tags
    assert (t["verdict.awq4"], t["verdict.awq4.math"], t["verdict.awq4.code"], t["verdict.int8.math"]) == \
        ("fail", "fail", "pass", "pass")


def test_child_description_names_the_deciding_numbers(recorded):
    root, built, uri, summary = recorded
    client, exp, runs = runs_of(uri)
    awq4 = next(r for r in runs if r.data.tags.get("quantgate.variant") == "awq4")
    text = awq4.data.tags["mlflow.note.content"]
    assert "**awq4: fail** against fp16" in text
    assert "| math | fail | -15.0 | [" in text and "| code | pass | +0.0 |" in text
    assert "- math: accuracy drops 0.150" in text


def saved_view(client, exp_id) -> tuple[dict, dict]:
    envelope = json.loads(client.get_experiment(exp_id).tags[layout.VIEW_TAG])
    return envelope, json.loads(envelope["state"])


def test_the_experiment_has_a_saved_view_of_verdicts_and_deciding_numbers(recorded):
    """MLflow 3.17's saved view (its "Views" menu, or the link `record` returns): verdict tag and deciding metric
    columns per request type, in that order; tests/test_mlflow_ui.py checks a browser shows it."""
    root, built, uri, summary = recorded
    client = MlflowClient(uri)
    envelope, state = saved_view(client, summary["experiment_id"])
    assert summary["view"] == f"#/experiments/{summary['experiment_id']}/runs?viewStateShareKey=quantgate-verdicts"
    assert envelope["name"] == layout.VIEW_NAME and isinstance(envelope["createdAt"], int)
    assert state["selectedColumns"] == [
        "tags.`verdict.math`", "tags.`verdict.code`", "metrics.`math/ci_low`", "metrics.`code/ci_low`",
        "metrics.`math/difference`", "metrics.`code/difference`", "metrics.`math/flip_rate`", "metrics.`code/flip_rate`",
        "metrics.`math/kl/p99`", "metrics.`code/kl/p99`", "metrics.`memory/growth_excess_pct`"]
    assert state["columnOrder"] == ["attributes.`Run Name`", *state["selectedColumns"]]
    # recording other results with another request type keeps the earlier ones; nothing changes when nothing is new
    envelope["state"] = json.dumps({**state, "selectedColumns": state["selectedColumns"][:1]})  # as if a person saved it
    client.set_experiment_tag(summary["experiment_id"], layout.VIEW_TAG, json.dumps(envelope))
    report = {"domains": ["sql"], "variants": {}}
    layout.write_verdict_view(client, summary["experiment_id"], report)
    assert saved_view(client, summary["experiment_id"])[1]["selectedColumns"] == state["selectedColumns"][:1]  # theirs


def test_the_saved_view_grows_with_new_request_types(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("views", artifact_location=(tmp_path / "a").as_uri())
    layout.write_verdict_view(client, exp_id, {"domains": ["math", "code"], "variants": {}})
    first = client.get_experiment(exp_id).tags[layout.VIEW_TAG]
    layout.write_verdict_view(client, exp_id, {"domains": ["math", "code"], "variants": {}})
    assert client.get_experiment(exp_id).tags[layout.VIEW_TAG] == first  # unchanged: not rewritten
    report = {"domains": ["sql"], "variants": {"int8": {"domains": {"sql": {"checks": {"kl": {"percentile": "p95"}}}}}}}
    layout.write_verdict_view(client, exp_id, report)
    envelope, state = saved_view(client, exp_id)
    tags = [c for c in state["selectedColumns"] if c.startswith("tags.")]
    assert tags == ["tags.`verdict.math`", "tags.`verdict.code`", "tags.`verdict.sql`"]
    assert "metrics.`sql/kl/p95`" in state["selectedColumns"] and envelope["createdAt"] == json.loads(first)["createdAt"]


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


def test_passing_variants_are_registered_and_candidate_points_at_the_newest(recorded):
    root, built, uri, summary = recorded
    client = MlflowClient(uri)
    versions = client.search_model_versions("name = 'quantgate-reference'")
    assert [v.tags["variant"] for v in versions] == ["int8"]  # awq4 failed: not registered
    candidate = client.get_model_version_by_alias("quantgate-reference", "candidate")
    assert candidate.version == versions[0].version and candidate.run_id == summary["children"]["int8"]
    assert candidate.tags["verdict"] == "pass" and candidate.tags["quantgate.results_digest"] == built["digest"]


def stored_checkpoint(uri, run_id):
    """The folder a child run's `checkpoint/` artifact lives in, resolved through MLflow."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository
    from mlflow.utils.file_utils import local_file_uri_to_path

    with store_client.using_store(uri):
        return Path(local_file_uri_to_path(RunsArtifactRepository.get_underlying_uri(f"runs:/{run_id}/checkpoint")))


def test_a_version_names_a_stored_copy_of_the_gated_files(recorded):
    """The source is the child run's artifact, inside the store's artifact root, tagged with one sha256."""
    root, built, uri, summary = recorded
    version = MlflowClient(uri).get_model_version_by_alias("quantgate-reference", "candidate")
    run = summary["children"]["int8"]
    assert version.source == f"runs:/{run}/checkpoint"
    stored = stored_checkpoint(uri, run)
    assert stored.is_relative_to((root / "artifacts").resolve()) and not stored.is_relative_to(root / "models")
    folder = root / "models/variants/int8"
    names = ["config.json", "model.safetensors", "quantgate.json", "tokenizer.json"]
    assert sorted(p.name for p in stored.iterdir()) == names
    assert all((stored / n).read_bytes() == (folder / n).read_bytes() for n in names)
    listing = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in names)  # sha256sum's
    assert version.tags["checkpoint.sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    assert version.tags["checkpoint.files"] == "4"
    assert MlflowClient(uri).get_run(run).data.tags["checkpoint.sha256"] == version.tags["checkpoint.sha256"]
    awq4 = summary["children"]["awq4"]  # failed a domain: nothing uploaded for it
    assert MlflowClient(uri).list_artifacts(awq4, "checkpoint") == []


def fetch(uri, monkeypatch, *args):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return cli.main(["fetch", *args, "--model", "quantgate-reference"])


def test_fetch_gives_the_gated_bytes_even_after_the_workspace_is_overwritten(recorded, monkeypatch, capsys):
    root, built, uri, summary = recorded
    folder = root / "models/variants/int8"
    gated = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "model.safetensors").write_bytes(b"the next dvc repro's weights")  # what the next run would leave
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(root / "elsewhere/int8")) == 0
    got = root / "elsewhere/int8"
    assert {p.name: p.read_bytes() for p in got.iterdir()} == gated
    assert fetch(uri, monkeypatch, "1", "--dest", str(got)) == 0  # the same bytes there already: accepted
    (got / "config.json").write_bytes(b"{}")
    assert fetch(uri, monkeypatch, "v1", "--dest", str(got)) == 2  # other bytes there: never overwritten
    assert "config.json: sha256 " in capsys.readouterr().err and (got / "config.json").read_bytes() == b"{}"


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_damaged_store_fails_fetch_naming_the_file(recorded, monkeypatch, capsys, damage):
    root, built, uri, summary = recorded
    stored = stored_checkpoint(uri, summary["children"]["int8"]) / "model.safetensors"
    if damage == "delete":
        stored.unlink()
    else:
        data = bytearray(stored.read_bytes())
        data[1000] ^= 1
        stored.write_bytes(bytes(data))
    dest = root / "fetched"
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(dest)) == 2
    err = capsys.readouterr().err
    assert "quantgate-reference version 1: checkpoint runs:/" in err
    assert ("model.safetensors: missing" if damage == "delete" else "model.safetensors: sha256 ") in err
    assert not dest.exists() and list(root.glob(".fetched.*")) == []  # nothing half-fetched left behind


def test_rewritten_hashes_in_the_store_are_caught_by_the_registry_tag(recorded, monkeypatch, capsys):
    """Someone with write access to the artifact store replaces a file and its recorded hash: the version's
    tag (in the tracking database) no longer matches."""
    root, built, uri, summary = recorded
    run = summary["children"]["int8"]
    stored = stored_checkpoint(uri, run)
    (stored / "model.safetensors").write_bytes(b"other weights")
    hashes_path = stored.parent / "checkpoint.json"
    hashes = json.loads(hashes_path.read_text())
    hashes["files"]["model.safetensors"] = sha256_file(stored / "model.safetensors")
    hashes_path.write_text(json.dumps(hashes))
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(root / "fetched")) == 2
    assert "checkpoint.json in run " in capsys.readouterr().err


def test_an_unknown_alias_is_named(recorded, monkeypatch, capsys):
    root, _, uri, _ = recorded
    assert fetch(uri, monkeypatch, "production", "--dest", str(root / "x")) == 2
    assert "quantgate-reference: no version or alias 'production'" in capsys.readouterr().err


def test_a_passing_variant_whose_files_are_not_its_manifests_is_not_registered(tmp_path):
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    (tmp_path / "models/variants/awq4/model.safetensors").write_bytes(b"replaced after it was gated")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    assert [r["variant"] for r in summary["registered"]] == ["int8"]
    assert summary["unregistered"][0]["variant"] == "awq4"
    assert "models/variants/awq4/model.safetensors: sha256 " in summary["unregistered"][0]["reason"]
    client = MlflowClient(uri)
    assert client.get_model_version_by_alias("quantgate-reference", "candidate").tags["variant"] == "int8"
    assert client.list_artifacts(summary["children"]["awq4"], "checkpoint") == []


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
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
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
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
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


def locked_workspace(tmp_path, holder: str, heartbeat: float) -> tuple[dict, str, str]:
    """(recordable results, store uri, lock name) with that lock already held by `holder`."""
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300, lose=60) for d in ("math", "code")}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lock = store_client.RECORDING_LOCK + built["digest"][:16]
    MlflowClient(uri).create_registered_model(lock, tags={"heartbeat": str(heartbeat), "holder": holder})
    return built, uri, lock


def record_into(built: dict, uri: str, tmp_path) -> dict:
    return record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                  artifact_root=tmp_path / "artifacts")


def test_a_recording_lock_left_by_a_dead_process_is_taken_over(tmp_path, monkeypatch):
    """record holds `quantgate-recording-<digest>` while it writes; one whose heartbeat stopped is a dead holder's."""
    built, uri, _ = locked_workspace(tmp_path, "gone:1", 1000.0)
    summary = record_into(built, uri, tmp_path)
    assert summary["status"] == "recorded"
    assert [m.name for m in MlflowClient(uri).search_registered_models()] == ["quantgate-reference"]  # the lock is gone


def test_a_live_recording_lock_is_waited_for(tmp_path, monkeypatch):
    import threading
    import time

    built, uri, lock = locked_workspace(tmp_path, "other:1", time.time())
    monkeypatch.setattr(store_client, "LOCK_POLL_S", 0.1)
    released = threading.Timer(1.5, lambda: MlflowClient(uri).delete_registered_model(lock))
    began = time.time()
    released.start()
    summary = record_into(built, uri, tmp_path)
    assert summary["status"] == "recorded" and time.time() - began >= 1.5


def test_a_fresh_lock_of_a_dead_process_on_this_machine_is_taken_over_at_once(tmp_path):
    """A `record` killed here (SIGKILL, a crash) leaves its lock beating-fresh: its pid is gone, so no 5-minute wait."""
    import socket
    import subprocess
    import time

    gone = subprocess.Popen(["true"])
    gone.wait()
    built, uri, _ = locked_workspace(tmp_path, f"{socket.gethostname()}:{gone.pid}", time.time())
    began = time.time()
    summary = record_into(built, uri, tmp_path)
    assert summary["status"] == "recorded" and time.time() - began < store_client.LOCK_STALE_S / 10


def test_a_dataset_logged_by_another_pipeline_at_the_same_moment_is_linked_not_lost(tmp_path, monkeypatch):
    """Two recordings logging the same calibration set race in the store (both insert it); the loser's call is
    rolled back whole and repeated, and its run gets the input once. Any other store error is not retried."""
    import mlflow
    from mlflow.exceptions import MlflowException

    monkeypatch.setattr(record.time, "sleep", lambda s: None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
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
