"""The MLflow UI in a real browser (headless Chromium), each page in a fresh profile: what a first-time visitor sees.

Two recorded pipelines in one store: `before` (awq4 loses 2 code items of 200) and `after` (awq4 loses 30, so it
fails code), as the README's experiment records the default calibration set and one without code comments.

Needs Debian's chromium and the playwright package; `.ci/run` installs both and sets
QUANTGATE_REQUIRE_BROWSER=1, so in CI a missing browser fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipelines import record
from pipelines.store.layout import VIEW_TAG
from tests.conftest import ROOT
from tests.handmade import correctness, write_pipeline

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists() and not os.environ.get("QUANTGATE_REQUIRE_BROWSER"):
    pytest.skip("no /usr/bin/chromium here (apt-get install chromium); CI requires it", allow_module_level=True)

N = 200


@pytest.fixture(scope="module")
def two_pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    out = {"root": root, "uri": uri}
    for name, lose in (("before", 2), ("after", 30)):
        (root / name).mkdir()
        built = write_pipeline(root / name, {"fp16": {d: correctness(N, 150) for d in ("math", "code")},
                                             "int8": {d: correctness(N, 150, lose=1) for d in ("math", "code")},
                                             "awq4": {"math": correctness(N, 150, lose=2),
                                                      "code": correctness(N, 150, lose=lose)}})
        summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=root / name,
                                         artifact_root=root / "artifacts")
        out[name] = {**built, "summary": summary, "parent": f"pipeline {built['digest'][:8]}"}
    return out


def check_ui(uri: str, shot: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/check_mlflow_ui.py"), "--tracking-uri", uri,
                           "--experiment", "handmade", "--screenshot", str(shot), *extra],
                          capture_output=True, text=True, timeout=600)


def test_runs_table_saved_view_and_both_comparisons_show_verdicts_and_numbers(two_pipelines, tmp_path):
    shot = tmp_path / "shots" / "compare.png"
    out = check_ui(two_pipelines["uri"], shot, "--metric", "code/accuracy", "--metric", "code/ci_low",
                   "--metric", "memory/footprint_bytes")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # (1) the default runs table, no click: the latest pipeline's children listed, each one's verdict readable
    assert re.search(r"runs table, fresh browser: 'awq4 · fail: code · pass: math' shows 'awq4 · fail", text), text
    assert re.search(r"runs table, fresh browser: 'int8 · pass: math, code' shows 'int8 · pass", text), text
    assert "runs table, fresh browser: 'fp16 · baseline' shows 'fp16 · baseline'" in text
    # (2) the saved view, opened by its link: every request type's verdict and the numbers that decide it
    after = two_pipelines["after"]["report"]["variants"]["awq4"]["domains"]
    line = next(x for x in text.splitlines() if "saved view quantgate-verdicts, fresh browser: awq4 · fail" in x)
    assert "verdict.code fail" in line and "verdict.math pass" in line
    assert "code/difference -0.15," in line and "math/difference -0.01," in line
    assert f"code/ci_low {after['code']['paired']['ci_low']!r}," in line and after["code"]["paired"]["ci_low"] < -0.05
    assert "code/flip_rate 0.15," in line and "code/kl/p99 0.2," in line
    # (3) the comparison of the latest pipeline's child runs, as before
    assert "child runs and code/accuracy, code/ci_low, memory/footprint_bytes shown" in text
    # (4) the comparison of the two pipeline runs: code accuracy falling, older run first (default metric)
    before, later = two_pipelines["before"]["parent"], two_pipelines["after"]["parent"]
    assert f"comparison of {before} and {later}: code/awq4/accuracy 0.74 -> 0.6" in text
    for name in ("compare.png", "compare_experiment.png", "compare_verdicts.png", "compare_parents.png"):
        assert (shot.parent / name).stat().st_size > 20_000, name


def test_what_the_ui_does_not_show_is_reported(two_pipelines, tmp_path):
    """A store where the latest pipeline's child runs are not tagged as evaluation runs (MLflow then shows their
    parent collapsed) and the saved view names a column in a form MLflow does not read; and a metric that is not
    there in either comparison."""
    db = tmp_path / "mlflow.db"
    shutil.copy(two_pipelines["root"] / "mlflow.db", db)
    uri = f"sqlite:///{db}"
    client = MlflowClient(uri)
    exp_id = two_pipelines["after"]["summary"]["experiment_id"]
    for run_id in two_pipelines["after"]["summary"]["children"].values():
        client.delete_tag(run_id, "mlflow.runType")
    envelope = json.loads(client.get_experiment(exp_id).tags[VIEW_TAG])
    envelope["state"] = envelope["state"].replace("metrics.`code/ci_low`", "metrics.code/ci_low")
    client.set_experiment_tag(exp_id, VIEW_TAG, json.dumps(envelope))
    with sqlite3.connect(db) as con:  # nothing else may differ: the copy holds the same runs
        assert con.execute("select count(*) from runs").fetchone()[0] == 8
    out = check_ui(uri, tmp_path / "s.png", "--metric", "code/accuracy", "--metric", "code/no_such_metric",
                   "--compare-metric", "code/awq4/accuracy", "--compare-metric", "code/awq4/no_such_metric")
    assert out.returncode == 1, out.stdout + out.stderr
    err = out.stderr
    assert "child run 'awq4 · fail: code · pass: math' not listed under its parent on the experiment page" in err
    assert "saved view: 'awq4 · fail: code · pass: math' code/ci_low shows None" in err
    assert "metric 'code/no_such_metric' not shown in the comparison view" in err
    assert "metric 'code/awq4/no_such_metric' not in the comparison of" in err
    assert "comparison of" in out.stdout and "code/awq4/accuracy 0.74 -> 0.6" in out.stdout  # the one that is there
