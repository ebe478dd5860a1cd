"""One log line per probe row of an evaluation: what baseline and evaluate print as they finish."""

from __future__ import annotations

import logging

log = logging.getLogger("pipelines.evaluate")


def log_probes(name: str, result: dict) -> None:
    if result["status"] != "ok":
        log.warning("evaluate %s: FAILED (%s)", name, result["error"])
        return
    for domain, row in result["probes"].items():
        if row["status"] != "ok":
            log.warning("evaluate %s %-12s REFUSED: %s", name, domain, row["reason"])
            continue
        fid = result["fidelity"][domain.split(":")[0]]  # a standard task row `<domain>:<task>` has its domain's
        log.info("evaluate %s %-12s %s %.3f (%d items)  KL mean %.5f  same top-1 %.1f%%", name, domain,
                 row["metric"], row["score"], row["items"], fid["kl"]["mean"], 100 * fid["same_top1"])
