"""How many stages each recent commit re-ran, under the dvc.yaml it was made with and under today's layout.

Old layout: the stages whose dvc.yaml deps (at that commit) include a file the commit changed. Today's layout:
each changed hunk of a pipelines/ file is mapped to the function or class it touched, that name to the module that
holds it now, and the module to the stages whose code it is (core/lineage.stage_code); a hunk outside any function
(imports, constants) counts for every module that now holds a name of the old file. Data and params.yaml changes
count the same under both (the stages whose deps or params name them); the outputs a commit carries
(dvc.lock, results/, models/) are what a run wrote, not what made it run, and are left out. Stage instances are counted (quantize@int8
is one), out of the instances dvc.lock holds.

    python benchmarks/rerun_scope.py [--commits 10] [--until 5e070b4]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.core.lineage import stage_code  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def instances(dvc_yaml: dict, lock: dict) -> dict[str, list[str]]:
    """Stage name -> its instances in dvc.lock (foreach stages have one per item)."""
    out: dict[str, list[str]] = {}
    for name in lock.get("stages", {}):
        out.setdefault(name.split("@")[0], []).append(name)
    for name, stage in dvc_yaml["stages"].items():
        out.setdefault(name, [] if "foreach" in stage else [name])  # a foreach over no items runs nothing
    return out


def deps_of(dvc_yaml: dict) -> dict[str, tuple[list[str], list[str], str]]:
    """Stage -> (deps, params top-level keys, command)."""
    out = {}
    for name, stage in dvc_yaml["stages"].items():
        body = stage.get("do", stage)
        params = [str(p).split(".")[0] for p in body.get("params", []) if isinstance(p, str)]
        out[name] = ([str(d) for d in body.get("deps", [])], params, str(body["cmd"]).split()[1])
    return out


def definitions_now() -> dict[str, set[str]]:
    """Top-level function/class name -> the pipelines/ files that define it today."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "pipelines").rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, set()).add(path.relative_to(ROOT).as_posix())
    return found


@functools.cache
def source_now(path: str, name: str) -> str:
    """The source of top-level `name` in `path` today."""
    source = (ROOT / path).read_text(encoding="utf-8")
    return next((ast.get_source_segment(source, n) or "" for n in ast.parse(source).body
                 if getattr(n, "name", None) == name), "")


def touched_names(commit: str, path: str) -> tuple[set[str], bool]:
    """Top-level names whose lines the commit changed in `path` (new side), and whether a hunk fell outside them."""
    try:
        source = git("show", f"{commit}:{path}")
    except subprocess.CalledProcessError:
        return set(), True  # deleted by the commit
    spans = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.append((start, node.end_lineno, node.name))
    names, outside = set(), False
    for match in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", git("diff", "-U0", f"{commit}^", commit, "--", path), re.M):
        start, count = int(match.group(1)), int(match.group(2) or 1)
        lines = range(start, start + max(count, 1))
        hit = {name for a, b, name in spans if any(a <= line <= b for line in lines)}
        names |= hit
        outside |= not hit
    return names, outside


def outputs(dvc_yaml: dict) -> list[str]:
    """Every path a stage writes (a commit that carries a run's outputs did not cause that run)."""
    found = []
    for stage in dvc_yaml["stages"].values():
        body = stage.get("do", stage)
        for kind in ("outs", "metrics", "plots"):
            for out in body.get(kind, []):
                found.append(str(next(iter(out)) if isinstance(out, dict) else out).split("${")[0])
    return found


def changed_params(commit: str) -> set[str]:
    try:
        before = yaml.safe_load(git("show", f"{commit}^:params.yaml")) or {}
        after = yaml.safe_load(git("show", f"{commit}:params.yaml")) or {}
    except subprocess.CalledProcessError:
        return set()
    return {k for k in set(before) | set(after) if before.get(k) != after.get(k)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=10)
    parser.add_argument("--until", default="HEAD", help="the newest commit to look at")
    args = parser.parse_args()
    now_yaml = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    now_stages = deps_of(now_yaml)
    now_code = {name: set(stage_code(command)) for name, (_, _, command) in now_stages.items()}
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    now_instances = instances(now_yaml, lock)
    total = sum(len(v) for v in now_instances.values())
    homes = definitions_now()
    print(f"{'commit':8}  {'old layout':>10}  {'new layout':>10}  subject   (stage instances out of {total})")
    for commit in git("rev-list", f"--max-count={args.commits}", args.until).split():
        old_yaml = yaml.safe_load(git("show", f"{commit}:dvc.yaml"))
        written = outputs(old_yaml) + outputs(now_yaml)
        files = [f for f in git("diff", "--name-only", f"{commit}^", commit).split()
                 if f and f != "dvc.lock" and not any(f == o or f.startswith(o.rstrip("/") + "/") for o in written)]
        params = changed_params(commit) if "params.yaml" in files else set()
        old = set()
        for name, (deps, keys, _) in deps_of(old_yaml).items():
            if any(f == d or f.startswith(d.rstrip("/") + "/") for f in files for d in deps) or params & set(keys):
                old.add(name)
        modules: set[str] = set()
        for f in (f for f in files if f.startswith("pipelines/") and f.endswith(".py")):
            names, outside = touched_names(commit, f)
            try:
                old_source = git("show", f"{commit}:{f}")
            except subprocess.CalledProcessError:
                old_source = ""
            old_defs = {n.name: ast.get_source_segment(old_source, n) or "" for n in ast.parse(old_source).body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            old_names = set(old_defs)

            def home_of(name: str) -> set[str]:
                """Where `name` of this file lives now; of two same-named functions, the one whose code is closest."""
                found = homes.get(name, set())
                if len(found) < 2 or name not in old_defs:
                    return found
                return {max(found, key=lambda h: difflib.SequenceMatcher(None, old_defs[name], source_now(h, name)).ratio())}

            for name in names:
                modules |= home_of(name)
            if outside or any(name not in homes for name in names):  # imports, constants, a name since removed
                modules |= {home for n in old_names for home in home_of(n)}
        new = set()
        for name, (deps, keys, _) in now_stages.items():
            data = [d for d in deps if not d.startswith("pipelines/")]
            if modules & now_code[name] or params & set(keys) or any(
                    f == d or f.startswith(d.rstrip("/") + "/") for f in files for d in data):
                new.add(name)
        count = lambda stages: sum(len(now_instances.get(s, [])) for s in stages)  # noqa: E731
        subject = git("log", "-1", "--format=%s", commit).strip()[:70]
        print(f"{commit[:8]}  {count(old):>10}  {count(new):>10}  {subject}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
