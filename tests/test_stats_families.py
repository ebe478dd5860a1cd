"""judging/stats.py where items come in families: Student's t on the Bell-McCaffrey degrees of freedom, fewer where
the flips crowd into some families (flip_spread_df), one family that cannot pass, the CR2 variance against the matrix
formulas, a family's gains that cannot hide its losses, and the false-pass budget on seeded simulations of few and of
strongly clustered families."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.judging import comparison, sequential, stats
from tests.handmade import correctness

N = 400

def test_few_families_take_students_t_with_one_degree_less():
    """8 families: the cluster-robust variance is itself uncertain, so the limits use t with 7 df (the losses in
    four families, one each: nothing crowds)."""
    base = np.array(correctness(N, 300))
    variant = base.copy()
    variant[[0, 61, 122, 183]] = False
    families = [f"f{i % 8}" for i in range(N)]
    row = stats.paired_comparison(base, variant, families=families)
    assert row["degrees_of_freedom"] == 7
    effect = row["design_effect"]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(
        stats.tango_interval(0, 4 / effect, N / effect, 0.95, df=7))
    assert row["ci_low"] < stats.tango_interval(0, 4 / effect, N / effect, 0.95)[0]  # wider than with z
    assert stats.paired_comparison(base, variant)["degrees_of_freedom"] is None  # every item its own family


def test_flips_crowded_into_few_families_take_fewer_degrees_of_freedom():
    """The same 24 losses in 8 equal families: spread 3 per family, t keeps Bell-McCaffrey's 7 degrees of freedom;
    12 in each of two families, Satterthwaite's count from the flips, ((sum f)^2 - sum f) / (sum f^2 - sum f) x 7/8
    = 552 / 264 x 7 / 8, and the interval's low end falls below the one t on 7 gives at the same effective counts."""
    base = np.array(correctness(N, 300))
    families = [f"f{i % 8}" for i in range(N)]
    spread, crowded = base.copy(), base.copy()
    spread[np.arange(24)] = False  # items 0-23: three in each family
    crowded[np.arange(0, 192, 8)] = False  # families f0 ...
    crowded[np.arange(1, 96, 8)[:12]] = False  # ... and f1: 12 losses each
    crowded[np.arange(0, 192, 8)[12:]] = True
    assert (~crowded).sum() == (~spread).sum() and crowded.sum() == 276
    row = stats.paired_comparison(base, spread, families=families)
    assert row["degrees_of_freedom"] == 7
    row = stats.paired_comparison(base, crowded, families=families)
    assert row["degrees_of_freedom"] == pytest.approx(552 / 264 * 7 / 8, abs=1e-6)
    effect = row["design_effect"]
    assert row["ci_low"] == pytest.approx(stats.tango_interval(0, 24 / effect, N / effect, 0.95,
                                                               df=row["degrees_of_freedom"])[0])
    assert row["ci_low"] < stats.tango_interval(0, 24 / effect, N / effect, 0.95, df=7)[0]
    assert row["degrees_of_freedom_sizes"] == 7  # what the sizes allow, kept for the advice
    gains = base.copy()  # gains count as flips too: 24 gains in the same two families
    gains[np.arange(304, 400, 8)] = True
    gains[np.arange(305, 400, 8)] = True
    assert stats.paired_comparison(base, gains, families=families)["degrees_of_freedom"] == row["degrees_of_freedom"]
    assert stats.flip_spread_df([1, 1, 1, 0]) == math.inf  # no family with two flips: nothing says they crowd
    assert stats.flip_spread_df([5, 0, 0, 0]) == 1.0  # (25 - 5) / (25 - 5) x 3/4, floored at 1


def test_two_flips_in_one_family_leave_one_degree_of_freedom_and_the_advice_says_why():
    """The cost of the few-families fix: 600 items in 36 families, only 2 losses, both in one family, is as crowded
    as flips can be (1 degree of freedom, floored), and the row stays undecided where the same 2 losses in two
    families pass. The advice names the crowding rather than only asking for thousands of items."""
    base = np.array(correctness(600, 450))
    families = [f"f{i % 36}" for i in range(600)]
    together, apart = base.copy(), base.copy()
    together[[0, 36]] = False  # both in f0
    apart[[0, 1]] = False  # f0 and f1
    crowded, spread = (stats.paired_comparison(base, v, families=families, confidence=0.978) for v in (together, apart))
    assert (crowded["degrees_of_freedom"], crowded["degrees_of_freedom_sizes"]) == (1.0, spread["degrees_of_freedom"])
    assert sequential.accuracy_rule(crowded, 0.05)[0] == sequential.UNDECIDED
    assert sequential.accuracy_rule(spread, 0.05)[0] == sequential.PASS
    advice = comparison._more_items_advice(5000.0, crowded, 0.8, 600)
    assert "the 2 flips crowd into some of the 36 families (t on 1.0 degrees of freedom, not the " in advice
    assert "crowd" not in comparison._more_items_advice(5000.0, spread, 0.8, 600)


# --- few families: one cannot pass, 2-5 are judged with CR2 and t (Bell-McCaffrey's count, fewer if flips crowd) -----

def test_one_family_cannot_pass_on_within_family_variation():
    """2,000 items, the variant 5 points better with 20 gains and no loss, but every item in one family: nothing says
    how another family would fare, so the interval is [-1, 1] and the row is undecided with the reason named (the
    same items as independent ones pass by a wide margin: the test could fail)."""
    base = np.array(correctness(2000, 1200))
    variant = base.copy()
    variant[np.flatnonzero(~base)[:100]] = True
    row = stats.paired_comparison(base, variant, families=["add-2"] * 2000)
    assert (row["ci_low"], row["ci_high"], row["degrees_of_freedom"], row["families"]) == (-1.0, 1.0, 0.0, 1)
    assert row["effective_items"] == 1.0
    decision, reason = sequential.accuracy_rule(row, 0.05)
    assert decision == sequential.UNDECIDED and reason.startswith("one family:") and "within-family" in reason
    assert stats.items_to_decide(row["difference"], row["flip_rate"], 0.05, 0.025, 0.8, row["design_effect"],
                                 row["degrees_of_freedom"], 2000) is None  # more of the same family decides nothing
    assert sequential.accuracy_rule(stats.paired_comparison(base, variant), 0.05)[0] == sequential.PASS
    assert stats.tango_interval(5, 0, 2000, df=0) == (-1.0, 1.0)  # df=0 is not "no df" (the normal quantile)
    ids = [f"i{k}" for k in range(2000)]
    run = sequential.run_looks(dict(zip(ids, base)), dict(zip(ids, variant)), ids, [200, 2000],
                               dict.fromkeys(ids, "add-2"), 0.05, 0.025, "pocock")
    assert run["decision"] == sequential.UNDECIDED and run["look"] == 2


@pytest.mark.parametrize("groups", [2, 3, 4, 5])
def test_few_equal_families_widen_the_interval_beyond_the_naive_one(groups):
    """Equal families: CR2 is CR1's G/(G-1) and Bell-McCaffrey's degrees of freedom are G - 1; the interval is
    wider than the independent-items one on both sides."""
    n = 600  # divisible by 2 to 6: equal families
    base = np.array(correctness(n, 450))
    variant = base.copy()
    variant[np.flatnonzero(base)[::23]] = False  # losses spread over every family: the design effect stays near 1
    naive = stats.paired_comparison(base, variant)
    row = stats.paired_comparison(base, variant, families=[i % groups for i in range(n)])
    assert row["degrees_of_freedom"] == pytest.approx(groups - 1, abs=1e-6)
    assert row["ci_low"] < naive["ci_low"] and row["ci_high"] > naive["ci_high"]
    effect = row["design_effect"]  # the same effective counts with t on G - 1: the t quantile is what widens it
    assert row["ci_low"] == pytest.approx(stats.tango_interval(row["wrong_to_correct"] / effect,
                                                               row["correct_to_wrong"] / effect, n / effect,
                                                               df=groups - 1)[0], abs=1e-6)


def cr2_by_matrices(diff: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """An independent CR2 variance of the mean and its Bell-McCaffrey degrees of freedom, from the general matrix
    formulas (Bell & McCaffrey 2002; Imbens & Kolesar 2016, eq. 9): A_g = (I - H_gg)^(-1/2) by scipy's sqrtm."""
    from scipy import linalg

    n = len(diff)
    x = np.ones((n, 1))
    hat = x @ x.T / n
    resid = diff - diff.mean()
    columns, variance = [], 0.0
    for g in np.unique(labels):
        idx = np.flatnonzero(labels == g)
        a = linalg.inv(np.real(linalg.sqrtm(np.eye(len(idx)) - hat[np.ix_(idx, idx)])))
        variance += float((x[idx].T @ a @ resid[idx])[0] / n) ** 2
        column = (np.eye(n) - hat)[:, idx] @ a @ x[idx] / n  # the family's share of the estimator's error
        columns.append(column[:, 0])
    gram = np.array(columns) @ np.array(columns).T
    lam = np.linalg.eigvalsh(gram)
    return variance, float(lam.sum() ** 2 / np.sum(lam**2))


def test_cr2_and_bell_mccaffrey_match_the_matrix_formulas_for_unequal_families():
    rng = np.random.default_rng(7)
    labels = rng.permutation(np.repeat(np.arange(5), [120, 20, 20, 20, 20]))
    diff = -(rng.random(200) < np.array([0.2, 0.02, 0.05, 0.0, 0.1])[labels]).astype(float) + (rng.random(200) < 0.03)
    variance, df = cr2_by_matrices(diff, labels)
    iid = np.var(diff, ddof=1) / 200
    effect, groups = stats.design_effect(diff, labels)
    assert groups == 5 and effect == pytest.approx(max(1.0, variance / iid), rel=1e-9)
    assert stats.cluster_degrees_of_freedom(labels) == pytest.approx(df, rel=1e-9)
    assert 1 < df < 3  # one family of 120: far fewer than the G - 1 = 4 that CR1's rule took
    assert stats.cluster_degrees_of_freedom([0] * 195 + [1, 2, 3, 4, 5]) < 1.1


def test_simulated_false_pass_at_the_margin_stays_within_the_budget_with_2_to_5_families():
    """A small seeded run of benchmarks/few_families.py (docs/compare.md has the full table): at 2-5 families whose
    flip propensities differ (gamma, CV 1), a variant whose true drop is the margin passes at most the 2.5 % budget
    plus two Monte-Carlo standard errors; judged as independent items the same runs pass far more often."""
    from benchmarks.few_families import operating

    runs, budget = 300, 0.025
    bound = budget + 2 * math.sqrt(budget * (1 - budget) / runs)
    naive = []
    for groups in (2, 3, 4, 5, "5 unequal"):
        r = operating(seed=3, runs=runs, families=groups, difference=-0.05, flip_rate=0.10, looks=[200])
        assert r["pass"] <= bound, (groups, r)
        naive.append(r["naive_pass"])
    assert max(naive) > 2 * bound  # what counting families protects against


def test_few_strongly_clustered_families_stay_under_the_clustered_goal_where_bell_mccaffreys_count_did_not(monkeypatch):
    """The issue's case, seeded (benchmarks/few_families.py's runs, 400 each at 4, 5 and 8 equal families whose flip
    propensities vary with coefficient of variation 1.5, looks 200/600/1000, a variant whose true drop is the margin):
    the rule passes under the 3 % goal; t on Bell-McCaffrey's count alone (flip_spread_df switched off) passed more
    than that on the same runs."""
    from benchmarks.few_families import judged, labels_for
    from benchmarks.gate_operating import simulate

    def false_pass() -> float:
        passed = 0
        for k, groups in enumerate((4, 5, 8)):
            rng = np.random.default_rng(5 + k)
            for _ in range(400):
                labels = labels_for(groups, 1000, rng)
                base, variant, labels = simulate(rng, 1000, -0.05, 0.10, groups, labels=labels, cv=1.5)
                passed += judged(base, variant, labels, [200, 600, 1000], 0.025, True)[0] == "pass"
        return passed / 1200

    now = false_pass()
    monkeypatch.setattr(stats, "flip_spread_df", lambda flips: math.inf)
    assert now <= 0.03 < false_pass(), now


def test_a_familys_gains_do_not_hide_its_losses():
    """paired_design_effect is the larger of the difference's own CR2 variance and the gains' plus the losses'
    (each against the matrix-formula CR2), over the i.i.d. variance: where a family's gains and losses move together
    the second is larger, where they trade places between families the first is, and with no families it is 1."""
    rng = np.random.default_rng(2)
    labels = rng.permutation(np.repeat(np.arange(12), 50))
    propensity = rng.gamma(0.5, 2.0, 12)[labels]  # one flip propensity per family drives gains and losses
    base = rng.random(600) < 0.75
    flips = rng.random(600) < np.minimum(1, 0.08 * propensity)
    variant = base ^ flips
    gains, losses = (~base & variant).astype(float), (base & ~variant).astype(float)
    diff = gains - losses
    iid = np.var(diff, ddof=1) / 600
    own, parts = cr2_by_matrices(diff, labels)[0], cr2_by_matrices(gains, labels)[0] + cr2_by_matrices(losses, labels)[0]
    assert parts > 1.5 * own  # a shared propensity: the sample covariance of gains and losses hides variance
    effect, groups = stats.paired_design_effect(base, variant, labels)
    assert groups == 12 and effect == pytest.approx(parts / iid, rel=1e-9)
    assert stats.design_effect(diff, labels)[0] == pytest.approx(max(1.0, own / iid), rel=1e-9)  # the old rule's
    traded = np.where(labels < 6, base & ~flips, base | flips)  # half the families only lose, half only gain
    d = traded.astype(float) - base.astype(float)
    assert stats.paired_design_effect(base, traded, labels)[0] == pytest.approx(
        max(1.0, cr2_by_matrices(d, labels)[0] / (np.var(d, ddof=1) / 600)), rel=1e-9)
    assert stats.paired_design_effect(base, variant, None) == (1.0, 600)
    row = stats.paired_comparison(base, variant, families=labels)
    assert row["design_effect"] == pytest.approx(effect) and row["effective_items"] == pytest.approx(600 / effect)


def test_strongly_clustered_flips_stay_within_the_budget_where_the_differences_own_variance_did_not():
    """600 items in 36 families whose flip propensities vary with coefficient of variation 1.5 (the top fifth of
    the families hold 65 % of the flips), one look at one-sided 2.5 %, a variant whose true drop is the margin: the
    rule passes at most the budget plus two Monte-Carlo standard errors; the difference's own CR2 (the rule before,
    design_effect alone) passed more than that on the same runs."""
    from benchmarks.gate_operating import simulate

    rng = np.random.default_rng(11)
    runs, budget = 600, 0.025
    bound = budget + 2 * math.sqrt(budget * (1 - budget) / runs)
    now = before = 0
    for _ in range(runs):
        base, variant, labels = simulate(rng, 600, -0.05, 0.10, 36, cv=1.5)
        now += stats.paired_comparison(base, variant, families=labels)["ci_low"] >= -0.05
        effect = stats.design_effect(variant.astype(float) - base.astype(float), labels)[0]
        low = stats.tango_interval(np.sum(~base & variant) / effect, np.sum(base & ~variant) / effect, 600 / effect,
                                   0.95, stats.cluster_degrees_of_freedom(labels))[0]
        before += low >= -0.05
    assert now / runs <= bound < before / runs, (now / runs, before / runs)
