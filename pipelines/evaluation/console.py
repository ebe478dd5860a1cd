"""What baseline and evaluate do with an evaluation's result once its process has ended: one log line per probe
row, and the per-text fidelity rows taken out for their own file. No torch here: those stages' parents import this."""

from __future__ import annotations

import logging

log = logging.getLogger("pipelines.evaluate")
EVALUATE_VARIANT = "pipelines.evaluation.harness:evaluate_variant"  # run_isolated imports it in the child only


def log_probes(name: str, result: dict) -> None:
    if result["status"] != "ok":
        log.warning("evaluate %s: FAILED (%s)", name, result["error"])
        return
    for domain, row in result["probes"].items():
        if row["status"] != "ok":
            log.warning("evaluate %s %-12s REFUSED: %s", name, domain, row["reason"])
            continue
        fid = (result.get("fidelity") or {}).get(domain.split(":")[0])  # a task row `<domain>:<task>`: its domain's
        if fid is None:  # a sample log (pipelines/evaluation/sample_logs.py) has no token distributions
            log.info("evaluate %s %-12s %s %.3f (%d items%s)  KL %s", name, domain, row["metric"], row["score"],
                     row["items"], f", from {row['source']}" if row.get("source") else "",
                     "not measured (a sample log)" if result.get("evidence") else "MISSING")
            continue
        log.info("evaluate %s %-12s %s %.3f (%d items)  KL mean %.5f  same top-1 %.1f%%", name, domain,
                 row["metric"], row["score"], row["items"], fid["kl"]["mean"], 100 * fid["same_top1"])


def pop_texts(result: dict) -> list[dict]:
    """Take the per-text rows out of an evaluation result (they go to their own file): every domain's, in order."""
    return [row for fid in (result.get("fidelity") or {}).values() for row in fid.pop("per_text", [])]
