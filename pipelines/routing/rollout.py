"""The rollout plan for a routing table: per request type, the variant that serves it, the canary schedule that
moves traffic from fp16 to it, the limits that stop the canary, and the shadow replay's numbers as evidence.

The canary is written as KServe InferenceServices (serving.kserve.io/v1beta1) because KServe's
`spec.predictor.canaryTrafficPercent` is the standard knob for a gray release. It splits traffic between the
revisions of ONE InferenceService: applying a manifest with a new `storageUri` and `canaryTrafficPercent: N` over
the running service makes a new revision that gets N % and keeps the last rolled-out (fp16) revision for the rest
(KServe's canary rollout; serverless deployment mode only). So each manifest names the service that serves the
type with fp16 today (`SERVICE_PREFIX` + the type), never a new one: a new service's first revision would take
100 % of its own traffic. One service has one model, so a type gets one manifest, for one variant; KServe does not
route by context length, so the context-bucket split stays with `quantgate route` (routing/router.py) in front of
the services. Plain dicts only: route writes them; nothing here loads a model.
"""

from __future__ import annotations

import re

# 1 % -> 5 % -> 25 % -> 100 % of the type's traffic, each step held before the next (the last is the release)
SCHEDULE = ({"traffic_percent": 1, "hold_minutes": 60}, {"traffic_percent": 5, "hold_minutes": 60},
            {"traffic_percent": 25, "hold_minutes": 120}, {"traffic_percent": 100, "hold_minutes": None})
# the canary's p99 latency against the stable fp16's, measured on the same traffic at the same time (relative,
# so the plan does not depend on the replay's volatile timings)
MAX_P99_LATENCY_RATIO = 1.2
STORAGE_URI = "FILL-IN://where models/variants/{variant} is published (s3://, gs://, pvc://, hf://)"
# The names of the InferenceServices that serve each request type with fp16 today are SERVICE_PREFIX + the type
# (quantgate-math, quantgate-code, ...). Change the prefix to match your running services: a manifest whose name
# matches none creates a new service, which takes 100 % of its own traffic and starts no canary.
SERVICE_PREFIX = "quantgate-"
SPLIT_NOTE = ("KServe does not route by context length: the context-bucket split stays with `quantgate route` "
              "(pipelines/routing/router.py) in front of the services; one InferenceService runs one model, so "
              "results/kserve/{domain}.yaml canaries {variant} only; the other variants ({later}) follow as a later canary, once "
              "{variant} is released, with no manifest written now")


def service_name(domain: str) -> str:
    """The type's running fp16 InferenceService: a Kubernetes object name (DNS-1035 label: lowercase letters,
    digits, '-', at most 63 characters)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{SERVICE_PREFIX}{domain}".lower()).strip("-")
    return name[:63].rstrip("-")


def inference_service(domain: str, variant: str, buckets: list[int], kserve_path: str) -> dict:
    """The KServe manifest that starts the canary over the type's running service: the first step's share goes to
    a new revision serving the variant, the rest stays on the last rolled-out (fp16) revision."""
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": service_name(domain), "annotations": {
            "quantgate/request-type": domain, "quantgate/variant": variant, "quantgate/stable": "fp16",
            "quantgate/context-buckets": ",".join(str(b) for b in buckets),
            "quantgate/rollout-plan": "results/rollout.yaml", "quantgate/manifest": kserve_path}},
        "spec": {"predictor": {
            "canaryTrafficPercent": SCHEDULE[0]["traffic_percent"],
            "model": {"modelFormat": {"name": "huggingface"}, "storageUri": STORAGE_URI.format(variant=variant)}}},
    }


def stop_limits(policy) -> dict:
    """What stops (and rolls back) the canary at any step."""
    return {"min_exact_agreement": policy.min_agreement,
            "max_p99_latency_ratio": MAX_P99_LATENCY_RATIO,
            "max_growth_excess_pct": policy.max_growth_excess_pct,
            "measured_on": "mirrored canary traffic, against the stable fp16 serving the same requests at the same time"}


def build_plan(table: dict, policy_for, kserve_dir: str = "results/kserve") -> tuple[dict, dict[str, list[dict]]]:
    """The plan (results/rollout.yaml) and, per routed type, its one InferenceService (results/kserve/<type>.yaml).

    A type served by more than one variant across its buckets: the manifest is for the variant that serves the most
    buckets (ties: the one with the smaller bucket); the plan names the others as `later_canary`."""
    types: dict[str, dict] = {}
    manifests: dict[str, list[dict]] = {}
    by_type: dict[str, list[dict]] = {}
    for row in table["rows"]:
        by_type.setdefault(row["domain"], []).append(row)
    for domain, rows in by_type.items():
        serving = {str(r["max_context_tokens"]): r["serve"] for r in rows}  # str: as JSON and YAML keep it
        variants = list(dict.fromkeys(v for v in serving.values() if v != table["baseline"]))
        if not variants:
            types[domain] = {"serve": serving, "canary": None,
                             "note": f"served by {table['baseline']} at every context bucket: nothing to roll out"}
            continue
        path = f"{kserve_dir}/{domain}.yaml"
        served = {v: sorted(int(t) for t, s in serving.items() if s == v) for v in variants}
        now, *later = sorted(variants, key=lambda v: (-len(served[v]), served[v][0]))

        def rollout(variant: str, kserve: str | None) -> dict:
            return {"variant": variant, "inference_service": service_name(domain), "kserve": kserve,
                    "buckets": served[variant], "schedule": [dict(step) for step in SCHEDULE],
                    "stop_if": stop_limits(policy_for(domain)),
                    "evidence": {str(r["max_context_tokens"]): r.get("shadow") for r in rows if r["serve"] == variant}}

        manifests[domain] = [inference_service(domain, now, served[now], path)]
        types[domain] = {"serve": serving, "canary": [rollout(now, path)],
                         "later_canary": [rollout(v, None) for v in later]}
        if later:
            types[domain]["note"] = SPLIT_NOTE.format(domain=domain, variant=now, later=", ".join(later))
    plan = {"baseline": table["baseline"], "dvc_lock_sha256": table.get("dvc_lock_sha256"),
            **({"canaries": fleet_canaries(table, types, policy_for)} if table.get("fleet") else {}),
            "schedule": [dict(step) for step in SCHEDULE],
            "how": "apply results/kserve/<type>.yaml over the type's running fp16 InferenceService (same name: "
                   f"{SERVICE_PREFIX}<type>, rollout.SERVICE_PREFIX); hold each step, raise canaryTrafficPercent to "
                   "the next; any stop_if limit crossed: set it to 0 (back to fp16)",
            "types": types}
    return plan, manifests


def fleet_canaries(table: dict, types: dict, policy_for) -> list[dict]:
    """One canary per variant the fleet plan deploys, in the plan's order: the variant that earns the fleet the most
    first (pipelines/routing/fleet.py `earns_bytes`; ties by name), but after any variant it waits for. Each takes
    every row the plan serves with it, by the types' manifests that name it; a type whose manifest names another
    variant takes it in that type's later canary, once that variant's canary is done (`waits_for`)."""
    earns = table["fleet"].get("earns_bytes") or {}
    entries = {}
    for variant in table["fleet"]["deployed"][1:]:
        takes = {d: sorted(r["max_context_tokens"] for r in table["rows"] if r["domain"] == d and r["serve"] == variant)
                 for d in types}
        takes = {d: b for d, b in takes.items() if b}
        now = [d for d in takes if (types[d].get("canary") or [{}])[0].get("variant") == variant]
        entries[variant] = {"variant": variant, "earns_bytes": earns.get(variant), "takes": takes,
                            "kserve": [types[d]["canary"][0]["kserve"] for d in now],
                            "waits_for": {d: types[d]["canary"][0]["variant"] for d in takes if d not in now},
                            "schedule": [dict(step) for step in SCHEDULE],
                            "stop_if": {d: stop_limits(policy_for(d)) for d in takes}}
    canaries: list[dict] = []
    while entries:  # the most earning first, but never before a variant whose canary it waits for
        ready = [v for v, e in entries.items()
                 if not set(e["waits_for"].values()) & set(entries)]
        variant = min(ready or entries, key=lambda v: (-(earns.get(v) or 0.0), v))
        canaries.append({"order": len(canaries) + 1, **entries.pop(variant)})
    return canaries

