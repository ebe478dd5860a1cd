"""Helpers for the record, gate and store tests: recordable hand-made results, reading a recording back, fetch, the gate."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient

from pipelines import cli
from pipelines.core import lineage
from pipelines.core.io import read_json, sha256_file, write_json
from pipelines.store import client as store_client
from tests.handmade import correctness, rerun_compare, write_pipeline

N = 400
GOOD = {d: correctness(N, 300, lose=1) for d in ("math", "code")}


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


def runs_of(uri, experiment="handmade"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, exp, client.search_runs([exp.experiment_id])


def stored_checkpoint(uri, run_id):
    """The folder a child run's `checkpoint/` artifact lives in, resolved through MLflow."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository
    from mlflow.utils.file_utils import local_file_uri_to_path

    with store_client.using_store(uri):
        return Path(local_file_uri_to_path(RunsArtifactRepository.get_underlying_uri(f"runs:/{run_id}/checkpoint")))


def fetch(uri, monkeypatch, *args):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return cli.main(["fetch", *args, "--model", "quantgate-reference"])


def answers(int8=None, awq4=None):
    return {"fp16": {d: correctness(N, 300) for d in ("math", "code")}, "int8": int8 or GOOD,
            "awq4": awq4 or {"math": correctness(N, 300, lose=60), "code": correctness(N, 300)}}


def run_gate(*args):
    code = cli.main(["gate", *args])
    with open("results/report.md") as report:
        return code, read_json("results/gate.json"), report.read()
