"""`quantgate fetch`: download the checkpoint behind a registry alias or version and verify every file's sha256.

A deployment takes its bytes from here, not from a workspace folder the next `dvc repro` overwrites;
a file that differs from what the gate judged, or is missing, stops it (exit 2, naming the file).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipelines.core import logs
from pipelines.core.params import load_params
from pipelines.store.tracking import tracking_uri

log = logging.getLogger(__name__)


def main(ref: str, model: str | None = None, dest: str | None = None) -> int:
    from pipelines.store.registry import fetch_checkpoint

    name = model or load_params().registered_model_name()
    with logs.library_output("mlflow"):
        got = fetch_checkpoint(tracking_uri(), name, ref, Path(dest) if dest else None)
    aliases = f", alias {', '.join(got['aliases'])}" if got["aliases"] else ""
    log.info("fetch: %s version %s (%s%s) %s %s: %d files verified, sha256 %s", name, got["version"], got["variant"],
             aliases, "is already in" if got["status"] == "already there" else "->", got["dest"], got["files"], got["sha256"])
    return 0
