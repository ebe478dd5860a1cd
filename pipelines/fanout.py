"""`quantgate fanout`: the per-variant chains on a Ray cluster, recorded in dvc.lock as if `dvc repro` ran them.

    ray start --head --num-cpus N              # one machine; the others: ray start --address HEAD:6379
    quantgate fanout --address auto            # quantize/admit -> memory, baseline -> evaluate, as Ray tasks
    dvc repro                                  # what is left: memory-report, compare, shadow, route, record

The machinery (tasks, retries, failures recorded, `dvc commit`) is pipelines/chains/tasks.py, which
`quantgate repro` also uses on a private local cluster.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipelines.chains.tasks import one_run_at_a_time, repo_root, run_chains

log = logging.getLogger(__name__)


def main(address: str | None = None, report: str | None = None, insecure: bool = False) -> int:
    """`quantgate fanout`: the per-variant chains as Ray tasks on a cluster, then `dvc commit` of what ran; a cluster
    without Ray's token authentication is refused unless `insecure`."""
    from pipelines.core.io import write_json
    from pipelines.core.params import load_params

    root = repo_root()
    with one_run_at_a_time(root):
        done = run_chains(root, load_params(), address, insecure=insecure)
    if report:
        write_json(Path(report), done)
    for name, row in done["ran"].items():
        log.info("fanout %-16s %7.1f s on %s", name, row["seconds"], row["node"])
    for name, why in done["failed"].items():
        log.warning("fanout %-16s FAILED, recorded: %s", name, why)
    log.info("fanout: %d stages ran, %d failed (recorded), %d up to date; dvc.lock records them. Next: dvc repro "
             "(memory-report, compare, shadow, route, record)%s", len(done["ran"]), len(done["failed"]),
             len(done["skipped_up_to_date"]), f"; wall time {done['wall_seconds']} s" if "wall_seconds" in done else "")
    return 0
