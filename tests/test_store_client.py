"""pipelines/store/client.py's recording lease lock: a dead holder's lock is taken over, a live one waited for."""

from __future__ import annotations

import contextlib

import pytest
from mlflow import MlflowClient

from pipelines import record
from pipelines.store import client as store_client
from tests.handmade import correctness
from tests.store_helpers import N, sqlite_store, write_recordable


def locked_workspace(tmp_path, holder: str, heartbeat: float) -> tuple[dict, str, str]:
    """(recordable results, store uri, lock name) with that lock already held by `holder`."""
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300, lose=60) for d in ("math", "code")}})
    uri = sqlite_store(tmp_path)
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


def test_a_lock_released_while_mlflow_reports_the_clash_is_taken_at_the_next_try(tmp_path, monkeypatch):
    """MLflow's SQL store answers a clash by looking the holder up; released in that moment, the lookup says the
    model does not exist (RESOURCE_DOES_NOT_EXIST, not ALREADY_EXISTS): the lock is free, so it is tried again."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    client = MlflowClient(sqlite_store(tmp_path))
    real, calls = client.create_registered_model, []

    def released_in_between(name, **kwargs):
        calls.append(name)
        if len(calls) == 1:
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
        return real(name, **kwargs)

    monkeypatch.setattr(client, "create_registered_model", released_in_between)
    with store_client.recording_lock(client, "ab" * 32) as name:
        assert len(calls) == 2 and client.get_registered_model(name).name == name
    assert client.search_registered_models() == []
    # and a store that keeps answering so is no race: its own error stands, after a few tries

    def never_there(name, **kwargs):
        calls.append(name)
        raise MlflowException("no registry here", RESOURCE_DOES_NOT_EXIST)

    monkeypatch.setattr(client, "create_registered_model", never_there)
    calls.clear()
    with pytest.raises(MlflowException, match="no registry here"):
        with store_client.recording_lock(client, "cd" * 32):
            pass
    assert len(calls) == 6


def test_a_new_test_store_is_what_mlflow_makes_and_each_copy_its_own(tmp_path):
    """sqlite_store (tests/store_helpers.py) copies a store MLflow made instead of migrating one per test: the copy has
    the tables, indexes and schema revision of a store MLflow makes here now, two copies share nothing, and the Default
    experiment's artifacts sit beside each copy."""
    import sqlite3

    def schema(uri: str) -> list:
        """Each table's and index's definition, its lines sorted: MLflow's own migrations order a table's CHECK
        constraints differently from one store to the next."""
        with contextlib.closing(sqlite3.connect(uri.removeprefix("sqlite:///"))) as con:
            made = con.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
            return sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                          for kind, name, sql in made) + con.execute("SELECT version_num FROM alembic_version").fetchall()

    made = f"sqlite:///{tmp_path / 'made.db'}"
    MlflowClient(made).search_experiments()  # MLflow's own migrations, in this test
    a, b = sqlite_store(tmp_path / "a"), sqlite_store(tmp_path / "b")
    assert schema(a) == schema(made) and len(schema(made)) > 20
    MlflowClient(a).create_experiment("only-in-a")
    assert [e.name for e in MlflowClient(b).search_experiments()] == ["Default"]
    assert MlflowClient(b).get_experiment("0").artifact_location == str((tmp_path / "b" / "mlruns" / "0").resolve())
    assert sqlite_store(tmp_path / "a") == a and MlflowClient(a).get_experiment_by_name("only-in-a")  # kept, not replaced
