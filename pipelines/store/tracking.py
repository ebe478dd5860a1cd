"""Where quantgate's MLflow store is: MLFLOW_TRACKING_URI, else a SQLite file at the repository root.

record writes there, gate and fetch read there, doctor checks it, `quantgate ui` opens it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipelines.core.paths import MLARTIFACTS, MLFLOW_DB, PROFILE_MARKER

log = logging.getLogger("pipelines.store")


def repository_root() -> Path:
    """DVC_ROOT in dvc runs (stages may run from a subfolder), else the current folder."""
    return Path(os.environ.get("DVC_ROOT", ".")).resolve()


def store_root() -> Path:
    """Where the default store lives: the repository root, or for a profile's workspace (`quantgate profile`) the
    checkout it was made from, so a profile's runs sit in the same experiment as the default run's."""
    root = repository_root()
    marker = root / PROFILE_MARKER
    if not marker.is_file():
        return root
    try:
        named = json.loads(marker.read_text(encoding="utf-8")).get("store_root")
    except (OSError, ValueError, AttributeError):
        named = None
    if not named or not Path(named).is_dir():  # never a store of its own that no UI would show
        from pipelines.core.errors import QuantgateError

        raise QuantgateError(f"{marker}: the checkout whose MLflow store this workspace records into "
                             f"({named or 'not named'}) is not here: run `quantgate profile NAME` there again, or set "
                             "MLFLOW_TRACKING_URI")
    return Path(named)


def artifact_root() -> Path:
    """Artifacts of a SQLite store live beside its file: the default store's at the repository root (DVC_ROOT in dvc
    runs) or the checkout a workspace records into, MLFLOW_TRACKING_URI's beside the file it names, never in the cwd."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).resolve().parent / MLARTIFACTS
    return store_root() / MLARTIFACTS


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set, else the SQLite store at the repository root (DVC_ROOT in dvc runs), or at the
    checkout a profile's workspace was made from."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    return f"sqlite:///{store_root() / MLFLOW_DB}"


def ui(port: int = 5000) -> int:
    """`quantgate ui`: the MLflow UI on localhost over quantgate's tracking store (a tracking server is its own UI)."""
    uri = tracking_uri()
    if uri.split(":", 1)[0] in ("http", "https"):
        log.info("MLflow UI: MLFLOW_TRACKING_URI names a tracking server, which serves the UI itself: open %s", uri)
        return 0
    mlflow = shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow"))
    cmd = [mlflow, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    log.info("MLflow UI on http://127.0.0.1:%d (Ctrl-C stops it)", port)
    return subprocess.call(cmd)
