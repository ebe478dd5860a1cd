"""Talking to quantgate's MLflow store: the client for one block, the experiment, the registered model, and
the lock that lets one `record` of a result run at a time across every machine sharing the store.

record writes through these, gate and fetch read through them; none of it knows what a run shows.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
from mlflow import MlflowClient

RECORDING_LOCK = "quantgate-recording-"  # + the digest's first 16 hex: a registered model that exists while one `record` runs
LOCK_BEAT_S, LOCK_STALE_S, LOCK_POLL_S = 30.0, 300.0, 2.0  # holder's heartbeat; a lock not beaten that long is a dead holder's


@contextlib.contextmanager
def using_store(uri: str) -> Iterator[MlflowClient]:
    """MLflow's fluent API pointed at `uri` for the block only.

    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI to every later subprocess (a `dvc repro`
    started by the same process would record into this store): put back what was there before.
    """
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield MlflowClient(uri)
    finally:
        mlflow.set_tracking_uri(before)  # None unsets the variable again


def experiment_id(client: MlflowClient, name: str, artifact_root: Path | None) -> str:
    """The experiment, created once up front with artifacts beside the store (not in the cwd's ./mlruns);
    artifact_root None: where the tracking server puts them (its --artifacts-destination)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:  # the kind tag opens the experiment on MLflow 3's "Training runs" page instead of its GenAI overview
        return client.create_experiment(name, artifact_location=artifact_root.resolve().as_uri() if artifact_root else None,
                                        tags={"mlflow.experimentKind": "custom_model_development"})
    except Exception:
        # another pipeline recording into the same server made it between the lookup and here: use theirs
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def ensure_registered_model(client: MlflowClient, model_name: str) -> None:
    """The registered model, made once; a concurrent recording that made it first is no error."""
    if client.search_registered_models(f"name = '{model_name}'"):
        return
    try:
        client.create_registered_model(model_name, description="quantgate: quantized variants that passed the gate")
    except Exception:
        if not client.search_registered_models(f"name = '{model_name}'"):
            raise


@contextlib.contextmanager
def recording_lock(client: MlflowClient, digest: str) -> Iterator[str]:
    """One `record` of these results at a time, across every machine that shares the store.

    Two recordings of the same results at once would each find no finished run and both write one (or the
    second would take the first's unfinished run for a crashed one and delete it). The store's unique
    registered-model names make the lock: whoever creates `quantgate-recording-<digest>` holds it, the
    others wait; the holder beats a heartbeat tag and deletes it at the end. A lock whose heartbeat is older
    than LOCK_STALE_S belongs to a process that died (killed mid-upload) and is taken over; so, at once, does
    one whose holder ran on this machine and is gone.
    """
    from mlflow.exceptions import MlflowException

    name = RECORDING_LOCK + digest[:16]
    holder = f"{socket.gethostname()}:{os.getpid()}"
    released_meanwhile = 0
    while True:
        try:
            client.create_registered_model(name, tags={"heartbeat": str(time.time()), "holder": holder},
                                           description="quantgate: a `record` of these results is running (removed when it ends)")
            break
        except MlflowException as err:
            # MLflow's SQL store answers a clash by looking the holder up: released in that moment, the lookup finds
            # nothing. Try again, a few times (more in a row is no race: then the store's own error stands)
            if err.error_code == "RESOURCE_DOES_NOT_EXIST" and released_meanwhile < 5:
                released_meanwhile += 1
                continue
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            held = client.get_registered_model(name)
        except MlflowException:
            continue  # released in between: try again
        try:
            beat = float(held.tags.get("heartbeat", "0"))
        except ValueError:
            beat = 0.0
        if time.time() - beat > LOCK_STALE_S or _dead_here(held.tags.get("holder", "")):
            with contextlib.suppress(MlflowException):
                client.delete_registered_model(name)  # its holder stopped beating: it died
            continue
        time.sleep(LOCK_POLL_S)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(LOCK_BEAT_S):
            with contextlib.suppress(Exception):
                client.set_registered_model_tag(name, "heartbeat", str(time.time()))

    beating = threading.Thread(target=heartbeat, name="quantgate-record-lock", daemon=True)
    beating.start()
    try:
        yield name
    finally:
        stop.set()
        beating.join()
        with contextlib.suppress(Exception):  # a store gone away: the lock goes stale and is taken over
            client.delete_registered_model(name)


def _dead_here(holder: str) -> bool:
    """The lock's holder ran on this machine and its process is gone (killed): no need to wait for staleness."""
    import psutil

    host, _, pid = holder.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid))


def served(tracking_uri: str) -> bool:
    """A tracking server: it, not this machine's folders, decides where artifacts go, so that a registered
    checkpoint is reachable from every machine that reaches the server."""
    return tracking_uri.split(":", 1)[0] in ("http", "https", "databricks")

