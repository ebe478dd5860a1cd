"""The console command: one subcommand per stage, bad input as one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

QUANTGATE = [sys.executable, "-m", "pipelines.cli"]


def run(args, cwd):
    return subprocess.run(QUANTGATE + args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def test_help_lists_the_stages(tmp_path):
    out = run(["--help"], tmp_path)
    assert out.returncode == 0
    for stage in ("reference", "calibrate", "quantize", "admit", "memory", "memory-report", "baseline", "evaluate",
                  "compare", "route", "record", "gate", "ui"):
        assert stage in out.stdout


def test_bad_params_key_is_one_line_exit_2(tmp_path):
    (tmp_path / "params.yaml").write_text("model: reference\nreferense: {}\n")
    out = run(["reference"], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "quantgate reference: error: params.yaml:2: unknown key 'referense' (misspelled? see docs/params.md)"
    ]
    assert not (tmp_path / "results").exists()


def test_unknown_model_is_one_line_exit_2(tmp_path):
    (tmp_path / "params.yaml").write_text("model: ./no/such/checkpoint\n")
    out = run(["reference"], tmp_path)
    assert out.returncode == 2
    assert "model: './no/such/checkpoint' is not 'reference'" in out.stderr
    assert "Traceback" not in out.stderr


def test_another_model_skips_the_reference_build(tmp_path, tiny_model):
    (tmp_path / "params.yaml").write_text(f"model: {tiny_model}\n")
    out = run(["reference"], tmp_path)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "results" / "reference.json").read_text()
    assert '"status": "skipped"' in report and str(tiny_model) in report
    assert [p.name for p in (tmp_path / "models" / "reference").iterdir()] == ["skipped.json"]
