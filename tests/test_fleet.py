"""The fleet plan (pipelines/routing/fleet.py), its vLLM Semantic Router export and the canaries that follow it."""

from __future__ import annotations

import pytest
import yaml

from pipelines import route
from pipelines.core.params_sections import CompareParams, FleetParams, RouteParams
from pipelines.routing import fleet as F
from pipelines.routing import plots as fleet_plots
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
    # the margin: 64 / 16 replicas of traffic and a standby each for fp16, a and b, every one off by the noise, twice
    assert chosen["deployed"] == ["fp16", "a"] and noisy.margin() == 2 * 8192 * (64 / 16 + 3)
    held = F.stability(noisy, memory(weights), 8192, chosen, None, draws=100)
    flipped = F.stability(naive, memory(weights), 8192, naive.best(), None, draws=100)
    assert held["max_changed_rows"] == 0
    assert flipped["max_changed_rows"] == 3 and flipped["share_of_draws_with_a_change"] > 0.2  # what the margin is for
    assert noisy.best() == chosen  # the same inputs, the same plan


def test_row_shares_come_from_coverage_split_by_the_replay_buckets():
    table_rows = rows({("math", 64): ["a"], ("math", 256): ["a"], ("unknown", 64): [], ("unknown", 256): []})
    coverage = {"domains": {"math": {"production_share": 0.8}}, "unknown": {"production_share": 0.2}}
    shadow = {"models": {"awq4": {"status": "failed", "agreement": {"math": {"64": {"requests": 1}}}},
                         "int8": {"status": "ok", "agreement": {"math": {"64": {"requests": 30}, "256": {"requests": 10}}}}}}
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
    # an `or` with a part left out is left out whole, and listed whole
    assert node is None and left == ["symbol + stamp >= 2 or symbol >= 1"]
    node, left = guard("ahead >= 1 and code_lines >= 2", patterns)
    assert node is None and left == ["ahead >= 1", "code_lines >= 2"]  # a lookahead has no RE2 spelling
    for refused in (r"(?x) a b", r"a\Z", r"(?#note)a", "x{2000}"):  # Python syntax RE2 (the router's Go) refuses
        assert guard("p >= 1", {"p": refused}) == (None, ["p >= 1"])
    node, _ = guard("p >= 1", {"p": "\\U0001F600|\\u4e00"})
    assert node == {"type": "keyword", "name": "p"}


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


def test_a_plan_that_cannot_be_priced_stays_on_fp16_and_says_why():
    """fp16's memory missing (its memory stage failed): no fleet bytes, every row on fp16, and a note; a variant whose
    KV per token is unknown is never deployed (it cannot be priced)."""
    table = {"baseline": "fp16", "rows": rows({("chat", 64): ["a"]}), "buckets": [64]}
    report = {"fp16": {"memory": None}, "variants": {"a": {"memory": memory(WEIGHTS)["a"]}}}
    plan, assignment = F.plan_fleet(table, report, None, None, RouteParams(context_buckets=[64], fleet=FLEET), 8192)
    assert plan["deployed"] == ["fp16"] and assignment == {("chat", 64): "fp16"} and plan["fleet_bytes"] is None
    assert any("fp16's memory was not measured" in n for n in plan["notes"])
    unpriced = F.Fleet(rows({("chat", 64): ["a"]}), {**memory(WEIGHTS), "a": {"footprint_bytes": 1}},
                       {("chat", 64): 1.0}, FLEET, "fp16")
    assert unpriced.candidates == [] and unpriced.best()["deployed"] == ["fp16"]


@pytest.mark.parametrize("coverage, key", [
    ({"domains": {"chat": {"share": 0.5}}}, "domains.chat.production_share"),
    ({"domains": {"chat": {"production_share": 1.5}}}, "domains.chat.production_share"),
    ({"domains": {"chat": {"production_share": 0.9}}, "unknown": {"production_share": "a lot"}},
     "unknown.production_share"),
    ({"domains": {"chat": {"production_share": 0.9}, "code": {"production_share": 0.9}}}, "add up to 1.8000")])
def test_a_broken_traffic_mix_is_an_error_naming_the_key(coverage, key):
    from pipelines.core.errors import QuantgateError

    with pytest.raises(QuantgateError, match=f"results/calibration/coverage.json: .*{key}"):
        F.row_shares(rows({("chat", 64): ["a"], ("code", 64): ["a"]}), coverage, None, "fp16")


def test_a_variant_near_the_margin_is_flagged_and_the_reason_names_the_cap(results):  # noqa: F811
    """A deployment that earns less than twice the noise margin gets a note (a re-measurement may drop it); a row
    the cap keeps from its own choice says route.max_deployments did it, not the cost."""
    eligible = {("chat", 64): ["a"], ("code", 64): ["a"]}
    weights = {"fp16": 1_000_000, "a": 975_000}  # 40 replicas of traffic x 25,000 B: 1.0 MB, margin 655,360 B
    table = {"baseline": "fp16", "buckets": [64], "rows": rows(eligible)}
    report = {"fp16": {"memory": memory(weights)["fp16"]}, "variants": {"a": {"memory": memory(weights)["a"]}}}
    fleet = FleetParams(requests_in_flight=640, requests_per_replica=16, kv_pool_tokens=1024, standby_replicas=0.0)
    plan, _ = F.plan_fleet(table, report, {"domains": {"chat": {"production_share": 0.5},
                                                       "code": {"production_share": 0.5}}},
                           None, RouteParams(context_buckets=[64], fleet=fleet), 8192)
    assert plan["deployed"] == ["fp16", "a"] and 0 < plan["headroom_bytes"]["a"] < plan["noise_margin_bytes"]
    assert any(n.startswith("a earns the fleet") and "may drop it" in n for n in plan["notes"])
    capped = fleet_table(results, max_deployments=1)
    code = next(r for r in capped["rows"] if r["domain"] == "code" and r["max_context_tokens"] == 64)
    assert "route.max_deployments (1) leaves no room for it" in code["reason"]


def test_canaries_wait_for_the_variant_whose_manifest_a_type_waits_on():
    """math: int8 at 64 and 128 (its manifest), gptq3 at 256. gptq3 earns more, but math's manifest names int8: int8's
    canary goes first, then gptq3's, which takes math@256 in math's later canary."""
    serve = {("math", 64): "int8", ("math", 128): "int8", ("math", 256): "gptq3", ("code", 64): "gptq3"}
    table = {"baseline": "fp16", "dvc_lock_sha256": "d" * 64,
             "rows": [{"domain": d, "max_context_tokens": b, "serve": v, "shadow": None} for (d, b), v in serve.items()],
             "fleet": {"deployed": ["fp16", "gptq3", "int8"], "earns_bytes": {"gptq3": 9e6, "int8": 1e6}}}
    plan, _ = build_plan(table, CompareParams().policy_for)
    first, second = plan["canaries"]
    assert (first["order"], first["variant"], first["waits_for"]) == (1, "int8", {})
    assert (second["order"], second["variant"], second["waits_for"]) == (2, "gptq3", {"math": "int8"})
    assert second["takes"] == {"math": [256], "code": [64]} and second["kserve"] == ["results/kserve/code.yaml"]


def test_the_report_and_mlflow_show_the_plan_beside_its_alternatives(results):  # noqa: F811
    from pipelines.gate import fleet_lines
    from pipelines.store.layout import fleet_metrics, fleet_rows

    table = fleet_table(results)
    text = "\n".join(fleet_lines(table))
    saving = {a["plan"]: a["saving_pct"] for a in table["fleet"]["alternatives"]}
    for plan in ("fp16 only", "row by row", "best single variant", "fleet plan"):
        assert f"| {plan} |" in text
    assert f"| fleet plan | 2 | fp16 + int8 | {saving['fleet plan']:+.2f} % |" in text
    metrics = fleet_metrics(table)
    assert metrics["fleet/fleet_plan/deployments"] == 2 and metrics["fleet/row_by_row/deployments"] == 3
    assert metrics["fleet/fleet_plan/saving_pct"] == pytest.approx(saving["fleet plan"])
    assert [r["plan"] for r in fleet_rows(table)][:4] == ["fp16 only", "row by row", "best single variant", "fleet plan"]


def decide(config: dict, metadata: dict[str, str], matched_keywords: set[str]) -> str:
    """The model a v0.3 config sends a request to, as the router's priority strategy reads it: the highest-priority
    decision whose rule holds (metadata signals: equals / in; keyword signals: those in `matched_keywords`)."""
    signals = {("metadata", m["name"]): m for m in config["routing"]["signals"].get("metadata", [])}

    def holds(node: dict) -> bool:
        if "type" in node:
            if node["type"] == "keyword":
                return node["name"] in matched_keywords
            p = signals[("metadata", node["name"])]
            value = metadata.get(p["key"])
            return value == p["predicate"]["equals"] if "equals" in p["predicate"] else value in p["predicate"]["in"]
        kids = [holds(c) for c in node.get("conditions") or []]
        return {"AND": all, "OR": any}[node.get("operator", "AND")](kids) if node.get("operator") != "NOT" \
            else not kids[0]

    live = [d for d in config["routing"]["decisions"] if holds(d["rules"])]
    return max(live, key=lambda d: d["priority"])["modelRefs"][0]["model"] if live else \
        config["providers"]["defaults"]["model"]


def routed_table() -> dict:
    """chat and code on awq4 (chat at every bucket, code at 64 and 256: code@128 stays on fp16), math on fp16."""
    serve = {("chat", 64): "awq4", ("chat", 128): "awq4", ("chat", 256): "awq4", ("code", 64): "awq4",
             ("code", 128): "fp16", ("code", 256): "awq4", ("math", 64): "fp16", ("math", 128): "fp16",
             ("math", 256): "fp16"}
    rows_ = [{"domain": d, "max_context_tokens": b, "serve": v} for (d, b), v in serve.items()]
    rows_ += [{"domain": t, "max_context_tokens": b, "serve": "fp16"} for t in ("unknown", "ambiguous")
              for b in (64, 128, 256)]
    return {"baseline": "fp16", "buckets": [64, 128, 256], "dvc_lock_sha256": "ab" * 32, "rows": rows_,
            "classifier": SHIPPED_RULES, "fleet": {"deployed": ["fp16", "awq4"]}}


def test_no_request_quantgate_keeps_on_fp16_reaches_a_quantized_variant(tmp_path):
    """Every combination of type, bucket and table id a gateway could send (unknown, ambiguous, none at all, an
    older table's), with every keyword matching: only rows the plan serves with awq4 reach awq4. The chat guard's
    keyword (the shipped `talk` pattern, \\u escapes rewritten) compiles with RE2 and passes the router's validator."""
    import re2

    from cli.commands.validate import validate_command
    from pipelines.routing.router import metadata

    table = routed_table()
    config, notes = router_config(table)
    keywords = {k["name"]: k["keywords"][0] for k in config["routing"]["signals"]["keywords"]}
    assert set(keywords) == {"chat-talk"} and "\\x{4e00}" in keywords["chat-talk"]
    re2.compile(keywords["chat-talk"])
    assert any(n.startswith("chat: the guard leaves out") for n in notes)
    validate_command(str(write_router_config(table, tmp_path / "vllm-sr.yaml")))
    serve = {(r["domain"], r["max_context_tokens"]): r["serve"] for r in table["rows"]}
    for domain in ("chat", "code", "math", "code_comment", "unknown", "ambiguous", None):
        for bucket in (64, 128, 256, 512, None):
            for digest in (table["dvc_lock_sha256"], "cd" * 32):
                meta = {k: v for k, v in metadata({"domain": domain, "max_context_tokens": bucket}, digest).items()
                        if v not in ("None",)} if domain and bucket else {}
                model = decide(config, meta, set(keywords))
                expected = serve.get((domain, bucket), "fp16") if digest == table["dvc_lock_sha256"] else "fp16"
                assert model == expected, (domain, bucket, digest, model)
    # the guard narrows: a chat request whose text has no mark of conversation stays on fp16
    chat = metadata({"domain": "chat", "max_context_tokens": 64}, table["dvc_lock_sha256"])
    assert decide(config, chat, set()) == "fp16" and decide(config, chat, {"chat-talk"}) == "awq4"


def test_the_fleet_chart_draws_the_curve_and_each_priced_alternative(tmp_path):
    plan = {"by_deployments": [{"deployments": 1, "saving_pct": 0.0}, {"deployments": 2, "saving_pct": 31.5},
                               {"deployments": 3, "saving_pct": None}],
            "alternatives": [{"plan": "fp16 only", "deployed": ["fp16"], "deployments": 1, "saving_pct": 0.0},
                             {"plan": "chosen", "deployed": ["fp16", "int8"], "deployments": 2, "saving_pct": 31.5},
                             {"plan": "unpriced", "deployed": ["fp16", "x"], "deployments": 2, "saving_pct": None}]}
    png = fleet_plots.fleet_plot(plan, tmp_path / "fleet.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 1000
