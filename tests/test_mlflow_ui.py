"""The MLflow UI in a real browser (headless Chromium): child runs and their metrics are there.

Needs Debian's chromium and the playwright package; `.ci/run` installs both and sets
QUANTGATE_REQUIRE_BROWSER=1, so in CI a missing browser fails instead of skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import record
from tests.conftest import ROOT
from tests.handmade import correctness, write_pipeline

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists() and not os.environ.get("QUANTGATE_REQUIRE_BROWSER"):
    pytest.skip("no /usr/bin/chromium here (apt-get install chromium); CI requires it", allow_module_level=True)


def test_child_runs_and_metrics_show_in_the_comparison_view(tmp_path):
    n = 200
    built = write_pipeline(tmp_path, {"fp16": {d: correctness(n, 150) for d in ("math", "code")},
                                      "int8": {d: correctness(n, 150, lose=1) for d in ("math", "code")},
                                      "awq4": {d: correctness(n, 150, lose=30) for d in ("math", "code")}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path, artifact_root=tmp_path / "artifacts")
    shot = tmp_path / "shots" / "compare.png"
    out = subprocess.run([sys.executable, str(ROOT / "scripts/check_mlflow_ui.py"), "--tracking-uri", uri,
                          "--experiment", "handmade", "--screenshot", str(shot), "--metric", "code/accuracy",
                          "--metric", "code/ci_low", "--metric", "memory/footprint_bytes"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "child runs and code/accuracy, code/ci_low, memory/footprint_bytes shown" in out.stdout
    assert shot.stat().st_size > 20_000 and shot.with_name("compare_experiment.png").is_file()


def test_a_metric_that_is_not_there_is_reported(tmp_path):
    n = 200
    built = write_pipeline(tmp_path, {"fp16": {d: correctness(n, 150) for d in ("math", "code")},
                                      "int8": {d: correctness(n, 150) for d in ("math", "code")},
                                      "awq4": {d: correctness(n, 150) for d in ("math", "code")}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path, artifact_root=tmp_path / "artifacts")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/check_mlflow_ui.py"), "--tracking-uri", uri,
                          "--experiment", "handmade", "--screenshot", str(tmp_path / "s.png"), "--metric", "code/accuracy",
                          "--metric", "code/no_such_metric"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert "metric 'code/no_such_metric' not shown in the comparison view" in out.stderr
