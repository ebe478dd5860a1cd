"""End to end, after the pipeline run: the README's CI example as printed, and DVC's small summary metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.pipeline_e2e_helpers import dvc

pytestmark = pytest.mark.e2e


def test_dvc_metrics_are_the_small_summary(pipeline_run):
    """DVC's metrics are results/summary.json alone (what `dvc exp show` and `dvc metrics diff` print), and it
    says what compare.json says: each row's verdict and numbers, the gate's verdict."""
    repo, _, _ = pipeline_run
    shown = dvc(["metrics", "show", "--json"], repo)
    assert shown.returncode == 0, shown.stderr
    files = json.loads(shown.stdout)[""]["data"]
    assert list(files) == ["results/summary.json"]
    assert files["results/summary.json"]["data"]["verdict"] == json.loads((repo / "results/summary.json").read_text())["verdict"]
    summary = json.loads((repo / "results/summary.json").read_text())  # DVC's view drops the nulls of a failed row
    report = json.loads((repo / "results/compare.json").read_text())
    assert summary["verdict"] == {n: {d: r["verdict"] for d, r in v["domains"].items() if d in report["domains"]}
                                  for n, v in report["variants"].items()}
    row = report["variants"]["int8"]["domains"]["math"]["paired"]
    assert summary["difference"]["int8"]["math"] == round(row["difference"], 3)
    assert summary["items"]["int8"]["math"] == row["items"]
    verdicts = {r["verdict"] for v in report["variants"].values() for r in v["domains"].values()}
    assert summary["gate"] == ("fail" if "fail" in verdicts else "undecided" if "inconclusive" in verdicts else "pass")
    leaves = sum(len(per) for key in ("verdict", "difference", "ci_low", "items") for per in summary[key].values())
    assert leaves == 4 * len(report["variants"]) * len(report["domains"])  # nothing else grew into it


def readme_ci_steps() -> list[dict]:
    """The steps of the GitHub Actions job README.md prints ("Experiments"), read from the README as text."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"```yaml\n(# \.github/workflows/[^\n]*\n.*?)```", text, re.S)
    assert found, "README.md has no ```yaml block starting with '# .github/workflows/...'"
    (job,) = yaml.safe_load(found.group(1))["jobs"].values()
    return job["steps"]


def test_the_readme_ci_example_runs_as_printed(pipeline_run, tmp_path):
    """The README's CI job, step by step as GitHub Actions runs it (bash -eo pipefail per `run:`, `$GITHUB_PATH`
    prepended to PATH for the later steps, `if: always()` after a failure), in the finished copy, with the secret
    MLFLOW_TRACKING_URI set to the copy's SQLite store and PATH as a runner has it: without the virtual environment."""
    import hashlib
    import re

    finished, _, _ = pipeline_run
    # its own copy of the finished run: these steps re-record, promote and rewrite results that the other e2e
    # tests read from the shared run, in whatever order pytest runs the files
    repo = tmp_path / "repo"
    shutil.copytree(finished, repo, symlinks=True)
    steps = readme_ci_steps()
    assert steps[0].get("uses", "").startswith("actions/checkout@")  # the copy is the checkout
    venv = Path(sys.executable).parent.parent
    # `bash scripts/setup.sh` must not install a second environment (minutes, and the network): the copy's .venv
    # points at the one running this test, whose stamp says it was installed from these pyproject.toml and
    # constraints.txt, so setup.sh finds nothing to do (scripts/test.sh runs setup.sh before the tests).
    want = hashlib.sha256((repo / "pyproject.toml").read_bytes() + (repo / "constraints.txt").read_bytes()).hexdigest()
    have = (venv / ".quantgate-installed").read_text().strip() if (venv / ".quantgate-installed").is_file() else None
    if have != want[:16]:
        pytest.fail(f"{venv} was not installed from this pyproject.toml/constraints.txt (stamp {have}); run "
                    "`bash scripts/setup.sh` first: this test must not install into it")
    (repo / ".venv").symlink_to(venv, target_is_directory=True)
    # a finished copy has nothing left to run; without its record output `dvc repro` runs the record stage's
    # `quantgate record` (which finds this run already in MLflow and writes nothing), so the step shows whether
    # the stages' commands are found
    (repo / "results" / "mlflow_run.json").unlink()
    bin_dir = str(venv / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != Path(bin_dir).resolve())
    assert shutil.which("quantgate", path=path) is None  # a runner's PATH: quantgate only where setup put it
    github_path, summary = tmp_path / "github_path", tmp_path / "step_summary.md"
    github_path.touch()
    secrets = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"}
    base = {"PATH": path, "HOME": os.environ.get("HOME", str(tmp_path)), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(repo),
            "GITHUB_PATH": str(github_path), "GITHUB_STEP_SUMMARY": str(summary)}
    results, failed = [], False
    try:
        for step in steps[1:]:
            if failed and step.get("if") != "always()":
                results.append((step["run"], None, "skipped"))
                continue
            added = [line for line in github_path.read_text().splitlines() if line.strip()]
            env = {**base, "PATH": os.pathsep.join([*reversed(added), path])}
            for key, value in (step.get("env") or {}).items():
                env[key] = re.sub(r"\$\{\{\s*secrets\.(\w+)\s*\}\}", lambda m: secrets[m.group(1)], str(value))
            done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=repo,
                                  env=env, capture_output=True, text=True, timeout=1800)
            results.append((step["run"], done.returncode, done.stdout + done.stderr))
            failed = failed or done.returncode != 0
    finally:
        (repo / ".venv").unlink()
    log = "\n".join(f"$ {run}\n(exit {rc})\n{out[-3000:]}" for run, rc, out in results)
    by_command = {run.split("#")[0].strip(): (rc, out) for run, rc, out in results}
    setup = by_command["bash scripts/setup.sh"]
    assert setup[0] == 0 and "installing quantgate" not in setup[1], log
    doctor = by_command["quantgate doctor"]
    assert doctor[0] == 0 and "the run can give a verdict" in doctor[1], log
    repro = next(v for k, v in by_command.items() if re.search(r"\bdvc repro\b", k))
    assert repro[0] == 0 and "Running stage 'record'" in repro[1], log
    assert "command not found" not in log, log
    # the gate's exit code is the job's: 0 when compare.json passes gptq3 on every request type (and it was promoted)
    report = json.loads((repo / "results" / "compare.json").read_text())
    verdicts = {r["verdict"] for r in report["variants"]["gptq3"]["domains"].values()}
    expected = 1 if "fail" in verdicts else 2 if "inconclusive" in verdicts else 0
    gate = next(v for k, v in by_command.items() if "quantgate gate" in k)
    assert gate[0] == expected, log
    assert summary.read_text() == (repo / "results" / "report.md").read_text()  # the `if: always()` step ran
    assert json.loads((repo / "results" / "mlflow_run.json").read_text())["status"] == "already recorded"
