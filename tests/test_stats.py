"""judging/stats.py against published values and independent implementations (statsmodels, a numerical likelihood,
simulation): alpha spending, McNemar, the Tango interval, the design effect, the power calculation (items in
families, the degrees of freedom and the few-families budget: tests/test_stats_families.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as sps
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.power import NormalIndPower

from pipelines.judging import stats
from tests.handmade import correctness

N = 400


def test_boundaries_match_published_values_and_spend_exactly_alpha():
    """O'Brien-Fleming and Pocock type Lan-DeMets boundaries for three equal looks at one-sided 0.025 (Jennison &
    Turnbull 2000, table 7.6: 3.710, 2.511, 1.993; Pocock type about 2.28-2.30 at every look), and a simulation of
    the correlated looks: the chance of crossing at some look is alpha itself, where the old Bonferroni split of the
    increments spent less (and passed fewer good variants)."""
    assert stats.group_sequential_bounds([1 / 3, 2 / 3, 1], 0.025, "obrien_fleming") == \
        pytest.approx([3.7103, 2.5114, 1.9930], abs=2e-4)
    assert stats.group_sequential_bounds([1 / 3, 2 / 3, 1], 0.025, "pocock") == pytest.approx([2.279, 2.295, 2.296], abs=2e-3)
    rng = np.random.default_rng(0)
    steps = rng.standard_normal((200_000, 4)) * np.sqrt([200, 200, 200, 200])  # score increments of 4 looks
    z = np.cumsum(steps, axis=1) / np.sqrt([200, 400, 600, 800])
    for kind in ("pocock", "obrien_fleming", "hsd:-2", "hsd:1"):
        levels = stats.look_alphas([200, 400, 600, 800], 0.025, kind)
        crossed = (z >= sps.norm.isf(levels)).any(axis=1).mean()
        assert crossed == pytest.approx(0.025, abs=0.0015), kind  # standard error 0.00035
        assert sum(levels) > 0.025  # each look tests at more than its Bonferroni share
    assert stats.look_alphas([400], 0.025, "hsd:-2") == [pytest.approx(0.025)]
    gammas = [stats.look_alphas([200, 400, 600], 0.025, f"hsd:{g}")[0] for g in (-4, -2, 1)]
    assert gammas == sorted(gammas)  # larger gamma spends more early
    with pytest.raises(ValueError, match="unknown spending"):
        stats.spent_alpha(0.5, 0.025, "hsd:abc")


def test_wilson_lower_limit_matches_statsmodels():
    from statsmodels.stats.proportion import proportion_confint

    for k, n in ((0, 50), (13, 50), (150, 200), (200, 200)):
        assert stats.lower_limit(k / n, n, 0.95) == pytest.approx(proportion_confint(k, n, 0.05, "wilson")[0], abs=1e-9)


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


def tango_by_likelihood(gained, lost, n, confidence=0.95):
    """An independent Tango interval: the nuisance parameter maximised numerically, the limits by brentq."""
    z = sps.norm.ppf(1 - (1 - confidence) / 2)
    cells = np.array([gained, lost, n - gained - lost], float)  # (variant only right, fp16 only right, agree)

    def statistic(delta):
        def nll(q):  # P(lost) = q, P(gained) = q + delta, P(agree) = 1 - 2q - delta
            probs = np.array([q + delta, q, 1 - 2 * q - delta])
            return -np.sum(cells[probs > 0] * np.log(probs[probs > 0])) if np.all(probs >= 0) else np.inf
        lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12
        q = optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
        return (gained - lost - n * delta) / math.sqrt(n * (2 * q + delta - delta * delta))

    d = (gained - lost) / n
    low = optimize.brentq(lambda x: statistic(x) - z, -1 + 1e-9, d) if d > -1 else -1.0
    high = optimize.brentq(lambda x: statistic(x) + z, d, 1 - 1e-9) if d < 1 else 1.0
    return low, high


@pytest.mark.parametrize("gained,lost,n", [(1, 7, 21), (6, 16, 161), (0, 3, 200), (5, 5, 200), (12, 30, 600)])
def test_tango_interval_matches_an_independent_likelihood_implementation(gained, lost, n):
    assert stats.tango_interval(gained, lost, n) == pytest.approx(tango_by_likelihood(gained, lost, n), abs=2e-6)


def test_tango_interval_reproduces_the_published_worked_example():
    """Bentur et al. (airway hyper-responsiveness before/after transplant, table [[1, 1], [7, 12]]), the
    worked example of Fagerland, Lydersen & Laake (2014, Stat Methods Med Res; also their 2017 book, ch. 8):
    Tango asymptotic score interval -0.286 (-0.517 to -0.026)."""
    low, high = stats.tango_interval(gained=1, lost=7, n=21)
    assert (round(low, 3), round(high, 3)) == (-0.517, -0.026)
    z = sps.norm.ppf(0.975)
    assert stats.tango_interval(0, 0, 200) == pytest.approx((-z * z / (200 + z * z), z * z / (200 + z * z)))


def test_tango_interval_holds_its_coverage_with_few_discordant_pairs():
    """2,000 simulated probe sets of 200 items with 1 % discordance (0-3 flips typical): the 95 % interval
    covers the true difference at least 93 % of the time (the percentile bootstrap: far less)."""
    rng = np.random.default_rng(5)
    p_gain, p_loss, n, covered = 0.004, 0.006, 200, 0
    for _ in range(2000):
        counts = rng.multinomial(n, [p_gain, p_loss, 1 - p_gain - p_loss])
        low, high = stats.tango_interval(counts[0], counts[1], n)
        covered += low <= p_gain - p_loss <= high
    assert covered / 2000 >= 0.93


def clustered_coverage(families: int, per_family: int, runs: int, use_families: bool) -> float:
    """Share of simulated probe sets whose 95 % interval covers the true difference, when flips cluster:
    each family's loss propensity is drawn anew (gamma, mean 0.05, CV 1), gains are 2 % everywhere."""
    rng = np.random.default_rng(11)
    labels = np.repeat(np.arange(families), per_family)
    true, covered = 0.02 - 0.98 * 0.05, 0
    for _ in range(runs):
        propensity = rng.gamma(1.0, 0.05, families)
        gained = rng.random(labels.size) < 0.02
        lost = (rng.random(labels.size) < propensity[labels]) & ~gained
        r = stats.paired_comparison(~gained, ~lost, families=labels if use_families else None)
        covered += r["ci_low"] <= true <= r["ci_high"]
    return covered / runs


@pytest.mark.parametrize("families, per_family", [(8, 25), (12, 20)])
def test_the_clustered_interval_holds_its_coverage_where_the_plain_one_does_not(families, per_family):
    """The truth here is the simulation's, not the code's: an independent check of the design effect and t."""
    assert clustered_coverage(families, per_family, 1000, use_families=True) >= 0.94
    assert clustered_coverage(families, per_family, 1000, use_families=False) < 0.91  # what families are for


def test_design_effect_matches_statsmodels_cluster_robust_variance():
    import statsmodels.api as sm

    rng = np.random.default_rng(3)
    families = np.repeat(np.arange(8), 25)
    family_loss = rng.uniform(0, 0.3, 8)
    diff = -(rng.random(200) < family_loss[families]).astype(float) + (rng.random(200) < 0.03)
    ols = sm.OLS(diff, np.ones(200))
    robust = ols.fit(cov_type="cluster", cov_kwds={"groups": families}).bse[0] ** 2
    naive = ols.fit().bse[0] ** 2
    effect, groups = stats.design_effect(diff, families)
    assert groups == 8 and effect == pytest.approx(max(1.0, robust / naive), rel=1e-9)
    assert stats.design_effect(diff, None) == (1.0, 200)
    assert stats.design_effect(np.zeros(50), families[:50])[0] == 1.0


def test_clustered_flips_widen_the_interval():
    base = np.array(correctness(N, 300))
    variant = base.copy()
    variant[:20] = False  # every loss in one family: the items are not 400 independent ones
    families = [f"f{i // 50}" for i in range(N)]
    plain = stats.paired_comparison(base, variant)
    clustered = stats.paired_comparison(base, variant, families=families)
    assert clustered["design_effect"] > 2 and clustered["ci_low"] < plain["ci_low"] - 0.01
    spread = [f"f{i % 8}" for i in range(N)]  # the same losses spread over every family: no widening
    assert stats.paired_comparison(base, variant, families=spread)["design_effect"] == pytest.approx(1.0, abs=0.2)


@pytest.mark.parametrize("difference,psi", [(0.0, 0.075), (-0.02, 0.1), (0.02, 0.12)])
def test_items_to_decide_have_the_configured_power(difference, psi):
    n = stats.items_to_decide(difference, psi, margin=0.05, alpha=0.025, power=0.8)
    effect = (difference + 0.05) / math.sqrt(psi - difference**2)
    power = NormalIndPower().power(effect_size=effect, nobs1=n, alpha=0.025, ratio=0, alternative="larger")
    assert power == pytest.approx(0.8, abs=1e-3)
    assert stats.items_to_decide(-0.05, 0.1, 0.05, 0.025, 0.8) is None


def test_accuracy_and_flip_rates_match_numpy():
    base, variant = paired_sample(4)
    row = stats.paired_comparison(base, variant)
    assert row["accuracy"] == np.mean(variant) and row["accuracy_fp16"] == np.mean(base)
    assert row["difference"] == pytest.approx(np.mean(variant) - np.mean(base), abs=1e-15)
    assert row["flip_rate"] == pytest.approx(np.mean(base != variant))
