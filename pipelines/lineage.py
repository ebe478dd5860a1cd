"""Where results came from: the dvc.lock entries that produced them and the git commit of the code.

DVC writes each stage's dvc.lock entry as the stage finishes, so while `compare`, `route` or `record`
runs, the entries of every stage before it already name the exact inputs and outputs being judged.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import yaml

JUDGING_STAGES = ("compare", "route", "record", "gate")  # stages that read the pipeline's results, not make them


def lock_digest(lock_path: Path = Path("dvc.lock"), exclude: tuple[str, ...] = JUDGING_STAGES) -> str | None:
    """sha256 of dvc.lock's entries for the stages that produced the results; None without a dvc.lock."""
    if not lock_path.is_file():
        return None
    lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
    stages = {k: v for k, v in (lock.get("stages") or {}).items() if k.split("@")[0] not in exclude}
    return hashlib.sha256(json.dumps(stages, sort_keys=True).encode()).hexdigest()


def git_commit(cwd: Path = Path(".")) -> dict:
    """HEAD's commit and whether the working tree differs from it (None outside a git checkout)."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}
