"""A stat stamp of every file dvc.lock vouches for, so that a no-op `quantgate repro` answers without DVC.

`dvc status` takes about 2 s here even when nothing changed (it starts, reads every stage and checks every
dependency). After DVC found the pipeline clean, `quantgate repro` records the size, mtime, ctime and inode of
dvc.yaml, dvc.lock, params.yaml, DVC's config files and .dvcignore, every dependency and output dvc.lock names
(folders walked), and the cache objects of its outputs (a cleared cache makes `dvc repro` run again). Next time,
when every one of them is as recorded, nothing DVC would look at has changed and the answer is "up to date" in
milliseconds; any difference and DVC decides, as always. The stamp is not used at all where DVC would read more
than these files: a cache folder set in a config, `.dvc` files or a dvc.yaml below the root. It is written only
when the files did not move while DVC checked them and none was written within the last second (a later write in
the same timestamp tick would go unseen). It lives in .dvc/tmp (DVC's scratch, never committed).
"""

from __future__ import annotations

import configparser
import json
import subprocess
import time
from pathlib import Path

import yaml

from pipelines.core.io import atomic_write_text
from pipelines.core.paths import DVC_LOCK, DVC_YAML, PARAMS_FILE

STAMP = Path(".dvc/tmp/quantgate-clean-stamp.json")
CACHE = Path(".dvc/cache/files/md5")
CONFIGS = [Path(".dvc/config"), Path(".dvc/config.local"), Path(".dvcignore"),
           Path("~/.config/dvc/config").expanduser(), Path("/etc/xdg/dvc/config")]
RACY_SECONDS = 1.0


def _stat(path: Path, into: dict[str, list[int]]) -> None:
    try:
        st = path.stat()
    except OSError:
        into[str(path)] = [-1]  # missing: recorded as missing
        return
    if path.is_dir():
        for child in sorted(path.iterdir()):
            if child.name != "__pycache__":
                _stat(child, into)
        return
    into[str(path)] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _other_cache_or_files(root: Path) -> bool:
    """True where DVC reads what the stamp does not cover: a cache folder set in a config, `.dvc` files, a nested
    dvc.yaml (or no git to list them)."""
    for config in CONFIGS[:2] + CONFIGS[3:]:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        try:
            parser.read(config if config.is_absolute() else root / config, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError):
            return True
        if any(parser.has_option(section, "dir") for section in parser.sections() if section.startswith("cache")):
            return True
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "*.dvc", "*/dvc.yaml"], cwd=root,
                            capture_output=True, text=True)
    return listed.returncode != 0 or bool(listed.stdout.strip())


def snapshot(root: Path) -> dict[str, list[int]] | None:
    """Size, mtime, ctime and inode of every file DVC would look at for this pipeline, or None where the stamp
    cannot stand in for DVC (no dvc.lock, an unreadable one, another cache, other DVC files, a remote path, a
    folder it may not read)."""
    try:
        return _snapshot(root)
    except Exception:  # noqa: BLE001 - whatever it cannot read, DVC decides
        return None


def _snapshot(root: Path) -> dict[str, list[int]] | None:
    try:
        lock = yaml.load((root / DVC_LOCK).read_text(encoding="utf-8"),
                         Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        stages = lock["stages"]
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None
    if _other_cache_or_files(root):
        return None
    paths = {root / DVC_YAML, root / DVC_LOCK, root / PARAMS_FILE, *(root / c for c in CONFIGS)}
    objects: set[str] = set()
    for stage in stages.values():
        for entry in [*(stage.get("deps") or []), *(stage.get("outs") or [])]:
            if "://" in entry["path"]:  # a remote dependency: DVC asks the remote
                return None
            paths.add(root / entry["path"])  # an absolute path stays absolute
        objects.update(out["md5"] for out in stage.get("outs") or [] if out.get("md5"))
        paths.update(root / name for name in stage.get("params") or {})
    seen: dict[str, list[int]] = {}
    for path in sorted(paths):
        _stat(path, seen)
    for md5 in sorted(objects):  # the outputs' cache objects (a `cache: false` output has none: recorded missing)
        obj = root / CACHE / md5[:2] / md5[2:]
        _stat(obj, seen)
        if md5.endswith(".dir") and obj.is_file():
            try:
                entries = json.loads(obj.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            for entry in entries:
                _stat(root / CACHE / entry["md5"][:2] / entry["md5"][2:], seen)
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
    """Record `before` (taken before DVC found the pipeline clean) if nothing moved since and nothing was written
    in the last RACY_SECONDS (a write in the same mtime tick as the one recorded would go unseen)."""
    checked = time.time_ns()
    if before is None or snapshot(root) != before:
        return
    if any(len(v) > 1 and max(v[1], v[2]) > checked - RACY_SECONDS * 1e9 for v in before.values()):
        return
    atomic_write_text(root / STAMP, json.dumps(before))


def forget(root: Path) -> None:
    """Drop the stamp (a run is starting: until DVC says clean again, only DVC decides)."""
    (root / STAMP).unlink(missing_ok=True)
