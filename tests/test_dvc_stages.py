"""dvc.yaml: every stage depends on exactly the code it runs, so DVC re-runs what a change touches, and only that."""

from __future__ import annotations

import yaml

from pipelines.core import lineage
from tests.conftest import ROOT


def stages() -> dict[str, dict]:
    """Each stage's `do`/body with its command's name (foreach stages once, by their template)."""
    out = {}
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        body = stage.get("do", stage)
        out[name] = {"command": body["cmd"].split()[1], "deps": [str(d) for d in body.get("deps", [])]}
    return out


def test_each_stage_depends_on_exactly_the_modules_its_command_imports():
    for name, stage in stages().items():
        code = sorted(d for d in stage["deps"] if d.startswith("pipelines"))
        assert code == lineage.stage_code(stage["command"]), (
            f"dvc.yaml stage {name!r}: its pipelines/ deps should be {lineage.stage_code(stage['command'])}")


def test_stage_code_follows_imports_inside_functions_and_leaves_other_commands_out():
    compare = lineage.stage_code("compare")
    assert "pipelines/judging/stats.py" in compare  # compare -> sequential -> stats
    assert "pipelines/core/sandbox.py" in compare  # compare -> evaluate (inside a function) -> sandbox
    assert "pipelines/quantize.py" not in compare and "pipelines/record.py" not in compare
    assert "pipelines/compare.py" not in lineage.stage_code("quantize")
    assert "pipelines/gate.py" not in lineage.stage_code("record")  # cli.py imports gate only inside cmd_gate
