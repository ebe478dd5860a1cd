"""Stage `route`: request type and context length -> the variant that serves it, with the evidence.

Serve: the cheapest variant whose verdict for the domain is `pass` and whose saving against fp16 at the
bucket's context length reaches the policy's `min_memory_saving_pct`; fp16 when none does.
Fallback under memory pressure: the cheapest passing variant at all (it may save less than the
routing threshold); fp16's row falls back to itself only when nothing passed. Cost = measured load
footprint + measured KV bytes per token x the bucket's upper bound.
Listens to the shadow replay (results/shadow.json, docs/shadow.md): a passing variant serves a type only if it
answered at least `min_agreement` of that type's replayed requests exactly as fp16 did, over at least
`shadow.min_requests` of them; else the next one does. Writes the rollout plan for what it routes.
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


def shadow_numbers(shadow: dict, name: str, domain: str, tokens: int,
                   min_requests: int) -> tuple[dict | None, str | None]:
    """The variant's replayed agreement for the row (its bucket, or "all" where the bucket holds fewer than
    `min_requests`), and why it cannot serve on them (None: it can, if its share is high enough)."""
    model = shadow.get("models", {}).get(name)
    if model is None:
        return None, f"not in the shadow replay ({name} was not replayed)"
    if model.get("status") == "not_measured":
        return None, model.get("reason") or "not replayed"
    if model.get("status") != "ok":
        return None, f"shadow replay failed ({model.get('error') or 'no error recorded'})"
    by_bucket = (model.get("agreement") or {}).get(domain) or {}
    own = by_bucket.get(str(tokens)) or {}
    key = str(tokens) if own.get("requests", 0) >= min_requests else "all"
    numbers = by_bucket.get(key)
    if not numbers or numbers.get("requests", 0) < min_requests:
        count = (numbers or {}).get("requests", 0)
        return None, (f"too few replayed {domain} requests for the shadow check ({count} < shadow.min_requests "
                      f"{min_requests})")
    exact = numbers.get("exact") or {}
    if not all(usable(exact.get(k)) for k in ("share", "low", "high")):
        return None, f"no usable exact agreement for {domain} (bucket {key}) in the shadow report ({exact!r})"
    out = {"variant": name, "bucket": key, "requests": numbers["requests"], "exact": exact,
           "similarity_mean": (numbers.get("similarity") or {}).get("mean"),
           "outcome_share": (numbers.get("outcome") or {}).get("share"),
           "bucket_requests": own.get("requests", 0)}
    if key == "all" and own.get("requests"):
        out["bucket_exact"] = own.get("exact")
    return out, None


def listens(candidate: dict, shadow: dict | None, domain: str, tokens: int, policy, min_requests: int) -> bool:
    """Whether the shadow replay lets the candidate serve the row; records the numbers and the reason in it.

    On evidence, as compare's rule: the low end of the exact agreement's Wilson interval must reach the type's
    `min_agreement`; judged on all of the type's buckets where the row's own holds fewer than `min_requests`, but
    never against the bucket's own evidence (its interval's high end below `min_agreement` refuses)."""
    if shadow is None:
        return True
    numbers, why = shadow_numbers(shadow, candidate["variant"], domain, tokens, min_requests)
    if why is None:
        exact, need = numbers["exact"], policy.min_agreement
        own = numbers.get("bucket_exact") or {}
        if exact["low"] < need:
            why = (f"shadow agreement {exact['share']:.2f} [{exact['low']:.2f}, {exact['high']:.2f}] on "
                   f"{numbers['requests']} replayed {domain} requests: its low end is below {need:.2f}")
        elif usable(own.get("high")) and own["high"] < need:
            why = (f"shadow agreement in the {tokens}-token bucket {own['share']:.2f} [{own['low']:.2f}, "
                   f"{own['high']:.2f}] on {numbers['bucket_requests']} requests is below {need:.2f}")
    candidate["shadow"] = numbers
    candidate["shadow_refused"] = why
    return why is None


def baseline_rows(names: list[str], buckets: list[int], why: str, digest: str | None, base_mem: dict | None) -> list[dict]:
    """Rows that fp16 serves whatever was measured: requests the classifier could not decide, and declared
    request types that were not evaluated."""
    return [{"domain": name, "max_context_tokens": tokens, "serve": BASELINE, "fallback_under_memory_pressure": BASELINE,
             "reason": why.format(name=name), "cost_bytes": {"serve": cost_bytes(base_mem, tokens), "fp16": cost_bytes(base_mem, tokens)}, "evidence": None, "shadow": None,
             "considered": [], "provenance": {"checkpoint_sha256": {}, "calibration_sha256": None, "dvc_lock_sha256": digest}}
            for name in names for tokens in buckets]


def serve_row(row: dict, serve: str, fallback: str, why: str, base_cost: float | None, report: dict,
              variants_dir: Path, digest: str | None) -> dict:
    """A routing-table row served by `serve`: its cost, the evidence compare judged it on, its replay numbers and
    provenance (`row` holds domain, max_context_tokens and considered)."""
    domain = row["domain"]
    chosen = next((c for c in row["considered"] if c["variant"] == serve), None)
    evidence = report["variants"][serve]["domains"][domain] if serve != BASELINE else None
    return {
        "domain": domain, "max_context_tokens": row["max_context_tokens"], "serve": serve,
        "fallback_under_memory_pressure": fallback,
        "reason": why, "cost_bytes": {"serve": chosen["cost_bytes"] if chosen else base_cost, "fp16": base_cost},
        "evidence": None if evidence is None else {
            "verdict": evidence["verdict"], "difference": evidence["paired"]["difference"],
            "ci_low": evidence["paired"]["ci_low"], "ci_high": evidence["paired"]["ci_high"],
            "flip_rate": evidence["paired"]["flip_rate"], "mcnemar_p": evidence["paired"]["mcnemar_p"],
            "kl": evidence["checks"]["kl"], "items": evidence["paired"]["items"]},
        "shadow": chosen.get("shadow") if chosen else None,
        "considered": row["considered"],
        "provenance": {**provenance(serve, variants_dir, report["variants"].get(serve)), "dvc_lock_sha256": digest},
    }


def build_table(report: dict, buckets: list[int], policy_for, variants_dir: Path, digest: str | None,
                classifier: dict[str, dict] | None = None, shadow: dict | None = None, min_requests: int = 20) -> dict:
    """The routing table: one row per domain and context bucket, plus fp16 rows for what was not judged.

    `classifier`: every declared request type's rule (params.ClassifyParams as dicts); the table carries it, so
    the router classifies with exactly the rules the table was built for. `shadow`: results/shadow.json, whose
    agreement a variant needs to serve (the stage always passes it; None judges on compare.json alone)."""
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
                                   "reasons": d["reasons"], "shadow": None, "shadow_refused": None})
            judged = sorted((c for c in considered if c["verdict"] == "pass" and c["saving_pct"] is not None),
                            key=lambda c: c["cost_bytes"])
            passing = [c for c in judged if listens(c, shadow, domain, tokens, policy, min_requests)]
            refused = "; ".join(f"{c['variant']}: {c['shadow_refused']}" for c in judged if c["shadow_refused"])
            worth = [c for c in passing if c["saving_pct"] >= policy.min_memory_saving_pct]
            for c in considered:  # what the fleet plan may serve the row with (pipelines/routing/fleet.py)
                c["passing"], c["worth"] = c in passing, c in worth
            serve = worth[0]["variant"] if worth else BASELINE
            chosen = next((c for c in considered if c["variant"] == serve), None)
            if serve == BASELINE:
                why = ("no variant passed" if not judged else
                       "the shadow replay refused every passing variant" if not passing else
                       f"passing variants save less than {policy.min_memory_saving_pct} % at {tokens} tokens")
            else:
                why = f"cheapest passing variant, saves {chosen['saving_pct']:.1f} % against fp16 at {tokens} tokens"
            if refused:
                why += f" (shadow replay refused {refused})"
            unpriced = [c["variant"] for c in considered if c["verdict"] == "pass" and c["saving_pct"] is None]
            if unpriced:  # a candidate judged from its sample log: no memory measured here to price it by
                why += f" ({', '.join(unpriced)} passed but cannot serve: its memory was not measured here)"
            rows.append(serve_row({"domain": domain, "max_context_tokens": tokens, "considered": considered},
                                  serve, passing[0]["variant"] if passing else BASELINE, why, base_cost, report,
                                  variants_dir, digest))
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


def apply_fleet(table: dict, plan: dict, assignment: dict, report: dict, variants_dir: Path) -> dict:
    """The table served by the fleet plan (pipelines/routing/fleet.py): each row by its variant in the deployed set,
    its fallback under memory pressure the cheapest passing variant deployed; what each row would take alone is kept
    in `row_by_row`, and a row whose variant serves no neighbouring bucket of its type says what that variant earns."""
    deployed, digest = plan["deployed"], table.get("dvc_lock_sha256")
    fp16_bytes = plan["alternatives"][0]["fleet_bytes"]
    serving = {(r["domain"], r["max_context_tokens"]): assignment.get((r["domain"], r["max_context_tokens"]), BASELINE)
               for r in table["rows"]}  # a row the plan did not price stays on fp16
    cap = plan.get("max_deployments")
    why_not = ("no plan could be priced (fp16's memory was not measured)" if fp16_bytes is None else
               f"route.max_deployments ({cap}) leaves no room for it" if cap is not None and len(deployed) >= cap else
               "deploying it would cost the fleet more than it saves")
    rows = []
    for row in table["rows"]:
        domain, tokens, alone = row["domain"], row["max_context_tokens"], row["serve"]
        serve = serving[(domain, tokens)]
        passing = sorted((c for c in row["considered"] if c.get("passing") and c["variant"] in deployed),
                         key=lambda c: (c["cost_bytes"], c["variant"]))
        why = row["reason"]
        if serve != alone:
            chosen = next((c for c in row["considered"] if c["variant"] == serve), None)
            own = next(c for c in row["considered"] if c["variant"] == alone) if alone != BASELINE else None
            why = (f"fleet plan: {serve}" + (f", saves {chosen['saving_pct']:.1f} % against fp16 at {tokens} tokens"
                                            if chosen else "")
                   + "; alone this row would take " + (f"{alone} (saves {own['saving_pct']:.1f} %)" if own else alone)
                   + (f", which the fleet does not deploy: {why_not}" if alone not in deployed else
                      f"; in the fleet {serve} costs less per request (its share of a replica, docs/route.md)"))
        i = table["buckets"].index(tokens) if tokens in table["buckets"] else None
        neighbours = [serving.get((domain, table["buckets"][j])) for j in (i - 1, i + 1)
                      if i is not None and 0 <= j < len(table["buckets"])] if i is not None else []
        earned = plan["earns_bytes"].get(serve)
        if serve != BASELINE and neighbours and serve not in neighbours and earned is not None and fp16_bytes:
            rows_of = sum(v == serve for v in serving.values())
            why += (f"; {serve} serves no neighbouring bucket of {domain}: the fleet deploys it for {rows_of} rows, "
                    f"which earn it {earned:,.0f} bytes in all ({100 * earned / fp16_bytes:.2f} % of fp16 alone)")
        new = serve_row(row, serve, passing[0]["variant"] if passing else BASELINE, why, row["cost_bytes"]["fp16"],
                        report, variants_dir, digest) if row["considered"] or serve != BASELINE else dict(row)
        new["row_by_row"] = alone
        rows.append(new)
    return {**table, "rows": rows, "fleet": plan}


def read_shadow(path: Path) -> dict:
    """results/shadow.json; without it route cannot decide, so a missing or broken file stops the stage."""
    from pipelines.core.errors import QuantgateError

    try:
        shadow = read_json(path)
    except QuantgateError as err:
        raise QuantgateError(f"{err}: route cannot decide without the shadow replay (run `quantgate shadow`)") from None
    if not isinstance(shadow, dict) or not isinstance(shadow.get("models"), dict):
        raise QuantgateError(f"{path}: key 'models': missing or not a mapping, not a shadow report "
                             "(docs/shadow.md); route cannot decide without it")
    return shadow


def write_rollout(table: dict, policy_for, plan_path: Path, kserve_dir: Path) -> dict:
    """results/rollout.yaml and results/kserve/<type>.yaml (the folder replaced whole: no stale manifest stays)."""
    import yaml

    from pipelines.core.io import atomic_dir, atomic_write_text, write_json, write_yaml
    from pipelines.routing.rollout import build_plan

    plan, manifests = build_plan(table, policy_for, kserve_dir.as_posix())
    with atomic_dir(kserve_dir) as tmp:
        for domain, docs in manifests.items():
            atomic_write_text(tmp / f"{domain}.yaml", yaml.safe_dump_all(docs, sort_keys=False, allow_unicode=True))
        # always one file: git keeps no empty folder, and a DVC output missing from a fresh clone is a change
        write_json(tmp / "index.json", {"manifests": sorted(f"{d}.yaml" for d in manifests),
                                        "note": "one KServe InferenceService per routed request type "
                                                "(results/rollout.yaml says when to apply each)"})
    write_yaml(plan_path, plan)
    return plan


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} %"


def main() -> int:
    """Stage `route`: build the routing table from compare.json and shadow.json (`quantgate route lookup` serves
    it: routing/router.py), and the rollout plan for what it routes."""
    import logging

    from pipelines.core.io import write_json, write_yaml
    from pipelines.core.lineage import lock_digest
    from pipelines.core.params import load_params
    from pipelines.core.paths import (COMPARE_REPORT, COVERAGE_DIR, FLEET_PLOT, KSERVE_DIR, ROLLOUT_PLAN,
                                      ROUTER_CONFIG, ROUTING_TABLE, SHADOW_REPORT, VARIANTS_DIR)
    from pipelines.routing.fleet import plan_fleet
    from pipelines.routing.plots import fleet_plot
    from pipelines.routing.semantic_router import write_router_config

    log = logging.getLogger(__name__)
    params = load_params()
    report = read_json(COMPARE_REPORT)
    shadow = read_shadow(SHADOW_REPORT)
    min_requests = getattr(getattr(params, "shadow", None), "min_requests", 20)
    table = build_table(report, params.route.context_buckets, params.compare.policy_for, VARIANTS_DIR,
                        lock_digest(), {name: rule.model_dump() for name, rule in params.coverage.classify.items()},
                        shadow, min_requests)
    coverage = read_json(COVERAGE_DIR / "coverage.json") if (COVERAGE_DIR / "coverage.json").is_file() else None
    plan, assignment = plan_fleet(table, report, coverage, shadow, params.route, params.memory.noise_floor_bytes)
    table = apply_fleet(table, plan, assignment, report, VARIANTS_DIR)
    write_json(ROUTING_TABLE, table)
    write_yaml(ROUTING_TABLE.with_suffix(".yaml"), table)
    write_router_config(table, ROUTER_CONFIG)
    fleet_plot(plan, FLEET_PLOT)
    log.info("route: fleet plan %s (%s of the fleet's memory saved against fp16 alone; %s row by row)",
             " + ".join(plan["deployed"]), _pct(plan["alternatives"][3]["saving_pct"]),
             _pct(plan["alternatives"][1]["saving_pct"]))
    for note in plan["notes"]:
        log.warning("route: fleet plan: %s", note)
    write_rollout(table, params.compare.policy_for, ROLLOUT_PLAN, KSERVE_DIR)
    log.info("route: rollout plan %s, KServe manifests in %s", ROLLOUT_PLAN, KSERVE_DIR)
    for row in table["rows"]:
        log.info("route %-12s <= %6d tokens: serve %-8s fallback %-8s (%s)", row["domain"], row["max_context_tokens"],
                 row["serve"], row["fallback_under_memory_pressure"], row["reason"])
    log.info("route: %s and %s", ROUTING_TABLE, ROUTING_TABLE.with_suffix(".yaml"))
    return 0
