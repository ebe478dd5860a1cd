"""The A/B stage on hand-made results whose verdicts are known, and its statistics against scipy/statsmodels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.power import NormalIndPower

from pipelines import compare, stats
from pipelines.params import CompareParams, PolicyParams
from tests.handmade import correctness, memory_row, write_eval_items, write_memory, write_model

N = 400
PARAMS = CompareParams(resamples=2000)


def run_compare(root, variants, candidates=(), domains=("math", "code"), expected=None, params=PARAMS):
    expected = expected or {d: N for d in domains}
    return compare.compare_all(["fp16", *variants], list(candidates), list(domains), expected, params,
                               root / "results", root / "models/variants")


@pytest.fixture()
def fp16(tmp_path):
    write_model(tmp_path, "fp16", {d: correctness(N, 300) for d in ("math", "code")})
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
    assert math_row["ci_low"] > -0.05

    awq4 = report["variants"]["awq4"]
    assert awq4["domains"]["math"]["verdict"] == "fail"
    assert any("accuracy drops 0.150" in r for r in awq4["domains"]["math"]["reasons"])
    assert awq4["domains"]["code"]["verdict"] == "pass"
    assert awq4["verdict"] == "fail"  # one failing domain fails the variant
    assert report["fp16"]["accuracy"] == {"math": 0.75, "code": 0.75}


def test_margin_is_judged_on_the_interval_not_the_point_estimate(fp16):
    # 8 losses: point drop 0.02, far inside a 0.05 margin, but a 0.01 margin sits inside the interval
    write_model(fp16, "int8", {d: correctness(N, 300, lose=8) for d in ("math", "code")})
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    tight = CompareParams(resamples=2000, policy={"default": PolicyParams(
        max_accuracy_drop=0.05, max_flip_rate=0.15, kl_percentile="p99", max_kl=1.0, max_growth_excess_pct=1.0,
        min_memory_saving_pct=10.0), "math": PolicyParams(max_accuracy_drop=0.021)})
    row = run_compare(fp16, ["int8"], params=tight)["variants"]["int8"]["domains"]
    assert row["code"]["verdict"] == "pass"
    assert row["math"]["paired"]["difference"] == pytest.approx(-0.02)  # point estimate inside 0.021 ...
    assert row["math"]["verdict"] == "inconclusive"  # ... but the interval reaches below it
    assert row["math"]["policy"]["max_accuracy_drop"] == 0.021 and row["math"]["policy"]["max_kl"] == 1.0


def test_too_few_items_is_inconclusive_not_pass(tmp_path):
    n = 40
    write_model(tmp_path, "fp16", {"math": correctness(n, 30)})
    write_model(tmp_path, "int8", {"math": correctness(n, 30, lose=1, gain=1)})
    write_memory(tmp_path, {x: memory_row(x) for x in ("fp16", "int8")})
    row = run_compare(tmp_path, ["int8"], domains=("math",), expected={"math": n})["variants"]["int8"]["domains"]["math"]
    assert row["paired"]["difference"] == 0
    assert row["verdict"] == "inconclusive"
    assert any(r.startswith("too few items: 40 items") for r in row["reasons"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, 999, "N/A"])
def test_a_bad_kl_value_fails(fp16, bad):
    kl = {"mean": 0.01, "max": 0.5, "p99": bad}
    write_model(fp16, "gptq3", {d: correctness(N, 300) for d in ("math", "code")}, kl=kl)
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "gptq3")})
    row = run_compare(fp16, ["gptq3"])["variants"]["gptq3"]
    assert row["verdict"] == "fail"
    assert "KL p99 is missing or not a number" in row["domains"]["math"]["reasons"][0]


def test_fewer_items_than_expected_fails(fp16):
    answers = correctness(N, 300)
    write_model(fp16, "int8", {"math": answers[:-1], "code": answers})
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    rows = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]
    assert rows["math"]["verdict"] == "fail"
    assert f"scored {N - 1} items, expected {N}" in rows["math"]["reasons"]
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
    write_memory(tmp_path, {"int8": memory_row("int8")})
    report = run_compare(tmp_path, ["int8"])
    assert report["fp16"]["status"] == "failed"
    assert report["variants"]["int8"]["verdict"] == "fail"
    assert "baseline fp16 unusable" in report["variants"]["int8"]["domains"]["math"]["reasons"][0]


def test_memory_growth_leak_flips_and_kl_limits(fp16):
    answers = {d: correctness(N, 300, lose=1) for d in ("math", "code")}
    write_model(fp16, "int8", answers)
    write_model(fp16, "awq4", answers)
    write_model(fp16, "gptq3", {d: correctness(N, 300, lose=40, gain=40) for d in ("math", "code")})
    write_model(fp16, "vendor", answers, kl={**compare_kl(), "p99": 1.5}, kind="candidate")
    write_memory(fp16, {"fp16": memory_row("fp16"), "int8": memory_row("int8", growth_excess_pct=3.2),
                        "awq4": memory_row("awq4", leak=True), "gptq3": memory_row("gptq3"), "vendor": memory_row("vendor")})
    rows = run_compare(fp16, ["int8", "awq4", "gptq3"], candidates=["vendor"])["variants"]
    assert "memory grows 3.20 % of fp16's footprint more than fp16 (limit 1.0 %)" in rows["int8"]["domains"]["math"]["reasons"]
    assert "memory leak under repeated traffic" in rows["awq4"]["domains"]["math"]["reasons"]
    # equal accuracy, 20 % of answers flipped: exactly what flips are for
    assert rows["gptq3"]["domains"]["math"]["paired"]["difference"] == 0
    assert "flip rate 0.200 > 0.150" in rows["gptq3"]["domains"]["math"]["reasons"]
    assert "KL p99 1.5000 > 1.0" in rows["vendor"]["domains"]["code"]["reasons"]
    assert all(r["verdict"] == "fail" for r in rows.values())


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
    from pipelines.io import read_jsonl, write_jsonl

    write_model(fp16, "int8", {d: correctness(N, 300) for d in ("math", "code")})
    path = fp16 / "results/eval/int8/items.jsonl"
    rows = read_jsonl(path)
    rows[3]["prompt_hash"] = "something else"
    write_jsonl(path, rows)
    write_memory(fp16, {n: memory_row(n) for n in ("fp16", "int8")})
    row = run_compare(fp16, ["int8"])["variants"]["int8"]["domains"]["math"]
    assert row["verdict"] == "fail"
    assert "1 items have other prompts than fp16's (e.g. math-0003)" in row["reasons"]


def test_expected_items_follow_the_items_file_and_limit(tmp_path):
    write_eval_items(tmp_path, {"math": 30, "code": 12})
    assert compare.expected_items(["math", "code"], None, tmp_path / "eval") == {"math": 30, "code": 12}
    assert compare.expected_items(["math", "code"], 20, tmp_path / "eval") == {"math": 20, "code": 12}


# --- the statistics against reference implementations ------------------------------------------------

def paired_sample(seed=1, n=300):
    rng = np.random.default_rng(seed)
    base = rng.random(n) < 0.7
    variant = base.copy()
    flip = rng.random(n) < 0.12
    variant[flip] = ~variant[flip]
    return base, variant


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mcnemar_matches_statsmodels_exact(seed):
    base, variant = paired_sample(seed)
    f = stats.flips(base, variant)
    table = [[np.sum(base & variant), np.sum(base & ~variant)], [np.sum(~base & variant), np.sum(~base & ~variant)]]
    assert (f["correct_to_wrong"], f["wrong_to_correct"]) == (table[0][1], table[1][0])
    assert stats.mcnemar_exact(f["correct_to_wrong"], f["wrong_to_correct"]) == pytest.approx(
        mcnemar(table, exact=True).pvalue, rel=1e-12)
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 8) == pytest.approx(2 * 0.5 ** 8)


def test_paired_bootstrap_matches_scipy():
    base, variant = paired_sample()
    low, high = stats.paired_bootstrap(base, variant, resamples=20000, seed=0)
    ref = sps.bootstrap((variant.astype(float), base.astype(float)), lambda v, b: np.mean(v - b), paired=True,
                        vectorized=False, n_resamples=20000, method="percentile", confidence_level=0.95,
                        rng=np.random.default_rng(1)).confidence_interval
    assert low == pytest.approx(ref.low, abs=0.006)
    assert high == pytest.approx(ref.high, abs=0.006)
    assert low < np.mean(variant) - np.mean(base) < high
    assert stats.paired_bootstrap(base, variant, resamples=2000, seed=7) == stats.paired_bootstrap(base, variant, 2000, 7)


@pytest.mark.parametrize("n,psi", [(200, 0.1), (1000, 0.05), (50, 0.3)])
def test_detectable_difference_has_the_configured_power(n, psi):
    mde = stats.detectable_difference(n, psi, power=0.8)
    power = NormalIndPower().power(effect_size=mde / math.sqrt(psi), nobs1=n, alpha=0.05, ratio=0)
    assert power == pytest.approx(0.8, abs=1e-3)
    assert stats.detectable_difference(n, 0.0, 0.8) == stats.detectable_difference(n, 3 / n, 0.8)  # rule of three


def test_accuracy_and_flip_rates_match_numpy():
    base, variant = paired_sample(4)
    row = stats.paired_comparison(base, variant, resamples=1000, seed=0, confidence=0.95, power=0.8)
    assert row["accuracy"] == np.mean(variant) and row["accuracy_fp16"] == np.mean(base)
    assert row["difference"] == pytest.approx(np.mean(variant) - np.mean(base), abs=1e-15)
    assert row["flip_rate"] == pytest.approx(np.mean(base != variant))
