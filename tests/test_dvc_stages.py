"""dvc.yaml: every stage depends on exactly the code it runs, so DVC re-runs what a change touches, and only that."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

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
            f"dvc.yaml stage {name!r}: its pipelines/ deps should be {lineage.stage_code(stage['command'])} "
            "(python scripts/sync_dvc_deps.py writes them)")


def test_stage_code_follows_imports_inside_functions_and_leaves_other_stages_out():
    compare = lineage.stage_code("compare")
    assert "pipelines/judging/stats.py" in compare  # compare -> judging.comparison -> stats
    assert "pipelines/judging/plots.py" in compare  # imported by compare's own module
    assert "pipelines/core/lineage.py" in lineage.stage_code("route")  # imported only inside route.main
    assert "pipelines/core/__init__.py" in compare and "pipelines/judging/__init__.py" in compare  # packages run too
    assert "pipelines/quantize.py" not in compare and "pipelines/record.py" not in compare
    assert "pipelines/compare.py" not in lineage.stage_code("quantize")
    assert "pipelines/judging/plots.py" not in lineage.stage_code("route")  # route reads compare.json, not its charts
    for stage in stages().values():
        assert "pipelines/cli.py" not in lineage.stage_code(stage["command"])


def _changed_code(repo: Path) -> dict[str, set[str]]:
    """`dvc status`'s changed pipelines/ deps, by stage (foreach instances under their stage's name)."""
    out = subprocess.run([str(Path(sys.executable).with_name("dvc")), "status", "--json"], cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    changed: dict[str, set[str]] = {}
    for stage, entries in json.loads(out.stdout or "{}").items():
        for entry in entries:
            if isinstance(entry, dict):
                for path in (entry.get("changed deps") or {}):
                    if path.startswith("pipelines/"):
                        changed.setdefault(stage.split("@")[0], set()).add(path)
    return changed


def _lock_this_code(repo: Path) -> None:
    """dvc.lock as `dvc repro` would leave it for the code in `repo`: each stage's pipelines/ deps with their md5."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    for name, stage in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].items():
        if "foreach" not in stage and name not in lock["stages"]:  # a new stage `dvc repro` has not run yet
            lock["stages"][name] = {"cmd": stage["cmd"], "deps": []}
    for name, entry in lock["stages"].items():
        code = [d for d in stages()[name.split("@")[0]]["deps"] if d.startswith("pipelines/")]
        data = [d for d in entry["deps"] if not d["path"].startswith("pipelines/")]
        entry["deps"] = [{"path": path, "hash": "md5", "md5": hashlib.md5((repo / path).read_bytes()).hexdigest(),
                          "size": (repo / path).stat().st_size} for path in code] + data
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))


def test_editing_the_cli_or_compares_charts_reruns_only_the_stage_that_owns_the_code(tmp_path):
    """Real `dvc status`: an edit to cli.py (or the gate) re-runs no stage, one to compare's charts re-runs compare
    alone, one to a shared floor every stage whose code it is, and nothing else."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "dvc.lock", "params.yaml"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(ROOT / "pipelines", repo / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([str(Path(sys.executable).with_name("dvc")), "init", "--no-scm", "-q"], cwd=repo, check=True)
    _lock_this_code(repo)
    before = _changed_code(repo)
    assert before == {}  # the code is what dvc.lock says: only data (not copied here) differs

    def stages_after_editing(path: str) -> set[str]:
        target = repo / path
        original = target.read_bytes()
        target.write_bytes(original + b"\n# an edit\n")
        try:
            after = _changed_code(repo)
        finally:
            target.write_bytes(original)
        return {stage for stage, files in after.items() if files - before.get(stage, set())}

    assert stages_after_editing("pipelines/cli.py") == set()
    assert stages_after_editing("pipelines/gate.py") == set()  # the gate is a command, not a stage
    assert stages_after_editing("pipelines/judging/plots.py") == {"compare"}
    assert stages_after_editing("pipelines/store/tracking.py") == {"record"}
    assert stages_after_editing("pipelines/judging/verdict.py") == {"compare", "route", "record"}


def test_the_baseline_stage_hashes_fp16s_sample_log_when_params_point_at_one(tmp_path):
    """baseline.source: samples: the log folder is the baseline stage's dependency (an edited log is a stale input),
    and by default fp16's own checkpoint is, as before (pipelines/evaluation/baseline_log.py)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())

    def baseline_deps(where: Path) -> list[str]:  # a process each: DVC keeps what it parsed of params files
        where.mkdir()
        shutil.copyfile(ROOT / "dvc.yaml", where / "dvc.yaml")
        (where / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "--no-scm", "-q"], cwd=where, check=True)
        read = ("import json; from dvc.repo import Repo; "
                "print(json.dumps([str(d.def_path) for d in Repo('.').stage.collect('baseline')[0].deps]))")
        return json.loads(subprocess.run([sys.executable, "-c", read], cwd=where, check=True, capture_output=True,
                                         text=True).stdout)

    assert "models/variants/fp16" in baseline_deps(tmp_path / "here")
    params["baseline"] = {"source": "samples", "path": "logs/fp16-vllm"}
    deps = baseline_deps(tmp_path / "log")
    assert "logs/fp16-vllm" in deps and "models/variants/fp16" not in deps


def test_a_variant_served_at_an_endpoint_is_judged_after_its_checkpoint_is_made(tmp_path):
    """quantgate's own variant served where it runs (docs/evaluate.md, "A variant of quantgate's own at an endpoint"):
    a candidate whose `path` is the variant's checkpoint folder. DVC then admits and evaluates it after quantize@awq4,
    and a re-quantized awq4 is a changed dependency that evaluates the served copy again."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["candidates"] = {"awq4-served": {"source": "endpoint", "path": "models/variants/awq4",
                                            "endpoint": {"base_url": "http://10.0.0.5:8000/v1", "model": "awq4"}}}
    shutil.copyfile(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    read = ("import json; from dvc.repo import Repo; r = Repo('.'); print(json.dumps({t: sorted(s.addressing for s in "
            "r.stage.collect(t, with_deps=True)) for t in ('admit@awq4-served', 'evaluate-candidate@awq4-served')}))")
    upstream = json.loads(subprocess.run([sys.executable, "-c", read], cwd=tmp_path, check=True, capture_output=True,
                                         text=True).stdout)
    assert "quantize@awq4" in upstream["admit@awq4-served"] and "quantize@int8" not in upstream["admit@awq4-served"]
    assert {"quantize@awq4", "admit@awq4-served", "baseline"} <= set(upstream["evaluate-candidate@awq4-served"])
