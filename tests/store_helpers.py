"""Helpers for the record, gate and store tests: a new MLflow store, recordable hand-made results, reading a recording
back, fetch, the gate."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import sqlite3
import tempfile
from functools import cache
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


@cache
def _migrated_store() -> Path:
    """An MLflow SQLite store that MLflow made and migrated itself, with nothing recorded: once per process."""
    folder = Path(tempfile.mkdtemp(prefix="quantgate-mlflow-store-"))
    atexit.register(shutil.rmtree, folder, True)
    MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
    return folder / "mlflow.db"


def sqlite_store(folder: Path, name: str = "mlflow.db") -> str:
    """The URI of a new, empty MLflow store in `folder` (kept where one is there): a copy of _migrated_store, as MLflow
    makes one, without MLflow's table migrations in every test (2-4 s each on the CI machine). Its Default
    experiment's artifacts sit beside it, where MLflow puts them when it runs in `folder`."""
    db = Path(folder) / name
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_store(), db)
        with contextlib.closing(sqlite3.connect(db)) as con, con:
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                        (str(db.parent.resolve() / "mlruns" / "0"),))
    return f"sqlite:///{db}"


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
