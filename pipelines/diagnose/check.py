"""What every doctor check returns, and the small probes several checks share.

A `Check` is one row of `quantgate doctor`'s table; a check never raises (`guarded` turns a broken check into a
`fail` row saying how), so one broken probe cannot hide the others.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    remedy: str = ""


def guarded(name: str, check, *args) -> Check:
    try:
        return check(*args)
    except Exception as err:  # noqa: BLE001 - the doctor reports, it does not crash
        return Check(name, FAIL, f"the check itself failed: {type(err).__name__}: {err}")


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def libraries(pairs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """([dist version, ...], [missing dist, ...]) for (distribution, module) pairs; nothing is imported."""
    have, missing = [], []
    for dist, module in pairs:
        version = installed_version(dist)
        if version is None or importlib.util.find_spec(module) is None:
            missing.append(dist)
        else:
            have.append(f"{dist} {version}")
    return have, missing


def existing(path: Path) -> Path:
    """The path itself or its nearest existing parent: where a file not yet written would land."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
