"""Route listens to the shadow replay (a hand-made results/shadow.json) and writes the rollout plan."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines import route
from pipelines.core.errors import QuantgateError
from pipelines.core.io import write_json
from pipelines.core.params_requests import DEFAULT_POLICY, PolicyParams
from pipelines.core.params_sections import CompareParams, CoverageParams
from pipelines.judging import comparison
from pipelines.routing import rollout
from tests.handmade import PARAMS_YAML, correctness, memory_row, plans, write_eval_items, write_memory, write_model

N = 400
BUCKETS = [64, 256]
RULES = {name: rule.model_dump() for name, rule in CoverageParams().classify.items()}


def agreement(share: float, requests: int = 57, outcome: float | None = None) -> dict:
    """One bucket's numbers as results/shadow.json holds them (docs/shadow.md)."""
    return {"requests": requests, "exact": {"share": share, "low": max(0.0, share - 0.1), "high": min(1.0, share + 0.1)},
            "first_difference": {"median": 3.0, "mean": 4.0},
            "similarity": {"mean": min(1.0, share + 0.2), "low": share, "high": 1.0},
            "outcome": None if outcome is None else {"kind": "final_number", "requests": requests, "share": outcome,
                                                    "low": outcome - 0.1, "high": min(1.0, outcome + 0.1),
                                                    "fp16_correct": None, "variant_correct": None}}


def shadow_report(models: dict[str, dict], failed: dict[str, str] | None = None) -> dict:
    """models: name -> type -> {bucket key: numbers}; failed: name -> error."""
    entries = {"fp16": {"status": "ok", "error": None}}
    entries |= {name: {"status": "ok", "error": None, "agreement": per_type} for name, per_type in models.items()}
    entries |= {name: {"status": "failed", "error": error} for name, error in (failed or {}).items()}
    return {"baseline": "fp16", "traffic": {"path": "t.jsonl", "sha256": "0" * 64, "requests": 120, "replayed": 120,
                                            "skipped": {"too_long": 0}, "by_type": {"math": 60, "code": 60}},
            "settings": {"max_new_tokens": 16, "max_batch": 8, "time_compression": None, "store": "masked"},
            "models": entries}


AGREE = {"math": {"all": agreement(0.9, outcome=0.95)}, "code": {"all": agreement(0.9)}}


@pytest.fixture()
def report(tmp_path):
    """int8 and awq4 (cheaper) pass math and code against fp16; gptq3 (cheapest) fails both."""
    write_model(tmp_path, "fp16", {d: correctness(N, 300) for d in ("math", "code")})
    write_model(tmp_path, "int8", {d: correctness(N, 300, lose=1) for d in ("math", "code")})
    write_model(tmp_path, "awq4", {d: correctness(N, 300, lose=2) for d in ("math", "code")})
    write_model(tmp_path, "gptq3", {d: correctness(N, 300, lose=90) for d in ("math", "code")})
    write_memory(tmp_path, {n: memory_row(n) for n in ("fp16", "int8", "awq4", "gptq3")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    return comparison.compare_all(["fp16", "int8", "awq4", "gptq3"], [], plans(tmp_path), CompareParams(),
                                  tmp_path / "results", tmp_path / "models/variants")


def build(report, tmp_path, shadow, params=CompareParams(), min_requests=20):
    return route.build_table(report, BUCKETS, params.policy_for, tmp_path / "models/variants", "d" * 64, RULES,
                             shadow, min_requests)


def row(table, domain, tokens):
    return next(r for r in table["rows"] if r["domain"] == domain and r["max_context_tokens"] == tokens)


def test_a_variant_that_agrees_serves_and_the_row_carries_its_numbers(report, tmp_path):
    table = build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": AGREE}))
    r = row(table, "math", 64)
    assert r["serve"] == "awq4" and "shadow" not in r["reason"]
    assert r["shadow"] == {"variant": "awq4", "bucket": "all", "requests": 57, "exact": {"share": 0.9, "low": 0.8,
                                                                                         "high": 1.0},
                           "similarity_mean": 1.0, "outcome_share": 0.95, "bucket_requests": 0}


def test_agreement_is_judged_on_its_low_end_and_never_against_the_buckets_own_evidence(report, tmp_path):
    """0.58 [0.48, 0.68] clears 0.5 as a point but not on evidence: refused. A bucket whose own interval lies below
    min_agreement is refused even when the type's pooled numbers would pass."""
    near = {**AGREE, "math": {"all": agreement(0.58)}}
    table = build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": near}))
    assert row(table, "math", 64)["serve"] == "int8"
    assert "its low end is below 0.50" in row(table, "math", 64)["reason"]
    own_low = {**AGREE, "math": {"all": agreement(0.9), "64": {**agreement(0.2), "requests": 6}}}
    table = build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": own_low}))
    r = row(table, "math", 64)
    assert r["serve"] == "int8" and "in the 64-token bucket 0.20 [0.10, 0.30] on 6 requests is below 0.50" in r["reason"]
    assert row(table, "math", BUCKETS[-1])["serve"] == "awq4"  # other buckets: the pooled evidence, none of their own
    nan = {**AGREE, "math": {"all": {**agreement(0.9), "exact": {"share": float("nan"), "low": 0.8, "high": 1.0}}}}
    table = build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": nan}))
    assert row(table, "math", 64)["serve"] == "int8"  # a NaN share serves nothing


def test_low_agreement_falls_back_to_the_next_passing_variant_then_fp16(report, tmp_path):
    low_math = {**AGREE, "math": {"all": agreement(0.3)}}
    table = build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": low_math}))
    for tokens in BUCKETS:
        r = row(table, "math", tokens)
        assert (r["serve"], r["fallback_under_memory_pressure"]) == ("int8", "int8")
        assert ("awq4: shadow agreement 0.30 [0.20, 0.40] on 57 replayed math requests: its low end is below 0.50"
                in r["reason"])
        awq4 = next(c for c in r["considered"] if c["variant"] == "awq4")
        assert awq4["verdict"] == "pass" and awq4["shadow_refused"].startswith("shadow agreement 0.30 [0.20, 0.40]")
        assert r["shadow"]["variant"] == "int8" and r["shadow"]["exact"]["share"] == 0.9
        assert row(table, "code", tokens)["serve"] == "awq4"  # code's agreement is its own
    table = build(report, tmp_path, shadow_report({"int8": low_math, "awq4": low_math}))
    r = row(table, "math", 64)
    assert (r["serve"], r["fallback_under_memory_pressure"], r["shadow"]) == ("fp16", "fp16", None)
    assert r["reason"] == ("the shadow replay refused every passing variant (shadow replay refused awq4: shadow "
                           "agreement 0.30 [0.20, 0.40] on 57 replayed math requests: its low end is below 0.50; int8: "
                           "shadow agreement 0.30 [0.20, 0.40] on 57 replayed math requests: its low end is below 0.50)")
    # a type's own floor, merged over the default like every other limit
    strict = CompareParams(policy={"default": DEFAULT_POLICY, "code": PolicyParams(min_agreement=0.95)})
    assert row(build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": AGREE}), strict), "code", 64)["serve"] == "fp16"


def test_too_few_replayed_requests_do_not_route_to_a_variant(report, tmp_path):
    few = {"math": {"64": agreement(1.0, requests=30), "256": agreement(1.0, requests=3), "all": agreement(1.0, 33)},
           "code": {"all": agreement(1.0, requests=5)}}
    table = build(report, tmp_path, shadow_report({"int8": few, "awq4": few}))
    assert row(table, "math", 64)["shadow"]["bucket"] == "64"  # the bucket's own numbers where it has enough
    assert row(table, "math", 256)["shadow"]["bucket"] == "all"  # else the type's
    r = row(table, "code", 64)
    assert r["serve"] == "fp16"
    assert "too few replayed code requests for the shadow check (5 < shadow.min_requests 20)" in r["reason"]
    assert row(build(report, tmp_path, shadow_report({"int8": few, "awq4": few}), min_requests=40), "math", 64)[
        "serve"] == "fp16"
    assert row(build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": {"math": AGREE["math"]}})), "code", 64)[
        "serve"] == "int8"  # awq4 replayed no code request at all


def test_a_failed_or_missing_replay_does_not_serve(report, tmp_path):
    table = build(report, tmp_path, shadow_report({"int8": AGREE}, failed={"awq4": "TimeoutError: 600 s"}))
    for domain in ("math", "code"):
        r = row(table, domain, 64)
        assert r["serve"] == "int8" and "awq4: shadow replay failed (TimeoutError: 600 s)" in r["reason"]
    r = row(build(report, tmp_path, shadow_report({})), "math", 64)
    assert r["serve"] == "fp16" and "not in the shadow replay" in r["reason"]


def test_the_rollout_plan_and_its_kserve_manifests(report, tmp_path):
    table = build(report, tmp_path, shadow_report({"int8": AGREE, "awq4": {"code": AGREE["code"]}}))
    plan = route.write_rollout(table, CompareParams().policy_for, tmp_path / "rollout.yaml", tmp_path / "kserve")
    assert yaml.safe_load((tmp_path / "rollout.yaml").read_text()) == json.loads(json.dumps(plan))
    assert [s["traffic_percent"] for s in plan["schedule"]] == [1, 5, 25, 100]
    math = plan["types"]["math"]
    assert math["serve"] == {"64": "int8", "256": "int8"}
    (rollout,) = math["canary"]
    assert (rollout["variant"], rollout["buckets"], rollout["kserve"]) == ("int8", [64, 256], f"{tmp_path}/kserve/math.yaml")
    assert rollout["inference_service"] == "quantgate-math" and math["later_canary"] == [] and "note" not in math
    assert [s["traffic_percent"] for s in rollout["schedule"]] == [1, 5, 25, 100]
    assert all(s["hold_minutes"] > 0 for s in rollout["schedule"][:-1])
    limits = rollout["stop_if"]
    assert (limits["min_exact_agreement"], limits["max_p99_latency_ratio"], limits["max_growth_excess_pct"]) == (0.5, 1.2, 1.0)
    assert rollout["evidence"]["64"]["exact"]["share"] == 0.9
    for name in ("chat", "unknown", "ambiguous"):  # served by fp16: nothing to roll out, and the plan says so
        assert plan["types"][name]["canary"] is None and "nothing to roll out" in plan["types"][name]["note"]
    assert sorted(p.name for p in (tmp_path / "kserve").iterdir()) == ["code.yaml", "index.json", "math.yaml"]
    assert json.loads((tmp_path / "kserve/index.json").read_text())["manifests"] == ["code.yaml", "math.yaml"]
    for domain, variant in (("math", "int8"), ("code", "awq4")):  # one manifest per type, for its fp16 service
        (service,) = yaml.safe_load_all((tmp_path / f"kserve/{domain}.yaml").read_text())
        assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
        assert service["metadata"]["name"] == f"quantgate-{domain}"  # the running service: KServe keeps fp16's revision
        assert service["metadata"]["annotations"]["quantgate/variant"] == variant
        assert service["spec"]["predictor"]["canaryTrafficPercent"] == 1
        assert service["spec"]["predictor"]["model"]["storageUri"].startswith("FILL-IN://")
        assert f"models/variants/{variant}" in service["spec"]["predictor"]["model"]["storageUri"]
    # a second run whose table routes nothing leaves no stale manifest behind, and the folder is still there (with its
    # index): git keeps no empty folder, and a DVC output missing on a fresh clone would be a change to the gate
    table = build(report, tmp_path, shadow_report({}))
    route.write_rollout(table, CompareParams().policy_for, tmp_path / "rollout.yaml", tmp_path / "kserve")
    assert [p.name for p in (tmp_path / "kserve").iterdir()] == ["index.json"]
    assert json.loads((tmp_path / "kserve/index.json").read_text())["manifests"] == []


def split_table(serve: dict[str, dict[int, str]]) -> dict:
    """A routing table as route writes it, reduced to what the plan reads: domain -> bucket -> variant."""
    return {"baseline": "fp16", "dvc_lock_sha256": "d" * 64,
            "rows": [{"domain": domain, "max_context_tokens": tokens, "serve": variant,
                      "shadow": None if variant == "fp16" else {"variant": variant, "bucket": str(tokens)}}
                     for domain, per_bucket in serve.items() for tokens, variant in per_bucket.items()]}


def test_a_type_served_by_two_variants_gets_one_manifest_and_a_later_canary():
    """KServe canaries one model per InferenceService and cannot route by context length: the variant serving the
    most buckets (ties: the smaller bucket) gets the type's manifest; the others are named as a later canary."""
    table = split_table({"math": {64: "awq4", 256: "int8", 1024: "int8", 4096: "fp16"},
                         "code": {64: "fp16", 256: "awq4", 1024: "int8"},
                         "chat": {64: "fp16", 256: "fp16"}})
    plan, manifests = rollout.build_plan(table, CompareParams().policy_for, "out/kserve")
    assert sorted(manifests) == ["code", "math"] and all(len(docs) == 1 for docs in manifests.values())
    for domain, now, buckets, later in (("math", "int8", [256, 1024], "awq4"), ("code", "awq4", [256], "int8")):
        entry = plan["types"][domain]
        ((canary,), (waiting,)) = entry["canary"], entry["later_canary"]
        assert (canary["variant"], canary["buckets"], canary["kserve"]) == (now, buckets, f"out/kserve/{domain}.yaml")
        assert (waiting["variant"], waiting["kserve"]) == (later, None)
        assert canary["inference_service"] == waiting["inference_service"] == f"quantgate-{domain}"
        assert [s["traffic_percent"] for s in waiting["schedule"]] == [1, 5, 25, 100] and waiting["stop_if"]
        assert set(waiting["evidence"]) == {str(b) for b in waiting["buckets"]}
        assert "quantgate route" in entry["note"] and "does not route by context length" in entry["note"]
        assert later in entry["note"]
        (service,) = manifests[domain]
        assert service["metadata"]["name"] == f"quantgate-{domain}"
        assert service["metadata"]["annotations"]["quantgate/variant"] == now
        assert service["metadata"]["annotations"]["quantgate/context-buckets"] == ",".join(map(str, buckets))
        assert service["spec"]["predictor"]["canaryTrafficPercent"] == 1
    assert plan["types"]["chat"]["canary"] is None
    assert rollout.service_name("Math_Word") == "quantgate-math-word"  # a DNS-1035 label


def test_the_stage_needs_the_shadow_report(report, tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text(PARAMS_YAML)
    write_json(tmp_path / "results/compare.json", report)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QuantgateError, match=r"results/shadow.json: file not found: route cannot decide"):
        route.main()
    (tmp_path / "results/shadow.json").write_text("{not json")
    with pytest.raises(QuantgateError, match=r"results/shadow.json:1: not valid JSON .*route cannot decide"):
        route.main()
    write_json(tmp_path / "results/shadow.json", {"baseline": "fp16"})
    with pytest.raises(QuantgateError, match=r"results/shadow.json: key 'models'"):
        route.main()
    write_json(tmp_path / "results/shadow.json", shadow_report({"int8": AGREE, "awq4": AGREE}))
    # the production mix the fleet plan weighs rows by: all of it math and code, so awq4 pays for its deployment
    write_json(tmp_path / "results/calibration/coverage.json",
               {"domains": {"math": {"production_share": 0.5}, "code": {"production_share": 0.5}}})
    assert route.main() == 0
    table = json.loads((tmp_path / "results/routing_table.json").read_text())
    assert row(table, "math", 64)["serve"] == "awq4" and table["fleet"]["deployed"] == ["fp16", "awq4"]
    assert (tmp_path / "results/vllm-sr.yaml").is_file() and (tmp_path / "results/plots/fleet_saving.png").is_file()
    plan = yaml.safe_load((tmp_path / "results/rollout.yaml").read_text())
    assert plan["types"]["math"]["canary"][0]["kserve"] == "results/kserve/math.yaml"
    assert (tmp_path / "results/kserve/code.yaml").is_file()


@pytest.mark.parametrize("value, ok", [(0.0, True), (1.0, True), (-0.1, False), (1.5, False)])
def test_min_agreement_range(value, ok):
    """[0, 1] (docs/params.md): it is a share of replayed requests."""
    if ok:
        assert PolicyParams(min_agreement=value).min_agreement == value
    else:
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]: a share of replayed requests"):
            PolicyParams(min_agreement=value)
    assert CompareParams().policy_for("math").min_agreement == 0.5
    # a team's policy written before the key existed still loads, and gets the built-in 0.5
    older = CompareParams(policy={"default": PolicyParams(**{**DEFAULT_POLICY.model_dump(), "min_agreement": None})})
    assert older.policy_for("math").min_agreement == 0.5
    with pytest.raises(ValueError, match="policy.default must set every limit; missing max_kl"):
        CompareParams(policy={"default": PolicyParams(**{**DEFAULT_POLICY.model_dump(), "max_kl": None})})
