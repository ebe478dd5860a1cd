"""The doctor's rows for the tools the run drives: the MLflow tracking store the record stage writes to, dvc, and the
OpenAI-compatible endpoints candidates are served at. Each is reached the cheapest way that proves it works (a
folder's write bit, a /health reply and one logged-in API call, an open port, /v1/models and a one-token completion)."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import sqlite3
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipelines.diagnose.check import FAIL, OK, WARN, Check, existing, installed_version

MLFLOW_TIMEOUT_S = 3.0


def mlflow_check(uri: str | None = None) -> Check:
    """The tracking store the record stage writes to (store.tracking.tracking_uri: MLFLOW_TRACKING_URI, else mlflow.db at the
    repository root): a SQLite file's folder writable, a server answering /health, a database's port open."""
    if uri is None:
        from pipelines.store.tracking import tracking_uri

        uri = tracking_uri()
    version = installed_version("mlflow")
    if version is None:
        return Check("mlflow", FAIL, "mlflow is not installed", "bash scripts/setup.sh")
    scheme = uri.split(":", 1)[0].lower() if "://" in uri or uri.startswith("sqlite:") else "file"
    where = f"MLFLOW_TRACKING_URI={uri}" if os.environ.get("MLFLOW_TRACKING_URI") else uri
    fix = "set MLFLOW_TRACKING_URI to a reachable store, or unset it for the local mlflow.db (README, MLflow)"
    if scheme == "sqlite":
        path = Path(uri[len("sqlite:///"):])  # sqlite:////abs/mlflow.db or sqlite:///relative.db
        if not path.parent.is_dir():
            return Check("mlflow", FAIL, f"{where}: folder {path.parent} does not exist", fix)
        if path.exists():
            if not os.access(path, os.W_OK):
                return Check("mlflow", FAIL, f"{where}: {path} is not writable", fix)
            try:
                with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=MLFLOW_TIMEOUT_S) as db:
                    db.execute("select count(*) from sqlite_master").fetchone()
            except sqlite3.Error as err:
                return Check("mlflow", FAIL, f"{where}: {path} is not a readable SQLite database ({err})", fix)
            return Check("mlflow", OK, f"{where} (mlflow {version}): exists, writable")
        if not os.access(path.parent, os.W_OK):
            return Check("mlflow", FAIL, f"{where}: folder {path.parent} is not writable", fix)
        return Check("mlflow", OK, f"{where} (mlflow {version}): created by the record stage")
    if scheme in ("http", "https"):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=MLFLOW_TIMEOUT_S) as reply:
                if reply.status == 200:
                    return _login_check(uri, f"{where} (mlflow {version}): server answers {health}")
                said = f"HTTP {reply.status}"
        except urllib.error.HTTPError as err:
            said = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError, ValueError) as err:
            said = str(getattr(err, "reason", err))
        return Check("mlflow", FAIL, f"{where}: no MLflow server answers {health} within {MLFLOW_TIMEOUT_S:.0f} s "
                                     f"({said})", f"start it (python scripts/mlflow_server.py start --dir DIR), or {fix}")
    if scheme in ("postgresql", "mysql", "mssql") or scheme.startswith(("postgresql+", "mysql+", "mssql+")):
        parsed = urllib.parse.urlparse(uri)
        port = parsed.port or {"postgresql": 5432, "mysql": 3306, "mssql": 1433}[scheme.split("+")[0]]
        try:
            socket.create_connection((parsed.hostname or "localhost", port), timeout=MLFLOW_TIMEOUT_S).close()
        except OSError as err:
            return Check("mlflow", FAIL, f"{where}: {parsed.hostname}:{port} does not accept connections ({err})", fix)
        return Check("mlflow", OK, f"{where} (mlflow {version}): port open (credentials not checked)")
    if scheme == "file":
        path = Path(urllib.parse.urlparse(uri).path if uri.startswith("file:") else uri)
        folder = existing(path)
        if not os.access(folder, os.W_OK):
            return Check("mlflow", FAIL, f"{where}: {folder} is not writable", fix)
        return Check("mlflow", OK, f"{where} (mlflow {version}): folder store, writable")
    return Check("mlflow", WARN, f"{where}: a {scheme} store, not checked here")


def _login_check(uri: str, answered: str) -> Check:
    """/health is public even behind MLflow's login: one API call with the login MLflow's clients send
    (MLFLOW_TRACKING_USERNAME/PASSWORD) shows whether record, gate and fetch will get in, and whether the server
    lets anyone in."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    request = urllib.request.Request(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=MLFLOW_TIMEOUT_S) as reply:
            code = reply.status
    except urllib.error.HTTPError as err:
        code = err.code
    except (urllib.error.URLError, OSError, ValueError) as err:
        return Check("mlflow", FAIL, f"{answered}, but its API does not ({getattr(err, 'reason', err)})")
    if code == 200 and user and password:
        return Check("mlflow", OK, f"{answered}; logged in as {user}")
    if code == 200:
        return Check("mlflow", WARN, f"{answered}, and serves anyone without a login: whoever reaches it can move "
                                     "`production`", "start it with MLflow's login: python scripts/mlflow_server.py start")
    if code == 401 and not (user and password):
        return Check("mlflow", FAIL, f"{answered}; it requires a login and none is set",
                     "export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (scripts/mlflow_server.py start "
                     "prints them)")
    if code in (401, 403):
        return Check("mlflow", FAIL, f"{answered}; it refuses the login of {user} (HTTP {code})",
                     "check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    return Check("mlflow", FAIL, f"{answered}, but its API answers HTTP {code}: not an MLflow tracking server?")


def dvc_check() -> Check:
    found = shutil.which("dvc")
    version = installed_version("dvc")
    if found:
        return Check("dvc", OK, f"{found} (dvc {version})")
    beside = Path(sys.executable).with_name("dvc")
    if beside.is_file():
        return Check("dvc", WARN, f"not on PATH; {beside} (dvc {version})", f"export PATH={beside.parent}:$PATH "
                                                                            "(scripts/run.sh does)")
    return Check("dvc", FAIL, "dvc is not installed", "bash scripts/setup.sh")


def endpoint_check(name: str, endpoint: dict, key: str | None = None) -> Check:
    """A candidate's server (candidates.<name>.endpoint), or fp16's (baseline.endpoint, `key` its params key):
    reachable, the model listed, prompt logprobs returned (what lm-eval's log-likelihood tasks need; without them those
    rows are refused and the generation rows still judged)."""
    from pipelines.evaluation.endpoints import check

    label = f"endpoint {name}"
    state = check(endpoint)
    if state["problem"]:
        return Check(label, FAIL, state["problem"], f"start the server, or fix {key or 'candidates.' + name}.endpoint "
                     "(base_url up to /v1, model as /v1/models lists it, api_key_env naming a set variable)")
    if not state["logprobs"]:
        return Check(label, WARN, f"{endpoint['base_url']} serves {endpoint['model']!r}, but {state['logprobs_problem']}: "
                     "its log-likelihood (multiple-choice) rows will be refused", "judge those rows through a server "
                     "whose prompt logprobs are the model's (vLLM, SGLang), or from an lm-eval sample log")
    return Check(label, OK, f"{endpoint['base_url']} serves {endpoint['model']!r} with prompt logprobs")
