"""The slowest fixtures' work, kept by the content that makes it: built once per run for every worker, and again in a
later run only when something it depends on changed (docs/testing.md).

An entry is reused only where all of these are the same: the pipelines/ code the work runs (the modules named and what
they import, by lineage.stage_code: the rule that decides a DVC stage's code deps), the tests/ files named, the project's
shipped data (what the checkout holds of eval/, calibration_sets/, reference_model/, profiles/, params.yaml and the
pins: not a pipeline run's outputs there), the bytes of its inputs (another entry by its build), the fixture's settings,
every installed package's version, the Python, the CPU (int8's numbers differ by CPU) and whether bubblewrap isolates
code here. Anything else builds it anew. Each file of an entry is checked against its size and modification time when
it is reused: a test that wrote into one rebuilds it instead of reading it.

Where: `QUANTGATE_TEST_CACHE` names the folder kept between runs (default ~/.cache/quantgate/tests). Set to 0, entries
live for the run only (every fixture built from nothing, as on a fresh machine), still shared by its workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from filelock import FileLock

from pipelines.core.io import atomic_write_text
from pipelines.core.lineage import checkout_files, stage_code
from tests.conftest import ROOT

SHIPPED_DATA = ("eval", "calibration_sets", "reference_model", "profiles", "params.yaml", "pyproject.toml",
                "constraints.txt")
STALE_AFTER_S = 7 * 86400
ENTRY_OF_FIXTURE: dict[tuple[str, str], Path] = {}  # this process's entries' pointers, by the asking fixture's
# (module, function)


def kept_between_runs() -> Path | None:
    """The folder entries are kept in between runs, or None (QUANTGATE_TEST_CACHE=0: this run only)."""
    chosen = os.environ.get("QUANTGATE_TEST_CACHE", "")
    if chosen in ("0", "off", "no", "false"):
        return None
    return Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantgate/tests"


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []


def _digest_files(paths: Iterable[Path], base: Path) -> dict[str, str]:
    """sha256 of each file under `paths`, by its path relative to `base`; a build of this cache by its folder (one
    build, never changed in place)."""
    out = {}
    for path in paths:
        if path.is_dir() and _root_of(path) is not None:
            out[str(path)] = "a build of the test cache"
            continue
        for p in _files(path):
            out[p.relative_to(base).as_posix() if p.is_relative_to(base) else str(p)] = \
                hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _root_of(path: Path) -> Path | None:
    """The cache folder `path` is a build in, if it is one (a sibling `<name>-<key>.json` names it)."""
    name = path.name.rsplit(".", 1)[0]
    return path.parent if (path.parent / f"{name}.json").is_file() else None


def _stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of each file a build holds (cheap to check on every reuse)."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in _files(folder)}


@cache
def _machine() -> str:
    """Every installed distribution's version, the Python, the platform, the CPU's model and flags, and how code
    probes are isolated here (bubblewrap or not: scores and counts of code items depend on it)."""
    from pipelines.core.sandbox import isolation_level

    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith(("model name", "flags"))][:2] if Path("/proc/cpuinfo").is_file() else []
    return json.dumps([packages, sys.version, platform.platform(), cpu, isolation_level()[0]])


@cache
def _shipped_data() -> str:
    files = [ROOT / f for f in checkout_files(ROOT) if f.split("/")[0] in SHIPPED_DATA]
    return json.dumps(_digest_files(files, ROOT), sort_keys=True)


def content_key(name: str, code: Iterable[str], helpers: Iterable[str], inputs: Iterable[Path], settings: Any) -> str:
    """sha256 of everything an entry depends on (module docstring)."""
    helpers = list(helpers)
    if missing := [h for h in helpers if not (ROOT / h).is_file()]:  # (a renamed helper would key nothing)
        raise FileNotFoundError(f"content cache {name!r}: helper {missing[0]} is not a file under {ROOT}")
    files = sorted({f for module in code for f in stage_code(module, ROOT)} | set(helpers))
    parts = [name, json.dumps(settings, sort_keys=True, default=str), _machine(), _shipped_data(),
             json.dumps(_digest_files([ROOT / f for f in files], ROOT), sort_keys=True),
             json.dumps([_digest_files([Path(i)], Path(i)) for i in inputs], sort_keys=True)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _encode(value: Any, folder: Path) -> Any:
    """JSON for a fixture's value: a path inside the entry is kept relative to it, so the entry can be found again."""
    if isinstance(value, Path):
        return {"__path__": value.relative_to(folder).as_posix() if value.is_relative_to(folder) else str(value),
                "inside": value.is_relative_to(folder)}
    if isinstance(value, (list, tuple)):
        return [_encode(v, folder) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, folder), _encode(v, folder)] for k, v in value.items()]}
    return value


def _decode(value: Any, folder: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, folder) for v in value]
    if isinstance(value, dict) and "__path__" in value:
        return folder / value["__path__"] if value["inside"] else Path(value["__path__"])
    if isinstance(value, dict):
        return {_decode(k, folder): _decode(v, folder) for k, v in value["__dict__"]}
    return value


def _intact(pointer: Path) -> tuple[Path, Any] | None:
    """(folder, value) of the entry `pointer` names where every file it holds is the one it was built with; None
    otherwise, with a warning where it was finished (then a test wrote into a shared fixture's files)."""
    try:
        manifest = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return None
    folder = pointer.parent / manifest["folder"]
    if (now := _stamps(folder)) != {k: tuple(v) for k, v in manifest["files"].items()}:
        changed = sorted(set(now.items()) ^ {(k, tuple(v)) for k, v in manifest["files"].items()})
        warnings.warn(f"content cache: {folder.name} is built again: {changed[0][0]} changed since it was built")
        return None
    os.utime(pointer)  # used: neither is an old entry to clear (_clear_unused)
    os.utime(folder)
    return folder, manifest["value"]


def cached(tmp_path_factory, name: str, build: Callable[[Path], Any], *, code: Iterable[str] = (),
           helpers: Iterable[str] = (), inputs: Iterable[Path] = (), settings: Any = None, source: bool = False) -> Any:
    """build(folder)'s value (JSON, paths, tuples as lists), built into a folder of its own once for its content key.

    `code`: modules of pipelines/ the work runs ("memory", "evaluation.harness"), with what they import; `helpers`:
    files under tests/ whose code it runs, relative to the repository; `inputs`: folders or files it reads (another
    entry's folder counts as that build: a rebuilt input rebuilds what was made from it); `source`: other entries are
    made from this one (the tiny model's chain), so a failed test that read it does not forget it (entries_of()).

    An entry is never changed or removed in place: a rebuild goes to a new folder and the pointer
    (`<name>-<key>.json`, written last) moves to it, so another worker or run still reading the old one keeps it."""
    inputs = list(inputs)
    fixture = sys._getframe(1)  # the fixture function calling (entries_of())
    key = content_key(name, code, helpers, inputs, settings)[:20]
    root = kept_between_runs() or (tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER")
                                   else tmp_path_factory.getbasetemp()) / "content-cache"
    pointer = root / f"{name}-{key}.json"
    if not source:
        ENTRY_OF_FIXTURE[(fixture.f_globals["__name__"], fixture.f_code.co_name)] = pointer
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(pointer) + ".lock"):
        if found := _intact(pointer):
            return _decode(found[1], found[0])
        _clear_unused(root, name)
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-{key}.", dir=root))
        value = _encode(build(folder), folder)
        atomic_write_text(pointer, json.dumps({"key": key, "folder": folder.name, "value": value,
                                               "files": _stamps(folder)}))
    return _decode(value, folder)


def _clear_unused(root: Path, name: str) -> None:
    """The name's pointers and builds nobody used for a week (older code's keys, forgotten builds): every reuse
    touches both (_intact), so a build a run is reading is never this old."""
    old = time.time() - STALE_AFTER_S
    for pointer in root.glob(f"{name}-*.json"):
        if pointer.stat().st_mtime < old:
            pointer.unlink(missing_ok=True)
    named = set()
    for pointer in root.glob(f"{name}-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            named.add(json.loads(pointer.read_text())["folder"])
    for build in root.glob(f"{name}-*.*/"):
        if build.is_dir() and build.name not in named and build.stat().st_mtime < old:
            shutil.rmtree(build, ignore_errors=True)


def entries_of(item) -> list[str]:
    """The entries a test read through its fixtures, those its fixtures are built from included, but not a `source`
    (the tiny model's chain: a failing memory test forgets its soaks, not the model they were measured on)."""
    found = []
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ())[-1:]:
            if (pointer := ENTRY_OF_FIXTURE.get((fixturedef.func.__module__, fixturedef.func.__name__))) is not None:
                found.append(str(pointer))
    return found


def forget(pointers: Iterable[str]) -> None:
    """Entries a failed test read are built anew next run: a measurement that came out wrong once (a flake) is not
    kept to fail every later run. Only the pointer goes: whoever still reads the build keeps its files."""
    for pointer in pointers:
        Path(pointer).unlink(missing_ok=True)
