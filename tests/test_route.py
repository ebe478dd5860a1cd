"""The routing table from hand-made comparisons, `route lookup`, and the dvc.lock digest."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines import cli, route
from pipelines.core import lineage
from pipelines.core.errors import QuantgateError
from pipelines.core.params_requests import ClassifyParams, PolicyParams
from pipelines.core.params_sections import CompareParams, CoverageParams
from pipelines.judging import comparison
from pipelines.routing.router import Router
from tests.handmade import FOOTPRINT, correctness, memory_row, plans, write_eval_items, write_memory, write_model

N = 400
BUCKETS = [64, 256]


SHIPPED_RULES = {name: rule.model_dump() for name, rule in CoverageParams().classify.items()}


def build(root, variants, params=CompareParams(), digest="d" * 64, classifier=SHIPPED_RULES):
    report = comparison.compare_all(["fp16", *variants], [], plans(root), params, root / "results",
                                    root / "models/variants")
    return route.build_table(report, BUCKETS, params.policy_for, root / "models/variants", digest, classifier)


@pytest.fixture()
def results(tmp_path):
    """int8 passes both domains; awq4 (cheaper) passes code only; gptq3 (cheapest) fails both."""
    write_model(tmp_path, "fp16", {d: correctness(N, 300) for d in ("math", "code")})
    write_model(tmp_path, "int8", {d: correctness(N, 300, lose=1) for d in ("math", "code")})
    write_model(tmp_path, "awq4", {"math": correctness(N, 300, lose=50), "code": correctness(N, 300, lose=2)})
    write_model(tmp_path, "gptq3", {d: correctness(N, 300, lose=90) for d in ("math", "code")})
    write_memory(tmp_path, {n: memory_row(n) for n in ("fp16", "int8", "awq4", "gptq3")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    return tmp_path


def row(table, domain, tokens):
    return next(r for r in table["rows"] if r["domain"] == domain and r["max_context_tokens"] == tokens)


def test_cheapest_passing_variant_serves_each_domain(results):
    table = build(results, ["int8", "awq4", "gptq3"])
    assert len([r for r in table["rows"] if r["domain"] in ("math", "code")]) == 4  # judged: 2 domains x 2 buckets
    assert len(table["rows"]) == 12  # and fp16 rows for chat, code_comment (not evaluated), unknown and ambiguous
    assert row(table, "code", 64)["serve"] == "awq4"
    assert row(table, "math", 64)["serve"] == "int8"
    math_row = row(table, "math", 256)
    assert math_row["cost_bytes"] == {"serve": FOOTPRINT["int8"] + 512 * 256, "fp16": FOOTPRINT["fp16"] + 512 * 256}
    assert math_row["evidence"]["verdict"] == "pass" and math_row["evidence"]["items"] == N
    considered = {c["variant"]: c["verdict"] for c in math_row["considered"]}
    assert considered == {"int8": "pass", "awq4": "fail", "gptq3": "fail"}
    prov = math_row["provenance"]
    assert prov["checkpoint_sha256"] == {"model.safetensors": "i" * 64}
    assert prov["calibration_sha256"] == "c" * 64 and prov["dvc_lock_sha256"] == "d" * 64
    assert prov["task_versions"] == {"math": 1.0, "code": 1.0} and prov["libraries"] == {"torch": "2.13.0+cpu"}
    # fp16 is never worse than what is routed: never more memory, never a verdict other than pass
    for r in table["rows"]:
        assert r["cost_bytes"]["serve"] <= r["cost_bytes"]["fp16"]
        assert r["serve"] == "fp16" or r["evidence"]["ci_low"] >= -0.05


def test_weights_unpacked_at_the_first_forward_are_costed_at_their_load_footprint(results):
    """transformers unpacks a compressed-tensors candidate at its first forward; a server (vLLM) keeps it packed:
    routing costs the load footprint, so memory's serving_tensor_bytes (this loader's) does not move the choice."""
    rows = {n: memory_row(n) for n in ("fp16", "int8", "awq4", "gptq3")}
    rows["int8"]["serving_tensor_bytes"] = FOOTPRINT["fp16"] + 4096
    write_memory(results, rows)
    math_row = row(build(results, ["int8", "awq4", "gptq3"]), "math", 256)
    assert math_row["serve"] == "int8"
    assert math_row["cost_bytes"]["serve"] == FOOTPRINT["int8"] + 512 * 256


def test_fp16_serves_when_nothing_passes(results):
    table = build(results, ["gptq3"])
    r = row(table, "math", 64)
    assert (r["serve"], r["fallback_under_memory_pressure"], r["reason"]) == ("fp16", "fp16", "no variant passed")
    assert r["evidence"] is None and r["provenance"]["checkpoint_sha256"] == {"model.safetensors": "f" * 64}


def test_a_saving_below_the_threshold_is_not_worth_routing(results):
    policy = PolicyParams(max_accuracy_drop=0.05, max_flip_rate=0.15, kl_percentile="p99", max_kl=1.0,
                          max_growth_excess_pct=1.0, min_memory_saving_pct=30.0, min_agreement=0.5)
    table = build(results, ["int8", "awq4"], CompareParams(policy={"default": policy}))
    r = row(table, "math", 64)  # int8 passes but saves 24.6 % < 30 %: fp16 serves, int8 is the fallback
    assert (r["serve"], r["fallback_under_memory_pressure"]) == ("fp16", "int8")
    assert r["reason"] == "passing variants save less than 30.0 % at 64 tokens"
    for tokens, saving in ((64, 1 - 1_332_768 / 2_032_768), (256, 1 - 1_431_072 / 2_131_072)):  # KV shrinks the saving
        r = row(table, "code", tokens)
        assert r["serve"] == "awq4"
        assert next(c for c in r["considered"] if c["variant"] == "awq4")["saving_pct"] == pytest.approx(100 * saving)


def test_lookup_picks_the_smallest_bucket_that_holds_the_request(results):
    table = build(results, ["int8", "awq4"])
    assert Router(table).lookup("code", 0)["max_context_tokens"] == 64
    assert Router(table).lookup("code", 64)["max_context_tokens"] == 64
    assert Router(table).lookup("code", 65)["max_context_tokens"] == 256
    with pytest.raises(QuantgateError, match="257 tokens exceed the largest context bucket \\(256\\)"):
        Router(table).lookup("code", 257)
    chat = Router(table).lookup("chat", 10)  # declared, not evaluated here (the handmade results hold math and code)
    assert chat["serve"] == "fp16" and chat["reason"].startswith("request type chat was not evaluated")
    with pytest.raises(QuantgateError, match="no row for domain 'sql'"):
        Router(table).lookup("sql", 10)


def test_requests_the_classifier_cannot_decide_are_served_by_fp16(results):
    """No rule holds: unknown; two hold at the same priority: ambiguous. Both are fp16's, and the table says so."""
    rules = {"math": {"patterns": {"digit": r"\d"}, "when": "digit >= 2", "priority": 1},
             "code": {"patterns": {"paren": r"\("}, "when": "paren >= 1", "priority": 1}}
    table = build(results, ["int8", "awq4"], classifier=rules)
    router = Router(json.loads(json.dumps(table)))  # as the router reads it from the file
    assert router.route("What is 12 + 30?", 40)["serve"] != "fp16"  # math passed for a cheaper variant
    unknown = router.route("hello there", 40)
    assert (unknown["domain"], unknown["serve"]) == ("unknown", "fp16")
    assert unknown["reason"] == "no request type's classifier rule matches: served by the baseline"
    ambiguous = router.route("f(12) + 30", 40)
    assert (ambiguous["domain"], ambiguous["serve"]) == ("ambiguous", "fp16")
    assert "same priority" in ambiguous["reason"]
    assert {r["domain"] for r in table["rows"]} == {"math", "code", "unknown", "ambiguous"}


def test_route_lookup_command_classifies_the_text(results, monkeypatch, capsys):
    table = build(results, ["int8", "awq4"])
    (results / "results").mkdir(exist_ok=True)
    (results / "results/routing_table.json").write_text(json.dumps(table))
    monkeypatch.chdir(results)
    assert cli.main(["route", "lookup", "def add(a, b):\n    return a + b\n", "--context-tokens", "100"]) == 0
    assert capsys.readouterr().out == "awq4\n"
    assert cli.main(["route", "lookup", "What is 17 × 3 + 4?", "--context-tokens", "10"]) == 0
    assert capsys.readouterr().out == "int8\n"
    assert cli.main(["route", "lookup", "What is 17 × 3 + 4?", "--context-tokens", "9999"]) == 2
    assert "exceed the largest context bucket" in capsys.readouterr().err


def test_lock_digest_covers_the_stages_that_made_the_results(tmp_path):
    lock = {"schema": "2.0", "stages": {"quantize@int8": {"cmd": "quantgate quantize int8", "outs": [{"md5": "a"}]},
                                        "compare": {"cmd": "quantgate compare", "outs": [{"md5": "b"}]}}}
    path = tmp_path / "dvc.lock"
    path.write_text(yaml.safe_dump(lock))
    first = lineage.lock_digest(path)
    lock["stages"]["compare"]["outs"][0]["md5"] = "changed"  # compare/route/record do not count
    path.write_text(yaml.safe_dump(lock))
    assert lineage.lock_digest(path) == first
    lock["stages"]["quantize@int8"]["outs"][0]["md5"] = "changed"
    path.write_text(yaml.safe_dump(lock))
    assert lineage.lock_digest(path) != first
    assert lineage.lock_digest(tmp_path / "missing.lock") is None
    results = lineage.results_digest(path)  # what record keys MLflow on: compare's entry counts, record's does not
    lock["stages"]["compare"]["outs"][0]["md5"] = "verdicts moved"
    path.write_text(yaml.safe_dump(lock))
    assert lineage.results_digest(path) != results
    results = lineage.results_digest(path)
    lock["stages"]["record"] = {"cmd": "quantgate record", "outs": [{"md5": "c"}]}
    path.write_text(yaml.safe_dump(lock))
    assert lineage.results_digest(path) == results


def test_without_a_baseline_every_row_stays_on_fp16(tmp_path):
    write_model(tmp_path, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    write_memory(tmp_path, {"int8": memory_row("int8")})
    table = build(tmp_path, ["int8"])
    assert {(r["serve"], r["fallback_under_memory_pressure"], r["reason"]) for r in table["rows"]
            if r["domain"] in ("math", "code")} == {
        ("fp16", "fp16", "no variant passed")}


ISSUE_REQUESTS = ["SELECT id, email FROM customers WHERE country = 'DE' ORDER BY id;",
                  '{"user": {"id": 42, "tags": ["vip"]}, "active": true}',
                  "cat /var/log/app.log | grep -i error | sort | uniq -c | head",
                  "Translate to French: Where is my order? It has not arrived."]


def test_only_a_positive_claim_reaches_a_quantized_variant(tmp_path, monkeypatch, capsys):
    """With the shipped rules and chat passed by the cheapest variant, what chat's rule does not claim (SQL, JSON, a
    shell pipeline, a translation task) is `unknown` and fp16 serves it; a customer's question is chat's."""
    write_model(tmp_path, "fp16", {"chat": correctness(N, 300)})
    write_model(tmp_path, "awq4", {"chat": correctness(N, 300, lose=1)})
    write_memory(tmp_path, {n: memory_row(n) for n in ("fp16", "awq4")})
    write_eval_items(tmp_path, {"chat": N})
    report = comparison.compare_all(["fp16", "awq4"], [], plans(tmp_path, ("chat",)), CompareParams(),
                                    tmp_path / "results", tmp_path / "models/variants")
    table = route.build_table(report, BUCKETS, CompareParams().policy_for, tmp_path / "models/variants", "d" * 64,
                              SHIPPED_RULES)
    (tmp_path / "results/routing_table.json").write_text(json.dumps(table))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["route", "lookup", "Hi, where is my order 41055? It has not arrived.", "--context-tokens", "40"]) == 0
    assert capsys.readouterr().out == "awq4\n"
    for text in ISSUE_REQUESTS:
        assert cli.main(["route", "lookup", text, "--context-tokens", "40"]) == 0
        printed = capsys.readouterr()
        assert printed.out == "fp16\n", text
        assert "route: unknown request, 40 tokens" in printed.err and "no request type's classifier rule" in printed.err


def test_a_declared_catch_all_takes_what_no_other_type_claims(results):
    """docs/request-types.md: a team that wants one declares it (`when: 'true'`, the lowest priority); it is judged
    like any type (here: not evaluated, so fp16 with that reason), and `unknown` is then never reached."""
    rules = {**SHIPPED_RULES, "anything": ClassifyParams(when="true", priority=-1).model_dump()}  # as params.yaml
    router = Router(json.loads(json.dumps(build(results, ["int8", "awq4"], classifier=rules))))
    for text in ISSUE_REQUESTS:
        assert router.route(text, 40)["domain"] == "anything"
    assert router.route("def add(a, b):\n    return a + b\n", 40)["serve"] == "awq4"  # code still claims its own
