"""`quantgate doctor` (pipelines/doctor.py, its checks in pipelines/diagnose/) and setup's system step: real checks
on this machine, bubblewrap hidden per process (a PATH of links to every system tool but the hidden ones), never
uninstalled.

The sandbox cases need root and util-linux (the sandbox's own requirements, pipelines/core/sandbox.py); CI runs as root
with both (.ci/run), so there they run."""

from __future__ import annotations

import base64
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from pipelines import doctor
from pipelines.core import sandbox
from pipelines.diagnose import check, devices, tools
from pipelines.diagnose import model as model_checks
from pipelines.diagnose import sandbox as sandbox_checks
from tests.conftest import ROOT

VENV_BIN = Path(sys.executable).parent
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
root_with_util_linux = pytest.mark.skipif(
    (os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")))
    and not os.environ.get("QUANTGATE_REQUIRE_SANDBOX"),  # CI sets it: there these tests fail, never skip
    reason="the sandbox probe needs root and util-linux (CI has both)")


def path_without(folder: Path, *hidden: str) -> str:
    """A PATH whose only folder holds links to every system tool except `hidden`: those are not found, nothing is
    uninstalled."""
    folder.mkdir(parents=True, exist_ok=True)
    for system in SYSTEM_DIRS:
        if not os.path.isdir(system):
            continue
        for name in os.listdir(system):
            link = folder / name
            if name not in hidden and not link.exists() and not link.is_symlink():
                link.symlink_to(os.path.join(system, name))
    return str(folder)


def write_params(tmp_path: Path, **changes) -> Path:
    """The repository's params.yaml with top-level sections changed (a dict is merged one level deep)."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def fresh_probe():
    """isolation_level() is cached per process: probe anew here, and leave no hidden-bwrap answer to later tests."""
    sandbox.isolation_level.cache_clear()
    yield
    sandbox.isolation_level.cache_clear()


def row(checks: list[check.Check], name: str) -> check.Check:
    return next(c for c in checks if c.name == name)


# --------------------------------------------------------------------------------------------
# The sandbox
# --------------------------------------------------------------------------------------------


@root_with_util_linux
def test_without_bubblewrap_the_doctor_exits_1_naming_the_package_and_command(tmp_path):
    """The README's case: no bwrap, the default params. `quantgate doctor` (a real process, real probe) fails the
    sandbox row, names bubblewrap and the command that installs it, and exits 1."""
    env = {**os.environ, "PATH": f"{VENV_BIN}:{path_without(tmp_path / 'bin', 'bwrap')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([str(VENV_BIN / "quantgate"), "doctor"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    sandbox_line = next(line for line in done.stdout.splitlines() if line.startswith("sandbox "))
    assert " FAIL " in sandbox_line and "bwrap not found" in sandbox_line and "code" in sandbox_line
    assert "-> apt-get install bubblewrap" in done.stdout and "allow_unisolated_code" in done.stdout
    assert "checks fail (sandbox)" in done.stdout.splitlines()[-1]
    for name in ("params", "torch", "device", "bnb-int8 (int8)", "gptq (gptq3)", "model", "disk", "mlflow", "dvc"):
        assert any(line.startswith(f"{name} ") for line in done.stdout.splitlines()), name


@root_with_util_linux
def test_allowing_unisolated_code_is_a_warning_and_exit_0(tmp_path, monkeypatch, fresh_probe):
    monkeypatch.setenv("PATH", f"{VENV_BIN}:{path_without(tmp_path / 'bin', 'bwrap')}")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    checks = doctor.run_checks(write_params(tmp_path, evaluate={"allow_unisolated_code": True}))
    got = row(checks, "sandbox")
    assert got.status == check.WARN and "allow_unisolated_code is true" in got.detail and "bwrap not found" in got.detail
    assert "apt-get install bubblewrap" in got.remedy
    assert doctor.exit_code(checks) == 0, [c for c in checks if c.status == check.FAIL]


@root_with_util_linux
def test_no_request_type_running_code_needs_no_sandbox(tmp_path, monkeypatch, fresh_probe):
    monkeypatch.setenv("PATH", f"{VENV_BIN}:{path_without(tmp_path / 'bin', 'bwrap')}")
    from pipelines.core.params import load_params

    got = sandbox_checks.sandbox_check(load_params(write_params(tmp_path, evaluate={"domains": ["math", "chat"]})))
    assert got.status == check.OK and "not needed" in got.detail


@root_with_util_linux
def test_a_kernel_that_restricts_user_namespaces_is_named_with_its_remedy(tmp_path, monkeypatch, fresh_probe):
    """Ubuntu's AppArmor switch (kernel.apparmor_restrict_unprivileged_userns=1): bubblewrap is installed but cannot
    make its namespaces. A bwrap that fails as it does there, and a /proc/sys that says so: the doctor names the
    switch and the sysctl that lifts it."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    sysctl = tmp_path / "sys"
    (sysctl / "kernel").mkdir(parents=True)
    (sysctl / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("1\n")
    monkeypatch.setattr(sandbox_checks, "SYSCTL", sysctl)
    from pipelines.core.params import load_params

    got = sandbox_checks.sandbox_check(load_params())
    assert got.status == check.FAIL and "bwrap cannot build the sandbox" in got.detail and "uid map" in got.detail
    assert "kernel.apparmor_restrict_unprivileged_userns=1" in got.remedy
    assert "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0" in got.remedy


def test_userns_switches_are_read_from_proc(tmp_path):
    (tmp_path / "kernel").mkdir()
    (tmp_path / "user").mkdir()
    (tmp_path / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("0\n")
    (tmp_path / "user" / "max_user_namespaces").write_text("0\n")
    assert sandbox_checks.userns_restrictions(tmp_path) == ["user.max_user_namespaces=0"]
    assert sandbox_checks.userns_restrictions(tmp_path / "absent") == []


def test_code_rows_follow_runs_code_and_sandboxed_tasks(tmp_path):
    from pipelines.core.params import load_params

    assert sandbox_checks.code_rows(load_params()) == ["code"]
    params = load_params(write_params(tmp_path, evaluate={"domains": ["math"]}))
    assert sandbox_checks.code_rows(params) == []


# --------------------------------------------------------------------------------------------
# Model, MLflow, params
# --------------------------------------------------------------------------------------------


def test_an_unknown_model_path_fails_naming_the_key(tmp_path):
    checks = doctor.run_checks(write_params(tmp_path, model=str(tmp_path / "no-such-checkpoint")))
    got = row(checks, "model")
    assert got.status == check.FAIL and "model:" in got.detail and "no-such-checkpoint" in got.detail
    assert "params.yaml" in got.remedy
    assert doctor.exit_code(checks) == 1


def test_a_local_checkpoint_is_described_from_its_config(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ROOT / "reference_model", ckpt)
    from pipelines.core.params import load_params

    params = load_params(write_params(tmp_path, model=str(ckpt)))
    got = model_checks.model_check(params)
    assert got.status == check.OK and "LlamaForCausalLM" in got.detail and "1,016,448 parameters" in got.detail
    disk = model_checks.disk_check(params)
    assert disk.status == check.OK and "1,016,448 parameters" in disk.detail and "fp16" in disk.detail


def test_a_hub_id_offline_and_not_cached_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    from pipelines.core.params import load_params

    got = model_checks.model_check(load_params(write_params(tmp_path, model="some-org/some-model")))
    assert got.status == check.FAIL and "HF_HUB_OFFLINE" in got.detail and "hf download" in got.remedy


def test_bad_params_fail_with_the_params_message(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("modle: reference\n")
    checks = doctor.run_checks(path)
    assert checks[0].name == "params" and checks[0].status == check.FAIL and "modle" in checks[0].detail
    assert doctor.exit_code(checks) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_uri_that_nothing_answers_is_reported(tmp_path, monkeypatch):
    uri = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    got = tools.mlflow_check()
    assert got.status == check.FAIL and uri in got.detail and "/health" in got.detail
    assert "MLFLOW_TRACKING_URI" in got.remedy
    got = tools.mlflow_check(f"sqlite:///{tmp_path}/no/such/folder/mlflow.db")
    assert got.status == check.FAIL and "does not exist" in got.detail
    (tmp_path / "broken.db").write_text("not a database " * 100)
    got = tools.mlflow_check(f"sqlite:///{tmp_path}/broken.db")
    assert got.status == check.FAIL and "SQLite" in got.detail
    assert tools.mlflow_check(f"postgresql://u:p@127.0.0.1:{_free_port()}/db").status == check.FAIL


def test_mlflow_server_login_and_the_default_store(tmp_path, monkeypatch):
    """A server that answers /health is checked with one API call carrying MLflow's client login: refused without
    one (FAIL, names the variables), served with it (OK), open to anyone (WARN)."""
    wanted = {"value": "Basic " + base64.b64encode(b"ci:s3cret").decode()}

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                code = 200
            elif self.path.startswith("/api/2.0/mlflow/experiments/search"):
                code = 200 if wanted["value"] in (None, self.headers.get("Authorization")) else 401
            else:
                code = 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_port}"
    try:
        monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
        got = tools.mlflow_check(uri)
        assert got.status == check.FAIL and "requires a login" in got.detail
        assert "MLFLOW_TRACKING_PASSWORD" in got.remedy
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ci")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
        got = tools.mlflow_check(uri)
        assert got.status == check.FAIL and "refuses the login of ci" in got.detail
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
        got = tools.mlflow_check(uri)
        assert got.status == check.OK and "answers" in got.detail and "logged in as ci" in got.detail
        wanted["value"] = None  # a server without a login
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
        got = tools.mlflow_check(uri)
        assert got.status == check.WARN and "without a login" in got.detail
    finally:
        server.shutdown()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    got = tools.mlflow_check()  # store.tracking.tracking_uri(): mlflow.db at the repository root
    assert got.status == check.OK and str(ROOT / "mlflow.db") in got.detail


def test_the_int8_kernel_runs_here():
    """bitsandbytes' LLM.int8 for real on the CPU (the doctor's check on this machine's device)."""
    assert devices.bnb_native_library("cpu").is_file()
    assert "matches fp32" in devices.bnb_int8_works("cpu")


def test_awq_backend_gptqmodel_on_a_cpu_fails(tmp_path):
    from pipelines.core.params import load_params

    params = load_params(write_params(tmp_path, variants={
        "fp16": {"method": "none", "dtype": "float16"},
        "awq4": {"method": "awq", "bits": 4, "group_size": 32, "backend": "gptqmodel"}}))
    got = row(devices.backend_checks(params, "cpu"), "awq (awq4)")
    assert got.status == check.FAIL and "needs CUDA" in got.detail and "autoawq" in got.remedy



def test_a_missing_backend_library_fails_naming_what_installs_it(tmp_path, monkeypatch):
    """Every method's row is built by one function: a library it needs and lacks fails the row, naming the library
    and the pin that installs it; awq and gptq without a usable device are not looked at further."""
    from pipelines.core.params import load_params

    params = load_params(write_params(tmp_path, variants={
        "fp16": {"method": "none", "dtype": "float16"}, "int8": {"method": "bnb-int8"},
        "awq4": {"method": "awq", "bits": 4, "group_size": 32, "backend": "autoawq"},
        "gptq3": {"method": "gptq", "bits": 3, "group_size": 32}}))
    monkeypatch.setattr(devices, "libraries", lambda pairs: ([], [dist for dist, _ in pairs]))
    rows = {c.name: c for c in devices.backend_checks(params, "cpu")}
    assert [(c.status, c.detail, c.remedy) for c in rows.values()] == [
        (check.FAIL, "transformers is not installed", "bash scripts/setup.sh"),
        (check.FAIL, "bitsandbytes is not installed: these variants could not be measured (inconclusive)",
         "bash scripts/setup.sh (pyproject.toml pins bitsandbytes)"),
        (check.FAIL, "gptqmodel and autoawq not installed: these variants could not be measured (inconclusive)",
         "bash scripts/setup.sh (pyproject.toml pins autoawq and gptqmodel)"),
        (check.FAIL, "gptqmodel not installed: these variants could not be measured (inconclusive)",
         "bash scripts/setup.sh (pyproject.toml pins gptqmodel)")]
    assert list(rows) == ["none (fp16)", "bnb-int8 (int8)", "awq (awq4)", "gptq (gptq3)"]
    no_device = [c.status for c in devices.backend_checks(params, None)]
    assert no_device == [check.FAIL, check.FAIL, check.WARN, check.WARN]

# --------------------------------------------------------------------------------------------
# setup.sh's system step
# --------------------------------------------------------------------------------------------


def fake_tool(folder: Path, name: str, script: str) -> None:
    (folder / name).unlink(missing_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{script}\n")
    (folder / name).chmod(0o755)


@pytest.fixture
def checkout(tmp_path) -> Path:
    """scripts/setup.sh in a folder of its own, beside a params.yaml the test writes (setup cds to its parent)."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", tmp_path / "repo" / "scripts" / "setup.sh")
    shutil.copy2(ROOT / "params.yaml", tmp_path / "repo" / "params.yaml")
    return tmp_path / "repo"


def check_system(checkout: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "setup.sh"), "--check-system"], env={
        "PATH": str(bin_dir), "HOME": str(checkout)}, capture_output=True, text=True, timeout=60)


def test_setup_without_apt_or_bwrap_stops_naming_package_and_command(tmp_path, checkout):
    bin_dir = Path(path_without(tmp_path / "bin", "bwrap", "apt-get", "apt", "dnf", "yum", "pacman", "zypper", "apk"))
    done = check_system(checkout, bin_dir)
    assert done.returncode == 1, done.stderr
    assert "bubblewrap" in done.stderr and "sudo apt-get install bubblewrap" in done.stderr
    assert "stopped before installing anything" in done.stderr and "allow_unisolated_code: true" in done.stderr
    assert "installing" not in done.stdout

    fake_tool(bin_dir, "dnf", "exit 0")  # another distribution: its own command
    fake_tool(bin_dir, "id", 'echo 1000')  # and not root
    assert "install it: sudo dnf install bubblewrap" in check_system(checkout, bin_dir).stderr
    (bin_dir / "dnf").unlink()
    fake_tool(bin_dir, "apt-get", "echo 'apt-get must not run when not root' >&2; exit 9")
    done = check_system(checkout, bin_dir)
    assert done.returncode == 1 and "install it: sudo apt-get install bubblewrap" in done.stderr
    assert "must not run" not in done.stderr

    fake_tool(bin_dir, "uname", "echo Darwin")
    done = check_system(checkout, bin_dir)
    assert done.returncode == 1 and "code probes need Linux" in done.stderr


def test_setup_as_root_with_an_apt_that_fails_says_so_and_stops(tmp_path, checkout):
    bin_dir = Path(path_without(tmp_path / "bin", "bwrap", "apt-get", "apt"))
    fake_tool(bin_dir, "id", "echo 0")
    fake_tool(bin_dir, "apt-get", "echo 'E: Unable to locate package bubblewrap' >&2; exit 100")
    done = check_system(checkout, bin_dir)
    assert done.returncode == 1
    assert "installing bubblewrap (apt-get)" in done.stdout
    assert "apt-get could not install bubblewrap" in done.stderr and "Unable to locate package" in done.stderr


def test_setup_lets_a_run_without_code_probes_go_on(tmp_path, checkout):
    bin_dir = Path(path_without(tmp_path / "bin", "bwrap", "apt-get", "apt"))
    params = yaml.safe_load((checkout / "params.yaml").read_text(encoding="utf-8"))
    params["evaluate"]["allow_unisolated_code"] = True
    (checkout / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False), encoding="utf-8")
    done = check_system(checkout, bin_dir)
    assert done.returncode == 0 and done.stderr == ""
    params["evaluate"]["allow_unisolated_code"] = False
    params["evaluate"]["domains"] = ["math", "chat"]  # which of them run code: the doctor decides, setup warns only
    (checkout / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True, sort_keys=False), encoding="utf-8")
    done = check_system(checkout, bin_dir)
    assert done.returncode == 0 and "warning" in done.stderr and "quantgate doctor" in done.stderr


def test_setup_with_bubblewrap_present_says_nothing(tmp_path, checkout):
    bin_dir = Path(path_without(tmp_path / "bin", "apt-get"))
    fake_tool(bin_dir, "bwrap", "exit 0")
    fake_tool(bin_dir, "id", "echo 0")
    done = check_system(checkout, bin_dir)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_setup_with_a_bubblewrap_that_cannot_build_the_sandbox_stops_with_why(tmp_path, checkout):
    """Ubuntu 22.04's bubblewrap 0.6 (no --size), or user namespaces restricted: setup stops in seconds with the
    reason, not after minutes of pip at the doctor."""
    bin_dir = Path(path_without(tmp_path / "bin", "apt-get"))
    fake_tool(bin_dir, "bwrap", "case \"$1\" in --version) echo 'bubblewrap 0.6.1';; *) echo 'bwrap: Unknown option --size' >&2; exit 1;; esac")
    fake_tool(bin_dir, "id", "echo 0")
    done = check_system(checkout, bin_dir)
    assert done.returncode == 1
    assert "cannot build the code probes' sandbox here: bwrap: Unknown option --size" in done.stderr
    assert "bubblewrap 0.8 or newer (bwrap --version: bubblewrap 0.6.1)" in done.stderr
