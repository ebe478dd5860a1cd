"""The fleet plan (pipelines/routing/fleet.py), its vLLM Semantic Router export and the canaries that follow it."""

from __future__ import annotations

import pytest
import yaml

from pipelines import route
from pipelines.core.params_sections import CompareParams, FleetParams, RouteParams
from pipelines.routing import fleet as F
from pipelines.routing.rollout import build_plan
from pipelines.routing.router import Router
from pipelines.routing.semantic_router import guard, router_config, write_router_config
from pipelines.judging import comparison
from tests.handmade import plans
from tests.test_route import BUCKETS, SHIPPED_RULES, results  # noqa: F401 - the fixture: int8 passes both, awq4 code

KV = 512  # bytes per token of context, every model
FLEET = FleetParams(requests_in_flight=64, requests_per_replica=16, kv_pool_tokens=1024, standby_replicas=1.0)
WEIGHTS = {"fp16": 2_000_000, "a": 1_000_000, "b": 300_000}


def memory(weights: dict[str, int]) -> dict[str, dict]:
    return {n: {"footprint_bytes": w, "theoretical_kv_bytes_per_token": KV, "fitted_bytes_per_token": KV + 7}
            for n, w in weights.items()}


def rows(eligible: dict[tuple[str, int], list[str]]) -> list[dict]:
    """Routing-table rows: `considered` marks each eligible variant `worth` (and passing); alone = cheapest."""
    out = []
    for (domain, tokens), names in eligible.items():
        considered = [{"variant": v, "worth": True, "passing": True, "cost_bytes": WEIGHTS[v]} for v in names]
        alone = min(names, key=WEIGHTS.get) if names else "fp16"
        out.append({"domain": domain, "max_context_tokens": tokens, "serve": alone, "considered": considered})
    return out


def replica(name: str) -> float:
    return WEIGHTS[name] + FLEET.kv_pool_tokens * KV


def test_replica_and_request_bytes_follow_the_declared_fleet():
    """A replica is its weights plus the KV pool; a request holds a batch slot or its context's part of the pool."""
    assert F.replica_bytes(memory(WEIGHTS)["a"], FLEET) == 1_000_000 + 1024 * 512
    assert F.request_bytes(16.0, 32, FLEET) == 1.0        # 16 slots, 1024 / 32 = 32 fit in the pool: the slots bind
    assert F.request_bytes(16.0, 256, FLEET) == 4.0       # 1024 / 256 = 4 requests fill the pool: the pool binds
    assert F.replica_bytes({"footprint_bytes": 1}, FLEET) is None  # no KV per token measured: not priced
    assert F.kv_per_token({"fitted_bytes_per_token": 500.0}) == 500.0  # the fit only where there is no theory


def test_a_variant_that_serves_little_traffic_is_not_deployed():
    """Row by row, b (cheapest) takes its one small row and a the rest: three deployments. The fleet plan serves the
    small row with a too, and pays one deployment less; the numbers are the formula's."""
    eligible = {("chat", 64): ["a"], ("code", 64): ["a", "b"]}
    shares = {("chat", 64): 0.97, ("code", 64): 0.03}
    fleet = F.Fleet(rows(eligible), memory(WEIGHTS), shares, FLEET, "fp16")
    best = fleet.best()
    assert best["deployed"] == ["fp16", "a"] and best["assignment"] == {("chat", 64): "a", ("code", 64): "a"}
    expected = 64 * (0.97 + 0.03) * replica("a") / 16 + replica("fp16") + replica("a")
    assert best["bytes"] == pytest.approx(expected)
    alone = fleet.row_by_row({("chat", 64): "a", ("code", 64): "b"})
    assert alone["deployed"] == ["fp16", "a", "b"] and alone["bytes"] > best["bytes"]
    assert fleet.earns(best)["a"] == pytest.approx(fleet.plan(())["bytes"] - best["bytes"])


def test_a_variant_with_enough_traffic_earns_its_deployment():
    """The same two rows with b's row holding 60 % of the traffic: b saves more than its standby replica costs."""
    eligible = {("chat", 64): ["a"], ("code", 64): ["a", "b"]}
    fleet = F.Fleet(rows(eligible), memory(WEIGHTS), {("chat", 64): 0.4, ("code", 64): 0.6}, FLEET, "fp16")
    best = fleet.best()
    assert best["deployed"] == ["fp16", "a", "b"] and best["assignment"][("code", 64)] == "b"
    assert all(e > 0 for e in fleet.earns(best).values())


def test_max_deployments_caps_the_set_and_ineligible_rows_stay_on_fp16():
    eligible = {("chat", 64): ["a"], ("code", 64): ["a", "b"], ("math", 64): []}
    shares = {("chat", 64): 0.4, ("code", 64): 0.5, ("math", 64): 0.1}
    fleet = F.Fleet(rows(eligible), memory(WEIGHTS), shares, FLEET, "fp16")
    assert fleet.best()["assignment"][("math", 64)] == "fp16"
    assert len(fleet.best(max_deployments=2)["deployed"]) == 2
    only = fleet.best(max_deployments=1)
    assert only["deployed"] == ["fp16"] and set(only["assignment"].values()) == {"fp16"}


def test_noise_sized_differences_never_decide_and_the_plan_holds_under_noise():
    """a and b may each serve every row; their weights differ by 1,000 B, less than the memory stage's noise floor.
    Without the margin whichever is cheaper in a draw wins, and noise flips the whole fleet between them; with it,
    the plan closest to the rows' own choices (a, cheapest as measured) holds whatever the noise does."""
    weights = {"fp16": 2_000_000, "a": 1_000_000, "b": 1_001_000}
    eligible = {("chat", 64): ["a", "b"], ("code", 64): ["a", "b"], ("math", 64): ["a", "b"]}
    table_rows = rows(eligible)
    for r in table_rows:
        r["serve"] = "a"
    shares = {("chat", 64): 0.45, ("code", 64): 0.45, ("math", 64): 0.10}
    noisy = F.Fleet(table_rows, memory(weights), shares, FLEET, "fp16", noise_bytes=8192)
    naive = F.Fleet(table_rows, memory(weights), shares, FLEET, "fp16", noise_bytes=0)
    chosen = noisy.best()
    assert chosen["deployed"] == ["fp16", "a"] and noisy.margin() == 2 * 8192 * (64 / 16 + 1)
    held = F.stability(noisy, memory(weights), 8192, chosen, None, draws=100)
    flipped = F.stability(naive, memory(weights), 8192, naive.best(), None, draws=100)
    assert held["max_changed_rows"] == 0
    assert flipped["max_changed_rows"] == 3 and flipped["share_of_draws_with_a_change"] > 0.2  # what the margin is for
    assert noisy.best() == chosen  # the same inputs, the same plan


def test_row_shares_come_from_coverage_split_by_the_replay_buckets():
    table_rows = rows({("math", 64): ["a"], ("math", 256): ["a"], ("unknown", 64): [], ("unknown", 256): []})
    coverage = {"domains": {"math": {"production_share": 0.8}}, "unknown": {"production_share": 0.2}}
    shadow = {"models": {"fp16": {"agreement": {"math": {"64": {"requests": 30}, "256": {"requests": 10}}}}}}
    shares, notes = F.row_shares(table_rows, coverage, shadow, "fp16")
    assert shares[("math", 64)] == pytest.approx(0.6) and shares[("math", 256)] == pytest.approx(0.2)
    assert shares[("unknown", 64)] == pytest.approx(0.1)  # no replay counts for it: split evenly, and said
    assert any("unknown" in n and "evenly" in n for n in notes)


def fleet_table(root, max_deployments=None):
    """The test_route fixture's table (int8 passes math and code, awq4 code only) under a fleet plan."""
    params = CompareParams()
    report = comparison.compare_all(["fp16", "int8", "awq4", "gptq3"], [], plans(root), params, root / "results",
                                    root / "models/variants")
    table = route.build_table(report, BUCKETS, params.policy_for, root / "models/variants", "d" * 64, SHIPPED_RULES)
    coverage = {"domains": {"math": {"production_share": 0.5}, "code": {"production_share": 0.5}}}
    plan, assignment = F.plan_fleet(table, report, coverage, None,
                                    RouteParams(context_buckets=BUCKETS, max_deployments=max_deployments), 8192)
    return route.apply_fleet(table, plan, assignment, report, root / "models/variants")


def test_route_lookup_answers_from_the_fleet_plan(results):  # noqa: F811
    """Row by row, code takes awq4 and math int8: two variants. int8 passes both, so the plan serves both with it;
    `route lookup` (Router) answers from the plan, and the row keeps what it would take alone."""
    table = fleet_table(results)
    assert table["fleet"]["deployed"] == ["fp16", "int8"]
    code = next(r for r in table["rows"] if r["domain"] == "code" and r["max_context_tokens"] == 64)
    assert (code["serve"], code["row_by_row"], code["fallback_under_memory_pressure"]) == ("int8", "awq4", "int8")
    assert "which the fleet does not deploy" in code["reason"]
    assert Router(table).lookup("code", 40)["serve"] == "int8"
    names = [a["plan"] for a in table["fleet"]["alternatives"]]
    assert names == ["fp16 only", "row by row", "best single variant", "fleet plan"]
    saving = {a["plan"]: a["saving_pct"] for a in table["fleet"]["alternatives"]}
    assert saving["fleet plan"] >= max(saving["row by row"], saving["best single variant"]) and saving["fp16 only"] == 0
    capped = fleet_table(results, max_deployments=1)
    assert {r["serve"] for r in capped["rows"]} == {"fp16"}
    assert {r["fallback_under_memory_pressure"] for r in capped["rows"]} == {"fp16"}  # only what is deployed


def test_one_canary_per_deployed_variant_in_the_plans_order(results):  # noqa: F811
    table = fleet_table(results)
    plan, manifests = build_plan(table, CompareParams().policy_for)
    (canary,) = plan["canaries"]
    assert canary["order"] == 1 and canary["variant"] == "int8" and canary["takes"] == {"math": [64, 256],
                                                                                         "code": [64, 256]}
    assert canary["kserve"] == ["results/kserve/math.yaml", "results/kserve/code.yaml"] and canary["waits_for"] == {}
    assert canary["earns_bytes"] == table["fleet"]["earns_bytes"]["int8"] > 0


def test_guard_keeps_only_what_keyword_signals_express():
    patterns = {"symbol": "[+]", "stamp": r"\d{4}", "ahead": "a(?=b)"}
    node, left = guard("symbol >= 1 and stamp == 0", patterns)
    assert node == {"type": "keyword", "name": "symbol"} and left == ["stamp == 0"]
    node, left = guard("symbol + stamp >= 2 or symbol >= 1", patterns)
    assert node is None and left == ["symbol + stamp >= 2"]  # an `or` with a part left out is left out whole
    node, left = guard("ahead >= 1 and code_lines >= 2", patterns)
    assert node is None and left == ["ahead >= 1", "code_lines >= 2"]  # a lookahead has no RE2 spelling


def test_the_router_config_loads_with_the_routers_own_tooling_and_routes_only_what_the_plan_routes(results, tmp_path):  # noqa: F811
    """vllm-sr 0.4's `vllm-sr config validate` (its validate_command) accepts the export; every decision that
    reaches a quantized variant requires quantgate's type and bucket metadata and names exactly the plan's buckets;
    and the validator is no rubber stamp: a decision naming an undeclared signal is refused."""
    from cli.commands.validate import validate_command

    table = fleet_table(results)
    path = write_router_config(table, tmp_path / "vllm-sr.yaml")
    text = path.read_text("utf-8")
    assert text.startswith("# vLLM Semantic Router config") and "Not expressed by the router's signals" in text
    validate_command(str(path))  # exits 1 on an invalid config
    config, _ = router_config(table)
    routed = {(r["domain"], r["serve"]): sorted(r["max_context_tokens"] for r in table["rows"]
                                                if r["domain"] == d and r["serve"] == v)
              for r in table["rows"] for d, v in [(r["domain"], r["serve"])] if v != "fp16"}
    decisions = {d["name"]: d for d in config["routing"]["decisions"]}
    meta = {m["name"]: m for m in config["routing"]["signals"]["metadata"]}
    assert set(decisions) == {f"{d}-{v}" for d, v in routed} | {"fp16-default"}
    for (domain, variant), buckets in routed.items():
        first, second, *_ = decisions[f"{domain}-{variant}"]["rules"]["conditions"]
        assert meta[first["name"]]["predicate"] == {"equals": domain}
        assert meta[second["name"]]["predicate"] == {"in": [str(b) for b in buckets]}
    assert decisions["fp16-default"]["modelRefs"] == [{"model": "fp16", "use_reasoning": False}]
    broken = yaml.safe_load(text)
    broken["routing"]["decisions"][0]["rules"]["conditions"][0]["name"] = "no-such-signal"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken), "utf-8")
    with pytest.raises(SystemExit) as refused:
        validate_command(str(tmp_path / "broken.yaml"))
    assert refused.value.code == 1
