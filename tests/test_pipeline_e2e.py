"""End to end: `dvc repro` in a temporary copy of the repository, on a small reference model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TINY_REFERENCE

pytestmark = pytest.mark.e2e


def repo_copy(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files, as a clean clone would have them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def dvc(args, cwd):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    repo = repo_copy(tmp_path_factory.mktemp("repo"))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["reference"].update(TINY_REFERENCE)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    first = dvc(["repro"], repo)
    assert first.returncode == 0, first.stdout + first.stderr
    second = dvc(["repro"], repo)
    return repo, first, second


def test_reference_stage_outputs(pipeline_run):
    repo, first, _ = pipeline_run
    report = json.loads((repo / "results" / "reference.json").read_text())
    assert report["status"] == "built"
    assert report["addition_items"] == TINY_REFERENCE["held_out_additions"]
    assert (repo / "models" / "reference" / "model.safetensors").is_file()
    assert (repo / "models" / "reference" / "tokenizer.json").is_file()
    assert "Running stage 'reference'" in first.stdout


def test_calibrate_stage_outputs(pipeline_run):
    repo, first, _ = pipeline_run
    manifest = json.loads((repo / "calibration_sets" / "built" / "manifest.json").read_text())
    assert {d: v["count"] for d, v in manifest["domains"].items()} == {
        "chat": 128, "code": 128, "code_comment": 128, "math": 128}
    mixed = (repo / "calibration_sets" / "built" / "mixed.jsonl").read_text().splitlines()
    assert len(mixed) == 512
    coverage = json.loads((repo / "results" / "calibration" / "coverage.json").read_text())
    assert coverage["covered"] and coverage["calibration_sha256"] == manifest["mixed_sha256"]
    assert "calibrate: code_comment production" in first.stderr + first.stdout


def test_second_repro_does_nothing_and_says_so(pipeline_run):
    _, _, second = pipeline_run
    assert second.returncode == 0
    assert "Running stage" not in second.stdout
    assert "Data and pipelines are up to date." in second.stdout


def test_dvc_tracks_metrics(pipeline_run):
    repo, _, _ = pipeline_run
    shown = dvc(["metrics", "show", "--json"], repo)
    assert shown.returncode == 0, shown.stderr
    assert "addition_exact_match" in shown.stdout
