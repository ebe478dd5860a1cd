"""MLflow on a server: scripts/mlflow_server.py starts a tracking server over its own PostgreSQL cluster, locked by
MLflow's login; `quantgate record`, `gate --promote`, `fetch` and the UI check run against it with the credentials in
MLFLOW_TRACKING_USERNAME/PASSWORD only, a request without them is refused, and two pipelines recording at the same
time both end complete. The fixture stops the server and checks that nothing of it is left running.

Needs Debian's postgresql (/usr/lib/postgresql/<version>/bin); `.ci/run` installs it and sets
QUANTGATE_REQUIRE_POSTGRES=1, so in CI a missing PostgreSQL fails instead of skipping.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipelines import cli
from tests.conftest import ROOT
from tests.handmade import correctness
from tests.store_helpers import write_recordable
from tests.test_mlflow_ui import CHROMIUM

SCRIPT = ROOT / "scripts/mlflow_server.py"
N = 400
MODEL = "quantgate-reference"

HAVE_POSTGRES = any(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
if not HAVE_POSTGRES and not os.environ.get("QUANTGATE_REQUIRE_POSTGRES"):
    pytest.skip("no PostgreSQL here (apt-get install postgresql); CI requires it", allow_module_level=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def leftovers(state: dict) -> list[str]:
    """Live (not zombie) processes of the server: MLflow's process group and the postmaster with its children."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == state["mlflow_pgid"] or proc.pid == state["postgres_pid"] or \
                    proc.info["ppid"] == state["postgres_pid"]:
                left.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:80]}")
        except (psutil.Error, ProcessLookupError):
            pass
    return left


@pytest.fixture(scope="module")
def server():
    """A tracking server with a PostgreSQL backend store, started by the script; stopped, and checked gone, after."""
    assert HAVE_POSTGRES, "PostgreSQL is not installed (apt-get install postgresql): QUANTGATE_REQUIRE_POSTGRES is set"
    # not under pytest's tmp folder: /tmp/pytest-of-root is 0700, and PostgreSQL runs as the postgres user
    folder = Path(tempfile.mkdtemp(prefix="quantgate-mlflow-server-"))
    folder.chmod(0o755)
    began = time.time()
    started = script("start", "--dir", str(folder), "--port", str(free_port()), "--workers", "2")
    started_s = time.time() - began
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        state = json.loads((folder / "server.json").read_text())
        password = (folder / "admin_password").read_text().strip()
        assert f"export MLFLOW_TRACKING_URI={state['tracking_uri']}" in started.stdout
        assert "export MLFLOW_TRACKING_USERNAME=admin" in started.stdout
        assert f'export MLFLOW_TRACKING_PASSWORD="$(cat {folder / "admin_password"})"' in started.stdout
        assert password not in started.stdout + started.stderr + (folder / "mlflow.log").read_text()
        with pytest.MonkeyPatch.context() as env:  # how every client below logs in, as MLflow's clients do
            env.setenv("MLFLOW_TRACKING_USERNAME", "admin")
            env.setenv("MLFLOW_TRACKING_PASSWORD", password)
            yield {**state, "dir": folder, "start_seconds": started_s, "password": password}
    finally:
        state = json.loads((folder / "server.json").read_text()) if (folder / "server.json").is_file() else None
        stopped = script("stop", "--dir", str(folder))
        left = leftovers(state) if state else []
        shutil.rmtree(folder, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not left, f"still running after stop: {left}"


def workspace(root: Path, int8_lose: int, experiment: str = "handmade", model: str | None = None) -> dict:
    """A finished hand-made pipeline whose int8 passes and awq4 fails math; its results digest differs by int8_lose."""
    root.mkdir(parents=True)
    built = write_recordable(root, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                    "int8": {d: correctness(N, 300, lose=int8_lose) for d in ("math", "code")},
                                    "awq4": {"math": correctness(N, 300, lose=60), "code": correctness(N, 300)}})
    if experiment != "handmade":  # mlflow settings are no stage's params: dvc.lock (and the digest) stay as they are
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["mlflow"]["experiment"] = experiment
        params["mlflow"]["registered_model"] = model
        (root / "params.yaml").write_text(yaml.safe_dump(params))
    return built


def quantgate(root: Path, uri: str, *args) -> subprocess.Popen:
    """`quantgate <args>` in the workspace, against the server, as its own process (the worktree's package)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, timeout=300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def parents_and_children(client: MlflowClient, experiment: str) -> tuple[list, dict]:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("quantgate.kind") == "pipeline"]
    children = {p.info.run_id: sorted(r.data.tags["quantgate.variant"] for r in runs  # run names carry the verdicts
                                      if r.data.tags.get("mlflow.parentRunId") == p.info.run_id)
                for p in parents}
    return parents, children


def test_record_gate_promote_fetch_and_the_ui_against_the_server(server, tmp_path, monkeypatch):
    uri = server["tracking_uri"]
    root = tmp_path / "repo"
    built = workspace(root, int8_lose=1)
    began = time.time()
    out = finished(quantgate(root, uri, "record"))
    record_s = time.time() - began
    assert "registered int8 as quantgate-reference version" in out, out
    recorded = json.loads((root / "results/mlflow_run.json").read_text())
    assert recorded["tracking_uri"] == uri and recorded["results_digest"] == built["digest"]
    client = MlflowClient(uri)
    parents, children = parents_and_children(client, "handmade")
    assert [p.info.run_id for p in parents] == [recorded["parent_run_id"]]
    assert children[recorded["parent_run_id"]] == ["awq4", "fp16", "int8"]
    assert client.get_experiment_by_name("handmade").artifact_location.startswith("mlflow-artifacts:/")
    assert not (root / "mlartifacts").exists() and not (root / "mlflow.db").exists()  # all of it on the server
    assert list((server["dir"] / "artifacts").rglob("checkpoint/model.safetensors"))
    # a second record of the same results writes nothing
    assert "already recorded" in finished(quantgate(root, uri, "record"))
    assert len(parents_and_children(client, "handmade")[0]) == 1

    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert cli.main(["gate", "--variant", "int8", "--promote"]) == 0
    gate = json.loads((root / "results/gate.json").read_text())
    assert gate["promotion"]["status"] == "promoted", gate
    production = client.get_model_version_by_alias(MODEL, "production")
    assert production.tags["variant"] == "int8" and production.tags["quantgate.results_digest"] == built["digest"]
    assert cli.main(["fetch", "production", "--dest", str(tmp_path / "fetched"), "--model", MODEL]) == 0
    assert (tmp_path / "fetched/model.safetensors").read_bytes() == (root / "models/variants/int8/model.safetensors").read_bytes()
    assert cli.main(["ui"]) == 0  # the server is the UI: nothing to start

    if CHROMIUM.exists() or os.environ.get("QUANTGATE_REQUIRE_BROWSER"):
        shot = tmp_path / "shots" / "compare.png"
        ui = subprocess.run([sys.executable, str(ROOT / "scripts/check_mlflow_ui.py"), "--tracking-uri", uri,
                             "--experiment", "handmade", "--screenshot", str(shot), "--metric", "code/accuracy",
                             "--metric", "memory/footprint_bytes"], capture_output=True, text=True, timeout=600)
        assert ui.returncode == 0, ui.stdout + ui.stderr
        assert shot.stat().st_size > 20_000
    print(f"\nserver start {server['start_seconds']:.1f} s, record one pipeline {record_s:.1f} s")


def test_two_pipelines_recording_at_the_same_time_both_end_complete(server, tmp_path):
    """Separate workspaces, different results, one experiment and one registered model that neither made yet;
    a third workspace holds a's results again (a copy) and records them at the same time: it waits for a's
    recording and writes nothing."""
    uri = server["tracking_uri"]
    experiment, model = "concurrent", "quantgate-concurrent"
    a = workspace(tmp_path / "a", int8_lose=1, experiment=experiment, model=model)
    b = workspace(tmp_path / "b", int8_lose=2, experiment=experiment, model=model)
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy", symlinks=True)
    assert a["digest"] != b["digest"]
    client = MlflowClient(uri)
    began = time.time()
    procs = [quantgate(tmp_path / name, uri, "record") for name in ("a", "b", "a-copy")]
    outs = [finished(p) for p in procs]
    print(f"\nthree concurrent records {time.time() - began:.1f} s")
    parents, children = parents_and_children(client, experiment)
    assert sorted(p.data.tags["quantgate.results_digest"] for p in parents) == sorted([a["digest"], b["digest"]]), outs
    for parent in parents:
        assert parent.info.status == "FINISHED" and parent.data.tags["quantgate.complete"] == "true"
        assert children[parent.info.run_id] == ["awq4", "fp16", "int8"]
    versions = client.search_model_versions(f"name = '{model}'")
    assert sorted(v.tags["quantgate.results_digest"] for v in versions) == sorted([a["digest"], b["digest"]])
    assert {v.tags["variant"] for v in versions} == {"int8"}
    assert all(client.get_run(v.run_id).data.tags["mlflow.parentRunId"] in children for v in versions)
    candidate = client.get_model_version_by_alias(model, "candidate")
    assert candidate.version in {v.version for v in versions}
    # each recording's summary names its parent run; of a and its copy, one recorded and one found it recorded
    summaries = {name: json.loads((tmp_path / name / "results/mlflow_run.json").read_text()) for name in ("a", "b", "a-copy")}
    assert all(summary["parent_run_id"] in children for summary in summaries.values())
    assert summaries["b"]["status"] == "recorded"
    assert sorted(summaries[n]["status"] for n in ("a", "a-copy")) == ["already recorded", "recorded"], outs
    assert summaries["a"]["parent_run_id"] == summaries["a-copy"]["parent_run_id"]
    assert not client.search_registered_models("name LIKE 'quantgate-recording-%'")  # every lock released


def test_clear_errors_from_the_script(server, tmp_path):
    busy = script("start", "--dir", str(tmp_path / "other"), "--port", str(server["port"]))
    assert busy.returncode == 2 and f"--port {server['port']} is busy" in busy.stderr and "Traceback" not in busy.stderr
    again = script("start", "--dir", str(server["dir"]), "--port", str(free_port()))
    assert again.returncode == 2 and "already runs" in again.stderr
    assert script("status", "--dir", str(server["dir"])).returncode == 0
    assert script("stop", "--dir", str(tmp_path / "never")).returncode == 0
    for host in ("0.0.0.0", "192.0.2.1"):  # beyond loopback without a login: refused before anything is made
        open_ = script("start", "--dir", str(tmp_path / "open"), "--host", host, "--no-auth", "--port", str(free_port()))
        assert open_.returncode == 2 and f"--host {host} with --no-auth" in open_.stderr, open_.stderr
        assert not (tmp_path / "open").exists()
    deep = tmp_path / ("d" * 100)  # PostgreSQL's socket would not fit a Unix socket's 107 bytes: said before initdb
    too_long = script("start", "--dir", str(deep), "--port", str(free_port()))
    assert too_long.returncode == 2 and "too long a path" in too_long.stderr and not deep.exists(), too_long.stderr


def request(url: str, user: str | None = None, password: str | None = None) -> int:
    """The HTTP status of a GET, with basic auth when given."""
    headers = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()} if user else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_server_serves_only_a_login(server, monkeypatch):
    """Anonymous and wrong-password requests are refused (401); the admin's are served; MLflow's client and quantgate's
    store reach it with the environment's credentials and fail without them; its secrets are owner-only files."""
    from mlflow.exceptions import MlflowException

    from pipelines.store.client import ensure_registered_model, using_store

    url = f"{server['tracking_uri']}/api/2.0/mlflow/experiments/search?max_results=1"
    assert request(url) == 401
    assert request(url, "admin", server["password"] + "x") == 401
    assert request(url, "admin", server["password"]) == 200
    assert request(f"{server['tracking_uri']}/health") == 200  # public: how start and the doctor see it up
    with using_store(server["tracking_uri"]) as client:  # credentials from MLFLOW_TRACKING_USERNAME/PASSWORD
        ensure_registered_model(client, "quantgate-login-check")
        assert client.get_registered_model("quantgate-login-check").name == "quantgate-login-check"
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    with pytest.raises(MlflowException, match="401|authenticated"):
        MlflowClient(server["tracking_uri"]).search_registered_models()
    for name in ("admin_password", "credentials.json", "auth.ini"):
        assert (server["dir"] / name).stat().st_mode & 0o777 == 0o600, name
    assert "database_uri = postgresql://" in (server["dir"] / "auth.ini").read_text()


def test_no_postgresql_is_named_with_the_package_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mlflow_server", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys.modules["mlflow_pg"], "PG_ROOT", tmp_path / "no-postgresql")
    assert module.main(["start", "--dir", str(tmp_path / "srv"), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "PostgreSQL is not installed" in err and "apt-get install postgresql" in err and "Traceback" not in err
