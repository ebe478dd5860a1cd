"""Every path README.md and docs/*.md name under results/, docs/, scripts/, benchmarks/ or tests/ must be shipped
(tracked by git) or written by a dvc.yaml stage."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import yaml

from .blocks import Problem, doc_files
from .sources import git

# files the docs name that are written by a command outside dvc.yaml's stages
WRITTEN_OUTSIDE_DVC = {
    "results/gate.json": "quantgate gate",
    "results/report.md": "quantgate gate",
    "logs/quantgate.log": "every quantgate command",
    "logs/benchmark.log": "the benchmarks",
}
# paths the docs name that are not files of this repository (checked as such by hand)
NOT_REPOSITORY_PATHS = {
    "results/quantgate.json": "an artifact path inside an MLflow child run (docs/record-gate.md)",
}
CHECKED_PREFIXES = ("results/", "docs/", "scripts/", "benchmarks/", "tests/")

PATH_RE = re.compile(r"(?<![\w./$-])((?:%s)(?:[^\s`'\"()\],;:|!?{]|\{[^\s{}]*\})*)"
                     % "|".join(re.escape(p) for p in CHECKED_PREFIXES))


def shipped_files(root: Path) -> list[str]:
    """What a commit of this checkout would ship: tracked files and untracked ones git does not ignore."""
    out = git(root, "ls-files", "-co", "--exclude-standard", "-z")
    if out.returncode != 0:
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [f for f in out.stdout.split("\0") if f and (root / f).exists()]


def dvc_outputs(root: Path) -> list[str]:
    """Every out, metric and plot of dvc.yaml's stages, foreach variables as `*`."""
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    found = []
    for stage in stages.values():
        body = stage.get("do", stage) if isinstance(stage, dict) else {}
        for key in ("outs", "metrics", "plots"):
            for entry in body.get(key) or []:
                name = next(iter(entry)) if isinstance(entry, dict) else entry
                found.append(re.sub(r"\$\{[^}]*\}", "*", str(name)).rstrip("/"))
    return found


def expand(path: str) -> list[str]:
    """`results/eval/<variant>.json` -> `results/eval/*.json`; `{a,b}` -> both."""
    path = re.sub(r"<[^>]*>|\bDIR\b|\bNAME\b", "*", path.rstrip("."))
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [q for alt in m.group(1).split(",") for q in expand(path[:m.start()] + alt.strip() + path[m.end():])]
    return [path]


def path_shipped(path: str, files: list[str], outs: list[str]) -> bool:
    path = path.rstrip("/")
    for f in files:
        if f == path or f.startswith(path + "/") or fnmatch.fnmatch(f, path) or fnmatch.fnmatch(f, path + "/*"):
            return True
    for o in [*outs, *WRITTEN_OUTSIDE_DVC]:
        if o == path or path.startswith(o + "/") or o.startswith(path + "/") or fnmatch.fnmatch(path, o) \
                or fnmatch.fnmatch(o, path) or fnmatch.fnmatch(path, o + "/*"):
            return True
    return False


def unshipped_paths(root: Path) -> list[Problem]:
    files, outs = shipped_files(root), dvc_outputs(root)
    problems = []
    for doc in doc_files(root):
        rel = str(doc.relative_to(root))
        for n, line in enumerate(doc.read_text(encoding="utf-8").split("\n"), 1):
            for m in PATH_RE.finditer(line):
                raw = m.group(1).rstrip(".")
                if raw.rstrip("/") in {p.rstrip("/") for p in CHECKED_PREFIXES} or "..." in raw or "…" in raw \
                        or raw in NOT_REPOSITORY_PATHS:
                    continue
                if not any(path_shipped(p, files, outs) for p in expand(raw)):
                    problems.append(Problem(rel, n, f"names `{raw}`, which is neither shipped (tracked by git) "
                                                    "nor written by a dvc.yaml stage"))
    return problems
