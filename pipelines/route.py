"""Stage `route`: request type and context length -> the variant that serves it, with the evidence.

Serve: the cheapest variant whose verdict for the domain is `pass` and whose saving against fp16 at the
bucket's context length reaches the policy's `min_memory_saving_pct`; fp16 when none does.
Fallback under memory pressure: the cheapest passing variant at all (it may save less than the
routing threshold); fp16's row falls back to itself only when nothing passed. Cost = measured load
footprint + measured KV bytes per token x the bucket's upper bound.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.io import read_json
from pipelines.core.paths import BASELINE, MANIFEST
from pipelines.judging.verdict import usable
from pipelines.models.loading import weights_sha256


def cost_bytes(memory: dict | None, tokens: int) -> float | None:
    """Memory one request costs: footprint plus KV bytes per token (measured, else theoretical) x tokens."""
    if not memory or not usable(memory.get("footprint_bytes")):
        return None
    per_token = memory.get("fitted_bytes_per_token")
    if not usable(per_token) or per_token <= 0:
        per_token = memory.get("theoretical_kv_bytes_per_token")
    if not usable(per_token):
        return None
    return memory["footprint_bytes"] + per_token * tokens


def provenance(name: str, variants_dir: Path, compare_row: dict | None) -> dict:
    """What the routed variant was built from and judged with."""
    path = variants_dir / name / MANIFEST
    manifest = read_json(path) if path.is_file() else {}
    tasks = {}
    if compare_row:
        tasks = {d: row.get("task_version") for d, row in compare_row["domains"].items()}
    return {"checkpoint_sha256": weights_sha256(manifest), "calibration_sha256": (manifest.get("calibration") or {}).get("sha256"),
            "libraries": manifest.get("libraries"), "task_versions": tasks or None,
            "method": manifest.get("method"), "device": manifest.get("device")}


def baseline_rows(names: list[str], buckets: list[int], why: str, digest: str | None, base_mem: dict | None) -> list[dict]:
    """Rows that fp16 serves whatever was measured: requests the classifier could not decide, and declared
    request types that were not evaluated."""
    return [{"domain": name, "max_context_tokens": tokens, "serve": BASELINE, "fallback_under_memory_pressure": BASELINE,
             "reason": why.format(name=name), "cost_bytes": {"serve": cost_bytes(base_mem, tokens), "fp16": cost_bytes(base_mem, tokens)}, "evidence": None,
             "considered": [], "provenance": {"checkpoint_sha256": {}, "calibration_sha256": None, "dvc_lock_sha256": digest}}
            for name in names for tokens in buckets]


def build_table(report: dict, buckets: list[int], policy_for, variants_dir: Path, digest: str | None,
                classifier: dict[str, dict] | None = None) -> dict:
    """The routing table: one row per domain and context bucket, plus fp16 rows for what was not judged.

    `classifier`: every declared request type's rule (params.ClassifyParams as dicts); the table carries it, so
    the router classifies with exactly the rules the table was built for."""
    base_mem = report["fp16"].get("memory")
    rows = []
    for domain in report["domains"]:
        policy = policy_for(domain)
        for tokens in buckets:
            base_cost = cost_bytes(base_mem, tokens)
            considered = []
            for name, v in report["variants"].items():
                d = v["domains"].get(domain, {"verdict": "fail", "reasons": ["not compared"]})
                cost = cost_bytes(v.get("memory"), tokens)
                saving = 100 * (1 - cost / base_cost) if cost is not None and base_cost else None
                considered.append({"variant": name, "verdict": d["verdict"], "cost_bytes": cost, "saving_pct": saving,
                                   "reasons": d["reasons"]})
            passing = sorted((c for c in considered if c["verdict"] == "pass" and c["saving_pct"] is not None),
                             key=lambda c: c["cost_bytes"])
            worth = [c for c in passing if c["saving_pct"] >= policy.min_memory_saving_pct]
            serve = worth[0]["variant"] if worth else BASELINE
            fallback = passing[0]["variant"] if passing else BASELINE
            chosen = next((c for c in considered if c["variant"] == serve), None)
            if serve == BASELINE:
                why = ("no variant passed" if not passing else
                       f"passing variants save less than {policy.min_memory_saving_pct} % at {tokens} tokens")
            else:
                why = f"cheapest passing variant, saves {chosen['saving_pct']:.1f} % against fp16 at {tokens} tokens"
            evidence = report["variants"][serve]["domains"][domain] if serve != BASELINE else None
            rows.append({
                "domain": domain, "max_context_tokens": tokens, "serve": serve, "fallback_under_memory_pressure": fallback,
                "reason": why, "cost_bytes": {"serve": chosen["cost_bytes"] if chosen else base_cost, "fp16": base_cost},
                "evidence": None if evidence is None else {
                    "verdict": evidence["verdict"], "difference": evidence["paired"]["difference"],
                    "ci_low": evidence["paired"]["ci_low"], "ci_high": evidence["paired"]["ci_high"],
                    "flip_rate": evidence["paired"]["flip_rate"], "mcnemar_p": evidence["paired"]["mcnemar_p"],
                    "kl": evidence["checks"]["kl"], "items": evidence["paired"]["items"]},
                "considered": considered,
                "provenance": {**provenance(serve, variants_dir, report["variants"].get(serve)), "dvc_lock_sha256": digest},
            })
    table = {"baseline": BASELINE, "buckets": buckets, "dvc_lock_sha256": digest, "rows": rows}
    if classifier is not None:
        from pipelines.text.classify import AMBIGUOUS, UNKNOWN

        rows += baseline_rows([d for d in classifier if d not in report["domains"]], buckets,
                              "request type {name} was not evaluated (evaluate.domains leaves it out)", digest, base_mem)
        rows += baseline_rows([UNKNOWN], buckets, "no request type's classifier rule matches: served by the baseline",
                              digest, base_mem)
        rows += baseline_rows([AMBIGUOUS], buckets, "two request types match at the same priority: served by the "
                                                    "baseline", digest, base_mem)
        table["classifier"] = classifier
    return table


def main() -> int:
    """Stage `route`: build the routing table from compare.json (`quantgate route lookup` serves it: routing/router.py)."""
    import logging

    from pipelines.core.io import write_json, write_yaml
    from pipelines.core.lineage import lock_digest
    from pipelines.core.params import load_params
    from pipelines.core.paths import COMPARE_REPORT, ROUTING_TABLE, VARIANTS_DIR

    log = logging.getLogger(__name__)
    params = load_params()
    report = read_json(COMPARE_REPORT)
    table = build_table(report, params.route.context_buckets, params.compare.policy_for, VARIANTS_DIR,
                        lock_digest(), {name: rule.model_dump() for name, rule in params.coverage.classify.items()})
    write_json(ROUTING_TABLE, table)
    write_yaml(ROUTING_TABLE.with_suffix(".yaml"), table)
    for row in table["rows"]:
        log.info("route %-12s <= %6d tokens: serve %-8s fallback %-8s (%s)", row["domain"], row["max_context_tokens"],
                 row["serve"], row["fallback_under_memory_pressure"], row["reason"])
    log.info("route: %s and %s", ROUTING_TABLE, ROUTING_TABLE.with_suffix(".yaml"))
    return 0
