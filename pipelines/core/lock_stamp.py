"""A stat stamp of every file dvc.lock vouches for, so that a no-op `quantgate repro` answers without DVC.

`dvc status` takes about 2 s here even when nothing changed (it starts, reads every stage and checks every
dependency). After a run that DVC found clean, `quantgate repro` records the size, mtime and inode of
dvc.yaml, dvc.lock, the params files and every dependency and output dvc.lock names (folders walked). Next
time, when every one of them is as recorded, nothing DVC would look at has changed, and the answer is "up
to date" in milliseconds; any difference (an edit, a new file in a dependency folder, a touched file) and
DVC decides, as always. The stamp lives in .dvc/tmp (DVC's own scratch, never committed), and is written only
when the files did not move while DVC checked them.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipelines.core.io import atomic_write_text
from pipelines.core.paths import DVC_LOCK, DVC_YAML

STAMP = Path(".dvc/tmp/quantgate-clean-stamp.json")


def _stat(path: Path, into: dict[str, list[int]], root: Path) -> None:
    try:
        st = path.stat()
    except OSError:
        into[str(path.relative_to(root))] = [-1]  # missing: recorded as missing
        return
    if path.is_dir():
        for child in sorted(path.iterdir()):
            if child.name != "__pycache__":
                _stat(child, into, root)
        return
    into[str(path.relative_to(root))] = [st.st_size, st.st_mtime_ns, st.st_ino]


def snapshot(root: Path) -> dict[str, list[int]] | None:
    """Size, mtime and inode of every file DVC would look at for this pipeline, or None without a dvc.lock."""
    lock = root / DVC_LOCK
    if not lock.is_file():
        return None
    try:
        stages = (yaml.load(lock.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
                  or {}).get("stages") or {}
    except (yaml.YAMLError, OSError, AttributeError):
        return None
    paths = {DVC_YAML, DVC_LOCK, Path(".dvc/config")}
    for stage in stages.values():
        paths.update(Path(entry["path"]) for key in ("deps", "outs") for entry in stage.get(key) or [])
        paths.update(Path(name) for name in stage.get("params") or {})
    seen: dict[str, list[int]] = {}
    for path in sorted(paths):
        _stat(root / path, seen, root)
    return seen


def is_clean(root: Path) -> bool:
    """True when every file is as it was when DVC last found the pipeline clean."""
    try:
        stamp = json.loads((root / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    now = snapshot(root)
    return now is not None and stamp == now


def save(root: Path, before: dict[str, list[int]] | None) -> None:
    """Record `before` (taken before DVC found the pipeline clean) if nothing moved since."""
    if before is not None and snapshot(root) == before:
        atomic_write_text(root / STAMP, json.dumps(before))


def forget(root: Path) -> None:
    """Drop the stamp (a run is starting: until DVC says clean again, only DVC decides)."""
    (root / STAMP).unlink(missing_ok=True)
