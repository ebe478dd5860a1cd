"""Where results came from: the dvc.lock entries that produced them and the git commit of the code.

DVC writes each stage's dvc.lock entry as the stage finishes, so while `compare`, `route` or `record`
runs, the entries of every stage before it already name the exact inputs and outputs being judged.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import yaml

from pipelines.core.paths import DVC_LOCK, PROFILE_MARKER

JUDGING_STAGES = ("compare", "shadow", "route", "record")  # stages that read the pipeline's results, not make them
RECORDING_STAGES = ("record",)  # the stage that writes results elsewhere (MLflow)


def _locked_entries(lock_path: Path, exclude: tuple[str, ...]) -> dict | None:
    """dvc.lock's entries (deps, params, outs) by stage, without the excluded stages; None without a dvc.lock."""
    if not lock_path.is_file():
        return None
    lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
    return {k: v for k, v in (lock.get("stages") or {}).items() if k.split("@")[0] not in exclude}


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def stage_digests(lock_path: Path = DVC_LOCK, exclude: tuple[str, ...] = JUDGING_STAGES) -> dict[str, str] | None:
    """sha256 of each dvc.lock entry of the stages that produced the results, in dvc.lock's order (which stages
    changed after a comparison was made); None without a dvc.lock."""
    stages = _locked_entries(lock_path, exclude)
    return None if stages is None else {name: _sha256(entry) for name, entry in stages.items()}


def digest_of_stages(digests: dict[str, str]) -> str:
    """One sha256 over the stage digests: what compare.json's `dvc_lock_sha256` holds, so the gate can check that
    the per-stage digests stored beside it are the ones it was made from."""
    return _sha256(digests)


def lock_digest(lock_path: Path = DVC_LOCK, exclude: tuple[str, ...] = JUDGING_STAGES) -> str | None:
    """sha256 of dvc.lock's entries for the stages that produced the results; None without a dvc.lock."""
    digests = stage_digests(lock_path, exclude)
    return None if digests is None else digest_of_stages(digests)


def results_digest(lock_path: Path = DVC_LOCK) -> str | None:
    """sha256 of every dvc.lock entry but record's: the identity of one pipeline result, verdicts included.

    Anything that can change a verdict (params, code, data, any stage's output, compare's policy) changes
    it, so MLflow gets a new parent run and the registry new versions whenever a verdict may have moved.
    """
    return lock_digest(lock_path, RECORDING_STAGES)


def workspace_changes(root: Path = Path(".")) -> list[str]:
    """What DVC's own status finds changed against dvc.lock (params, code, data, outputs), one line each;
    empty when every stage is up to date. A workspace DVC cannot read is a change too.

    Every file is hashed anew: DVC's state database (in its site cache) would otherwise take a file whose
    size and mtime look unchanged for its recorded hash, and a rewrite that restores the mtime would pass.
    """
    site_cache = os.environ.pop("DVC_SITE_CACHE_DIR", None)  # it would override the empty state below
    try:
        from dvc.repo import Repo

        with tempfile.TemporaryDirectory(prefix="quantgate-dvc-state-") as state, \
                Repo(str(root), config={"core": {"site_cache_dir": state}}) as repo:
            status = repo.status()
            stages = list(repo.index.stages)
            repo_root = Path(repo.root_dir)
    except Exception as err:  # noqa: BLE001 - no DVC repository, a broken dvc.yaml: nothing can be trusted
        return [f"DVC cannot check this workspace ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"]
    finally:
        if site_cache is not None:
            os.environ["DVC_SITE_CACHE_DIR"] = site_cache
    # a frozen stage's dependencies are not checked by DVC's status: its outputs cannot be vouched for
    lines = [f"{s.addressing}: frozen (dvc unfreeze {s.addressing}): DVC does not check what it depends on"
             for s in stages if s.frozen]
    # a stage run from another folder hashes other files than the ones the gate reads
    lines += [f"{s.addressing}: wdir is {os.path.relpath(s.wdir, repo_root)!r}, not the repository root: refused"
              for s in stages
              if Path(s.wdir).resolve() != repo_root.resolve()]
    lines += _declared_against_locked(stages, Path(root) / DVC_LOCK)
    lines += foreign_code(Path(root))
    for stage, changes in status.items():
        if not changes or all(not change for change in changes):
            lines.append(f"{stage}: changed")
        for change in changes:
            if isinstance(change, str):
                lines.append(f"{stage}: {change}")
                continue
            for kind, what in change.items():
                for path, state in (what.items() if isinstance(what, dict) else [(what, "")]):
                    detail = ", ".join(f"{k} {v}" for k, v in state.items()) if isinstance(state, dict) else state
                    lines.append(f"{stage}: {kind}: {path} {detail}".rstrip())
    return lines


def foreign_code(root: Path) -> list[str]:
    """In a profile's workspace (`quantgate profile`, which writes PROFILE_MARKER): the pipelines/ that runs must be the
    workspace's copy, the one dvc.lock hashed. An editable install points at the checkout the workspace came from,
    which may have moved on since; `bash scripts/run.sh --model NAME` puts the workspace first on PYTHONPATH."""
    running = Path(__file__).resolve().parents[2]
    if not (root / PROFILE_MARKER).is_file() or running == root.resolve():
        return []
    return [f"the code that runs is {running}/pipelines, not this workspace's copy (which dvc.lock hashed): run here "
            f"with PYTHONPATH={root.resolve()} (bash scripts/run.sh --model NAME does)"]


READS_ONLY = ("profile", "ui", "doctor", "gate", "audit", "route lookup")  # they say so themselves, or write nothing


def refuse_foreign_code(verb: str) -> None:
    """Before a command that writes results: in a profile's workspace, only with the workspace's own code (a stage run
    with another checkout's code would leave outputs that dvc.lock credits to the workspace's)."""
    if verb not in READS_ONLY and (foreign := foreign_code(Path("."))):
        from pipelines.core.errors import QuantgateError

        raise QuantgateError(foreign[0])


def _declared_against_locked(stages: list, lock_path: Path) -> list[str]:
    """Stages whose dvc.yaml deps or outs are not the ones dvc.lock recorded. DVC's status only checks what
    dvc.yaml lists now, so deleting a dep from dvc.yaml would hide any change to it."""
    from dvc.dependency.param import ParamsDependency

    lock = (yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}).get("stages") or {} if lock_path.is_file() else {}
    # a stage deleted from dvc.yaml leaves its entry, which nothing checks any more, while its outputs stay
    lines = [f"{name}: in dvc.lock but no longer a stage of dvc.yaml: its outputs cannot be vouched for "
             "(remove the entry, or restore the stage and dvc repro)" for name in sorted(set(lock) - {s.addressing for s in stages})]
    for stage in stages:
        entry = lock.get(stage.addressing)
        if not isinstance(entry, dict) or stage.cmd is None:
            continue  # never run: DVC's status says so
        params = {d.def_path: d.params for d in stage.deps if isinstance(d, ParamsDependency)}
        whole = {f for f, keys in params.items() if not keys}  # `- extra.yaml:` tracks every key of the file
        declared = {
            "deps": {d.def_path for d in stage.deps if not isinstance(d, ParamsDependency)},
            "outs": {d.def_path for d in stage.outs},
            "params": {f"{f}:{k}" for f, keys in params.items() for k in keys or ["*"]},
        }
        recorded = {
            "deps": {str(d.get("path")) for d in entry.get("deps") or []},
            "outs": {str(d.get("path")) for d in entry.get("outs") or []},
            "params": {f"{f}:{'*' if f in whole else k}" for f, values in (entry.get("params") or {}).items()
                       for k in values or {}},
        }
        for kind in declared:
            if declared[kind] != recorded[kind]:
                lines.append(f"{stage.addressing}: dvc.yaml's {kind} are not the ones dvc.lock recorded "
                             f"({', '.join(sorted(declared[kind] ^ recorded[kind]))})")
    return lines


def checkout_files(root: Path = Path(".")) -> list[str]:
    """What a clean clone plus the edits holds: tracked files, and untracked ones git does not ignore (relative)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                         text=True)
    if out.returncode != 0:
        from pipelines.core.errors import QuantgateError

        raise QuantgateError(f"{Path(root).resolve()}: not a git checkout ({out.stderr.strip()})")
    return sorted(set(filter(None, out.stdout.split("\0"))))


def git_commit(cwd: Path = Path(".")) -> dict:
    """HEAD's commit and whether the working tree differs from it (None outside a git checkout)."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def recorded_commit(root: Path = Path(".")) -> dict:
    """The commit a run's code is, for MLflow's tags: HEAD of this checkout. In a profile's workspace, the checkout's
    commit it was synced from (its own history only counts syncs), dirty when that checkout was, or when the workspace
    was edited since its sync (uncommitted changes, or a HEAD that is not the sync's commit)."""
    from pipelines.core.io import read_json
    from pipelines.core.paths import PROFILE_MARKER

    own = git_commit(root)
    if not (root / PROFILE_MARKER).is_file():
        return own
    marker = read_json(root / PROFILE_MARKER)
    synced = marker.get("synced_from") or {}
    edited = own["dirty"] is not False or own["commit"] != marker.get("workspace_commit")
    return {"commit": synced.get("commit"), "dirty": bool(synced.get("dirty")) or edited,
            "workspace_commit": own["commit"], "profile": marker.get("profile")}


def stage_code(stage: str, root: Path = Path(__file__).resolve().parents[2]) -> list[str]:
    """The files of `pipelines/` that stage `stage` runs: its own module (`pipelines/<stage>.py`), what that imports,
    and so on, with the `__init__.py` of every package on the way. dvc.yaml lists exactly these as the stage's code
    deps (tests/test_dvc_stages.py; `python scripts/sync_dvc_deps.py` writes them), so a change re-runs the stages
    whose code it is and no other: cli.py, which only dispatches, is no stage's code."""
    seen: set[Path] = set()
    todo = [f"pipelines.{stage.replace('-', '_')}"]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
            path = _module_file(".".join(parts[:depth]), root)
            if path is not None and path not in seen:
                seen.add(path)
                todo.extend(_imported(ast.parse(path.read_text(encoding="utf-8")).body, root))
    return sorted(path.relative_to(root).as_posix() for path in seen)


def _module_file(name: str, root: Path) -> Path | None:
    """pipelines.core.io -> <root>/pipelines/core/io.py (or its package's __init__.py); None for no such module."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


TARGET_RE = re.compile(r"pipelines(\.\w+)+:\w+")


def _imported(nodes: list[ast.stmt], root: Path) -> set[str]:
    """Modules of the `pipelines` package imported anywhere in `nodes`, module level or inside functions, or named
    as an isolated child's target (`"pipelines.evaluation.harness:evaluate_variant"`: isolation.run_isolated)."""
    found = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET_RE.fullmatch(node.value):
            found.add(node.value.split(":")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipelines" and not node.level:
            found.add(node.module)
            # `from pipelines.core import io`: io is a module of its own
            found |= {f"{node.module}.{a.name}" for a in node.names if _module_file(f"{node.module}.{a.name}", root)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pipelines"}
    return found
