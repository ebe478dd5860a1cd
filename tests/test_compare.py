"""The A/B stage on hand-made results whose verdicts are known, and its look plans (the statistics are in
test_stats.py, the look plan's arithmetic in test_sequential.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from pipelines.core.io import read_jsonl, write_jsonl
from pipelines.core.params_requests import PolicyParams
from pipelines.core.params_sections import CompareParams
from pipelines.judging import comparison, sequential, stats
from pipelines.judging.verdict import judge, worst
from tests.handmade import correctness, memory_row, plans, write_eval_items, write_memory, write_model

N = 400
PARAMS = CompareParams()
POLICY = dict(max_accuracy_drop=0.05, max_flip_rate=0.15, kl_percentile="p99", max_kl=1.0, max_growth_excess_pct=1.0,
              min_memory_saving_pct=10.0, min_agreement=0.5)


def run_compare(root, variants, candidates=(), domains=("math", "code"), params=PARAMS, look_items=10_000):
    return comparison.compare_all(["fp16", *variants], list(candidates), plans(root, domains, look_items), params,
                                  root / "results", root / "models/variants")


@pytest.fixture()
def fp16(tmp_path):
    write_model(tmp_path, "fp16", {d: correctness(N, 300) for d in ("math", "code")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    return tmp_path


def test_clear_pass_and_clear_fail(fp16):
    write_model(fp16, "int8", {d: correctness(N, 300, lose=2, gain=1) for d in ("math", "code")})
    write_model(fp16, "awq4", {"math": correctness(N, 300, lose=60), "code": correctness(N, 300, lose=1)})
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8", "awq4")})
    report = run_compare(fp16, ["int8", "awq4"])

    int8 = report["variants"]["int8"]
    assert int8["verdict"] == "pass"
    math_row = int8["domains"]["math"]["paired"]
    assert (math_row["correct_to_wrong"], math_row["wrong_to_correct"]) == (2, 1)
    assert math_row["difference"] == pytest.approx(-1 / 400)
    assert math_row["ci_low"] > -0.05 and math_row["interval"] == "tango-score"

    awq4 = report["variants"]["awq4"]
    assert awq4["domains"]["math"]["verdict"] == "fail"
    assert any("accuracy drops 0.150: interval [" in r and "lies below -0.050" in r
               for r in awq4["domains"]["math"]["reasons"])
    assert awq4["domains"]["code"]["verdict"] == "pass"
    assert awq4["verdict"] == "fail"  # one failing domain fails the variant
    assert report["fp16"]["accuracy"] == {"math": 0.75, "code": 0.75}
    assert report["plans"] == {"math": {"pool": N, "looks": [N]}, "code": {"pool": N, "looks": [N]}}


def policy_with_margin(margin):
    return CompareParams(policy={"default": PolicyParams(**{**POLICY, "max_accuracy_drop": margin})})


def test_decision_rule_at_its_boundaries(fp16):
    # 8 losses: point drop 0.02. Interval about [-0.036, -0.008].
    write_model(fp16, "int8", {d: correctness(N, 300, lose=8) for d in ("math", "code")})
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    paired = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]["math"]["paired"]
    low = paired["ci_low"]

    def verdict(margin):
        return run_compare(fp16, ["int8"], params=policy_with_margin(margin))["variants"]["int8"]["domains"]["math"]

    assert verdict(0.05)["verdict"] == "pass"
    assert verdict(-low)["verdict"] == "pass"  # low end exactly at -margin passes (>=)
    straddle = verdict(-low - 1e-6)
    assert straddle["verdict"] == "inconclusive"  # point estimate inside, interval reaches below
    assert straddle["reasons"][0].startswith("accuracy interval [") and "straddles -" in straddle["reasons"][0]
    assert verdict(0.0199)["verdict"] == "inconclusive"  # point estimate below -margin is no evidence of a larger drop
    high = paired["ci_high"]
    assert verdict(-high - 1e-6)["verdict"] == "fail"  # the whole interval below -margin: evidence of a larger drop
    assert verdict(-high + 1e-6)["verdict"] == "inconclusive"
    assert "more items would decide" in straddle["reasons"][-1] or "more families" in straddle["reasons"][-1]
    assert straddle["items_to_decide"] > 0


def test_zero_flips_pass_with_an_honest_interval(fp16):
    write_model(fp16, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    row = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]["math"]
    z = sps.t.ppf(0.975, 7)  # 8 item families: Student's t with 7 degrees of freedom
    assert row["verdict"] == "pass" and row["paired"]["degrees_of_freedom"] == 7
    # Tango's interval with no discordant pair is +-z^2/(n+z^2), not the percentile bootstrap's [0, 0]
    assert row["paired"]["ci_low"] == pytest.approx(-z * z / (N + z * z), rel=1e-9)
    assert row["paired"]["ci_high"] == pytest.approx(z * z / (N + z * z), rel=1e-9)


def test_power_is_never_a_veto(tmp_path):
    """40 items, one flip each way: the old detectable-difference rule called this 'too few items'."""
    n = 40
    write_model(tmp_path, "fp16", {"math": correctness(n, 30)})
    write_model(tmp_path, "int8", {"math": correctness(n, 30, lose=1, gain=1)})
    write_eval_items(tmp_path, {"math": n})
    write_memory(tmp_path, {x: memory_row(x) for x in ("fp16", "int8")})
    row = run_compare(tmp_path, ["int8"], domains=("math",), params=policy_with_margin(0.2))["variants"]["int8"]["domains"]["math"]
    assert row["paired"]["difference"] == 0 and row["paired"]["ci_low"] > -0.2
    assert row["verdict"] == "pass"


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, 999, "N/A"])
def test_a_bad_kl_value_fails(fp16, bad):
    kl = {"mean": 0.01, "max": 0.5, "p99": bad}
    write_model(fp16, "gptq3", {d: correctness(N, 300) for d in ("math", "code")}, kl=kl)
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "gptq3")})
    row = run_compare(fp16, ["gptq3"])["variants"]["gptq3"]
    assert row["verdict"] == "fail"
    assert "KL p99 is missing or not a number" in row["domains"]["math"]["reasons"][0]


def test_records_that_do_not_follow_the_look_plan_fail(fp16):
    answers = correctness(N, 300)
    write_model(fp16, "int8", {"math": answers[:-1], "code": answers})
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    rows = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]
    assert rows["math"]["verdict"] == "fail"
    assert any(r.startswith("scored 399 items; the look plan [400] needed exactly the pool's first 400") for r in rows["math"]["reasons"])
    assert rows["code"]["verdict"] == "pass"


def test_missing_variant_failed_variant_and_missing_memory_fail(fp16):
    write_model(fp16, "awq4", {}, status="failed")
    write_model(fp16, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    write_memory(fp16, {"fp16": memory_row("fp16")})  # int8 has no memory results
    report = run_compare(fp16, ["awq4", "int8"], candidates=["vendor"])
    assert report["variants"]["vendor"]["kind"] == "candidate"
    assert report["variants"]["vendor"]["domains"]["math"]["reasons"][0].startswith("no manifest")
    assert "quantize/admit failed: RuntimeError" in report["variants"]["awq4"]["domains"]["code"]["reasons"][0]
    assert report["variants"]["int8"]["domains"]["math"]["reasons"] == ["no memory results"]
    assert {v["verdict"] for v in report["variants"].values()} == {"fail"}


def test_missing_baseline_fails_everything(tmp_path):
    write_model(tmp_path, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    write_memory(tmp_path, {"int8": memory_row("int8")})
    report = run_compare(tmp_path, ["int8"])
    assert report["fp16"]["status"] == "failed"
    assert report["variants"]["int8"]["verdict"] == "fail"
    assert "baseline fp16 unusable" in report["variants"]["int8"]["domains"]["math"]["reasons"][0]


def test_an_fp16_soak_that_ran_out_of_memory_is_no_baseline(fp16):
    write_model(fp16, "int8", {d: correctness(N, 300, lose=1) for d in ("math", "code")})
    write_memory(fp16, {"fp16": {**memory_row("fp16"), "growth_bytes_per_round": None, "oom": "soak round 0: MemoryError"},
                        "int8": memory_row("int8")})
    report = run_compare(fp16, ["int8"])
    assert report["fp16"]["status"] == "failed"  # the gate reads this as 'could not decide' (exit 2)
    assert report["fp16"]["error"] == "fp16's memory soak gave no growth rate (soak round 0: MemoryError)"
    write_memory(fp16, {"fp16": {**memory_row("fp16"), "oom": "sweep at 4096 tokens: OutOfMemoryError"},
                        "int8": memory_row("int8")})  # out of memory at the longest length only: still a baseline
    report = run_compare(fp16, ["int8"])
    assert report["fp16"]["status"] == "ok" and report["variants"]["int8"]["verdict"] == "pass"


def test_memory_growth_leak_oom_flips_and_kl_limits(fp16):
    answers = {d: correctness(N, 300, lose=1) for d in ("math", "code")}
    for name in ("int8", "awq4", "vendor"):
        write_model(fp16, name, answers, kl={**compare_kl(), "p99": 1.5} if name == "vendor" else None,
                    kind="candidate" if name == "vendor" else "variant")
    write_model(fp16, "gptq3", {d: correctness(N, 300, lose=40, gain=40) for d in ("math", "code")})
    write_memory(fp16, {"fp16": memory_row("fp16"), "int8": memory_row("int8", growth_excess_pct=3.2),
                        "awq4": memory_row("awq4", leak=True, oom="soak round 7: OutOfMemoryError: CUDA out of memory"),
                        "gptq3": memory_row("gptq3"), "vendor": memory_row("vendor")})
    rows = run_compare(fp16, ["int8", "awq4", "gptq3"], candidates=["vendor"])["variants"]
    assert "memory grows 3.20 % of fp16's footprint more than fp16 (limit 1.0 %)" in rows["int8"]["domains"]["math"]["reasons"]
    assert "memory keeps growing under repeated traffic (leak)" in rows["awq4"]["domains"]["math"]["reasons"]
    assert "out of memory: soak round 7: OutOfMemoryError: CUDA out of memory" in rows["awq4"]["domains"]["code"]["reasons"]
    # equal accuracy, 20 % of answers flipped: exactly what flips are for
    assert rows["gptq3"]["domains"]["math"]["paired"]["difference"] == 0
    assert "flip rate 0.200 > 0.150" in rows["gptq3"]["domains"]["math"]["reasons"]
    assert "KL p99 1.5000 > 1.0" in rows["vendor"]["domains"]["code"]["reasons"]
    assert all(r["verdict"] == "fail" for r in rows.values())


def test_an_out_of_memory_error_is_named_even_without_a_growth_rate():
    policy = PolicyParams(**POLICY)
    paired = stats.paired_comparison(np.array(correctness(N, 300)), np.array(correctness(N, 300)))
    fidelity = {"tokens": 500, "kl": {"p99": 0.1}}
    early = {**memory_row("int8"), "growth_excess_pct": None, "oom": "soak round 0: MemoryError"}  # stopped at round 0
    verdict, reasons, _ = judge(paired, fidelity, early, policy, False)
    assert verdict == "fail" and reasons[0] == "out of memory: soak round 0: MemoryError"


def compare_kl():
    from tests.handmade import KL
    return dict(KL)


def test_results_identical_to_the_baseline_fail(fp16):
    write_model(fp16, "int8", {d: correctness(N, 300) for d in ("math", "code")}, kl={**compare_kl(), "max": 0.0},
                responses_like_fp16=True)
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    row = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "fail"
    assert any("equals fp16's" in r for r in row["reasons"])


def test_items_with_other_prompts_do_not_pair(fp16):
    write_model(fp16, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    path = fp16 / "results/eval/int8/items.jsonl"
    rows = read_jsonl(path)
    rows[3]["prompt_hash"] = "something else"
    write_jsonl(path, rows)
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    row = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "fail"
    assert "1 items have other prompts than fp16's (e.g. math-0003)" in row["reasons"]


def test_numbers_that_contradict_each_other_fail_in_judge():
    paired = stats.paired_comparison(np.array(correctness(N, 300)), np.array(correctness(N, 300, lose=1))) | {"chance": 0.0}
    policy = PolicyParams(**POLICY)
    fidelity, memory = {"tokens": 500, "kl": {"p99": 0.1}}, memory_row("int8")
    assert judge(paired, fidelity, memory, policy, False)[0] == "pass"
    forged = {**paired, "difference": -0.30}  # the verdict field would say pass; the numbers do not add up
    verdict, reasons, _ = judge(forged, fidelity, memory, policy, False)
    assert verdict == "fail" and any("is not (wrong->correct - correct->wrong) / items" in r for r in reasons)
    assert any("does not contain the difference" in r for r in reasons)


def test_probes_that_nobody_answers_measure_nothing_and_cannot_pass():
    policy = PolicyParams(**POLICY)
    fidelity, memory = {"tokens": 500, "kl": {"p99": 0.1}}, memory_row("int8")
    nothing = np.zeros(300, bool)  # a broken answer extraction scores fp16 and the variant 0 on every item
    verdict, reasons, _ = judge(stats.paired_comparison(nothing, nothing) | {"chance": 0.0}, fidelity, memory, policy, False)
    assert verdict == "fail" and any("answer none of the 300 items" in r for r in reasons)
    one = nothing.copy()
    one[7] = True  # one item right on both sides: above chance 0, but fp16 is under the margin: nothing to lose
    verdict, reasons, _ = judge(stats.paired_comparison(one, one) | {"chance": 0.0}, fidelity, memory, policy, False)
    assert verdict == "inconclusive" and reasons[0].startswith("no signal: fp16 answers 0.003 of 300 items")


def test_no_signal_no_pass():
    """fp16 and a variant both guessing on a 4-choice probe (a model with random weights): the interval of their
    difference sits inside the margin, but fp16 is not above chance, so the row is inconclusive, never a pass; the
    same accuracies on a generation probe (chance 0) are signal. A row without a chance level fails."""
    policy = PolicyParams(**POLICY)
    fidelity, memory = {"tokens": 500, "kl": {"p99": 0.1}}, memory_row("int8")
    rng = np.random.default_rng(0)
    base, variant = rng.random(600) < 0.25, rng.random(600) < 0.25
    variant[:500] = base[:500]  # most items answered alike: an interval that clears the margin
    paired = stats.paired_comparison(base, variant, confidence=0.95)
    assert paired["ci_low"] > -0.05 and paired["accuracy_fp16_low"] < 0.25
    verdict, reasons, checks = judge(paired | {"chance": 0.25}, fidelity, memory, policy, False)
    assert verdict == "inconclusive" and reasons[0].startswith("no signal: fp16 answers")
    assert checks["signal"]["decision"] == "no" and checks["accuracy_drop"]["decision"] == "inconclusive"
    assert judge(paired | {"chance": 0.0}, fidelity, memory, policy, False)[0] == "pass"
    verdict, reasons, _ = judge(paired, fidelity, memory, policy, False)
    assert verdict == "fail" and any("chance level is missing" in r for r in reasons)
    # a generation probe fp16 never answers (the shipped math probe on SmolLM2: 0 of 200): nothing it can lose,
    # and a variant that happens to get 2 right
    none, lucky = np.zeros(200, bool), np.zeros(200, bool)
    lucky[:2] = True
    zero = stats.paired_comparison(none, lucky, confidence=0.95)
    assert zero["accuracy_fp16_low"] == 0.0  # exactly: 1e-18 of rounding once read as above chance 0 and passed
    verdict, reasons, _ = judge(zero | {"chance": 0.0}, fidelity, memory, policy, False)
    assert verdict == "inconclusive" and reasons[0].startswith("no signal: fp16 answers 0.000 of 200 items")
    # fp16 right on 1 of 200: above chance 0, but no variant could lose the 0.05 margin, so nothing could fail it
    one = none.copy()
    one[5] = True
    verdict, reasons, _ = judge(stats.paired_comparison(one, lucky, confidence=0.95) | {"chance": 0.0}, fidelity,
                                memory, policy, False)
    assert verdict == "inconclusive" and reasons[0].startswith("no signal: fp16 answers 0.005 of 200 items")


# --- looks: sequential decisions through compare ---------------------------------------------------------

def sequential_fixture(tmp_path, lose_first: int, pool: int = 800, look: int = 200):
    """fp16 right on 600 of 800 items; the variant loses `lose_first` right answers among the first 200 in
    evaluation order. Returns (the variant's answers, ids in evaluation order). Looks: 200, 500, 800."""
    write_eval_items(tmp_path, {"math": pool})
    order = sequential.ordered([f"math-{i:04d}" for i in range(pool)], "math")
    position = {i: k for k, i in enumerate(order)}
    base = [True] * pool
    for i in range(pool):
        base[i] = position[f"math-{i:04d}"] % 4 != 0  # 75 %, spread through every look
    write_model(tmp_path, "fp16", {"math": base})
    lost = [i for i in range(pool) if base[i] and position[f"math-{i:04d}"] < look][:lose_first]
    var = [False if i in lost else b for i, b in enumerate(base)]
    write_memory(tmp_path, {n: memory_row(n) for n in ("fp16", "int8")})
    return var, order


def write_looked(tmp_path, var, order, upto):
    """The variant's records for the first `upto` items in evaluation order only."""
    keep = set(order[:upto])
    write_model(tmp_path, "int8", {"math": var})
    path = tmp_path / "results/eval/int8/items.jsonl"
    rows = [r for r in read_jsonl(path) if r["item_id"] in keep]
    write_jsonl(path, rows)
    evaluation = tmp_path / "results/eval/int8.json"
    import json
    data = json.loads(evaluation.read_text())
    data["probes"]["math"]["score"] = sum(r["correct"] for r in rows) / len(rows)
    evaluation.write_text(json.dumps(data))


def test_a_decided_first_look_stops_there(tmp_path):
    var, order = sequential_fixture(tmp_path, lose_first=0)
    write_looked(tmp_path, var, order, 200)
    front_loaded = CompareParams(spending="pocock")  # (the default hsd:-1.5 leaves 0 flips of 200 in 8 families undecided)
    row = run_compare(tmp_path, ["int8"], domains=("math",), look_items=200,
                      params=front_loaded)["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "pass" and row["paired"]["items"] == 200
    assert row["looks"]["look"] == 1 and row["looks"]["looks"] == [200, 500, 800]
    assert row["paired"]["confidence"] == pytest.approx(1 - 2 * stats.look_alphas([200, 500, 800], 0.025, "pocock")[0])
    write_looked(tmp_path, var, order, 500)  # evaluated more than the decision needed: not what evaluate does
    row = run_compare(tmp_path, ["int8"], domains=("math",), look_items=200,
                      params=front_loaded)["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "fail" and any("needed exactly the pool's first 200" in r for r in row["reasons"])


def test_an_undecided_look_continues_and_the_next_decides(tmp_path):
    var, order = sequential_fixture(tmp_path, lose_first=7)  # -0.035 at 200 items: straddles 0.05
    write_looked(tmp_path, var, order, 200)
    row = run_compare(tmp_path, ["int8"], domains=("math",), look_items=200)["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "fail" and any("evaluation stopped at look 1 of 3" in r for r in row["reasons"])
    write_looked(tmp_path, var, order, 500)
    row = run_compare(tmp_path, ["int8"], domains=("math",), look_items=200)["variants"]["int8"]["domains"]["math"]
    assert [h["decision"] for h in row["looks"]["history"]][0] == "inconclusive"
    assert row["looks"]["look"] >= 2 and row["paired"]["items"] == row["looks"]["looks"][row["looks"]["look"] - 1]


@pytest.mark.parametrize("verdicts, baseline, gate", [
    ([], "ok", "undecided"),  # nothing judged
    (["pass", "pass"], "ok", "pass"),
    (["pass", "inconclusive"], "ok", "undecided"),  # inconclusive without a fail
    (["inconclusive", "fail", "pass"], "ok", "fail"),
    (["pass", "fail"], "ok", "fail"),
    (["pass"], "failed", "undecided"),  # no baseline: could not decide, whatever the rows say
    (["fail"], "failed", "undecided"),
    ([], "failed", "undecided"),
    (["pass", None], "ok", "undecided"),  # a verdict no rule gives (a hand edit): never a pass
    (["pass", "PASS"], "ok", "undecided"),
])
def test_the_summarys_gate_is_the_verdict_modules_worst_of(verdicts, baseline, gate):
    """summary.json's `gate` is judging/verdict.py's worst-of over the variants' verdicts, not a rule of its own."""
    report = {"fp16": {"status": baseline}, "domains": ["math"],
              "variants": {f"v{i}": {"verdict": v, "domains": {"math": {"verdict": v}}} for i, v in enumerate(verdicts)}}
    assert comparison.summary(report)["gate"] == gate
    assert gate == (worst(verdicts) if baseline == "ok" else "undecided")


def test_duplicate_item_ids_are_refused_with_file_and_line(tmp_path):
    from pipelines.core.errors import QuantgateError

    write_jsonl(tmp_path / "eval/math/items.jsonl", [{"id": "a"}, {"id": "b"}, {"id": "a"}])
    with pytest.raises(QuantgateError, match=r"eval/math/items.jsonl:3: duplicate item id 'a' \(first on line 1\)"):
        plans(tmp_path, ("math",))


def test_items_without_a_family_are_each_their_own(tmp_path):
    write_jsonl(tmp_path / "eval/math/items.jsonl", [{"id": "a", "family": None}, {"id": "b"}, {"id": "c", "family": "x"},
                                                    {"id": "d", "family": "x"}])
    families = plans(tmp_path, ("math",))["math"]["families"]
    assert len({families["a"], families["b"]}) == 2 and families["c"] == families["d"] == "x"


def test_no_flips_at_a_small_pool_asks_for_a_sensible_number_of_items(tmp_path):
    """60 items, no flips: the interval (+-0.06) straddles a 0.05 margin; the advice must not say 1 item."""
    n = 60
    write_model(tmp_path, "fp16", {"math": correctness(n, 45)})
    write_model(tmp_path, "int8", {"math": correctness(n, 45)})
    write_eval_items(tmp_path, {"math": n})
    write_memory(tmp_path, {x: memory_row(x) for x in ("fp16", "int8")})
    row = run_compare(tmp_path, ["int8"], domains=("math",))["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "inconclusive"
    assert row["items_to_decide"] > 2 * n
    assert "more than the 60-item pool holds: add items" in row["reasons"][-1]


def test_a_failed_memory_stage_is_named(fp16):
    write_model(fp16, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    write_memory(fp16, {"fp16": memory_row("fp16"),
                        "int8": {"status": "failed", "error": "the process measuring x died (killed by SIGKILL)"}})
    row = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "fail"
    assert row["reasons"] == ["memory stage failed: the process measuring x died (killed by SIGKILL)"]
