"""Paired statistics for one variant against fp16 on the same probe items.

Both models answer the same items, so every number is paired (lm-eval's own stderr is unpaired,
lm-eval issue #3831). The interval of the accuracy difference is Tango's score interval for paired
proportions (Tango 1998, Stat Med 17:891): it inverts the score test, so "the interval's low end is
above -margin" is exactly "the non-inferiority score test rejects at the margin", and it stays honest
with 0-3 discordant items where a percentile bootstrap collapses to a point. Items that come in
families (one template, one kind of math) are not independent: a cluster-robust design effect
(Miller 2024, arXiv 2411.00640) shrinks the counts to their effective size before the interval is
taken (Kish's effective sample size), and with few families the limits use Student's t with one
degree of freedom fewer than there are families (Cameron & Miller 2015). Looks at a growing number of items spend the false-pass rate
with a Lan-DeMets function (Pocock or O'Brien-Fleming type), so adding items where the first look
was undecided keeps the error rate of the whole procedure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def flips(base: np.ndarray, variant: np.ndarray) -> dict:
    """Correct->wrong and wrong->correct counts and rates (Dutta et al. 2024: flips show what equal accuracy hides)."""
    base, variant = np.asarray(base, bool), np.asarray(variant, bool)
    n = len(base)
    lost = int(np.sum(base & ~variant))
    gained = int(np.sum(~base & variant))
    return {"correct_to_wrong": lost, "wrong_to_correct": gained,
            "correct_to_wrong_rate": lost / n if n else math.nan,
            "wrong_to_correct_rate": gained / n if n else math.nan,
            "flip_rate": (lost + gained) / n if n else math.nan}


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of the discordant pairs against 1/2."""
    discordant = lost + gained
    if discordant == 0:
        return 1.0
    return float(stats.binomtest(lost, discordant, 0.5).pvalue)


def tango_statistic(delta: float, gained: float, lost: float, n: float) -> float:
    """Tango's score statistic for H0: P(variant right) - P(fp16 right) = delta.

    gained/lost are the discordant counts (variant right and fp16 wrong / the reverse); the nuisance
    parameter P(lost) is replaced by its maximum-likelihood value under H0 (closed form, Tango 1998 eq. 5).
    Decreasing in delta; counts may be fractional (effective counts under clustering).
    """
    a = 2 * n
    b = -gained - lost + (2 * n - gained + lost) * delta
    c = -lost * delta * (1 - delta)
    q = (math.sqrt(max(b * b - 4 * a * c, 0.0)) - b) / (2 * a)
    variance = n * (2 * q + delta * (1 - delta))
    excess = gained - lost - n * delta
    if variance <= 0:
        return math.copysign(math.inf, excess) if excess else 0.0
    return excess / math.sqrt(variance)


def tango_interval(gained: float, lost: float, n: float, confidence: float = 0.95,
                   df: float | None = None) -> tuple[float, float]:
    """Two-sided score interval of the paired difference (variant - fp16), at `confidence`.

    Each limit is where the score statistic equals -/+ the critical value: the normal quantile, or
    Student's t with `df` degrees of freedom (few item families: Cameron & Miller's small-cluster rule).
    Found by bisection, which cannot fail on a monotone function (60 halvings of (-1, 1) reach 1e-18).
    """
    if n <= 0:
        return math.nan, math.nan
    tail = 1 - (1 - confidence) / 2
    z = float(stats.t.ppf(tail, df) if df else stats.norm.ppf(tail))
    estimate = (gained - lost) / n

    def solve(target: float, lo: float, hi: float) -> float:
        for _ in range(60):
            mid = (lo + hi) / 2
            if tango_statistic(mid, gained, lost, n) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = -1.0 if estimate <= -1 else solve(z, -1.0, estimate)
    high = 1.0 if estimate >= 1 else solve(-z, estimate, 1.0)
    return low, high


def design_effect(diff: np.ndarray, families: Sequence | None) -> tuple[float, int]:
    """(Cluster-robust variance of the mean paired difference / its i.i.d. variance, number of families).

    CR1 variance G/(G-1) * sum_g (sum of residuals in g)^2 / n^2 against s^2/n. Floored at 1: clustering
    is never allowed to narrow an interval. Without families (or with fewer than two) every item is its
    own family and the effect is 1.
    """
    diff = np.asarray(diff, float)
    n = len(diff)
    if families is None or n < 2:
        return 1.0, n
    labels = np.unique(np.asarray([str(f) for f in families]), return_inverse=True)[1]
    groups = int(labels.max()) + 1
    resid = diff - diff.mean()
    iid = float(np.sum(resid**2)) / (n - 1) / n
    if groups < 2 or iid <= 0:
        return 1.0, groups
    sums = np.bincount(labels, weights=resid, minlength=groups)
    robust = groups / (groups - 1) * float(np.sum(sums**2)) / n**2
    return max(1.0, robust / iid), groups


def spent_alpha(fraction: float, alpha: float, kind: str) -> float:
    """Lan-DeMets spending function: false-pass rate spent once `fraction` of the items are in."""
    t = min(max(fraction, 0.0), 1.0)
    if t <= 0:
        return 0.0
    if kind == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    if kind == "obrien_fleming":
        return float(2 * (1 - stats.norm.cdf(stats.norm.ppf(1 - alpha / 2) / math.sqrt(t))))
    raise ValueError(f"unknown spending function {kind!r}")


def look_alphas(looks: Sequence[int], alpha: float, kind: str) -> list[float]:
    """One-sided false-pass rate each look may use; they add up to `alpha` at the last look.

    Each look tests at its own increment (a Bonferroni split of the spent alpha), which is conservative:
    it ignores the correlation between looks, so the procedure's false-pass rate stays at or below alpha.
    """
    if not looks:
        return []
    total = looks[-1]
    spent = [spent_alpha(n / total, alpha, kind) for n in looks]
    return [s - (spent[i - 1] if i else 0.0) for i, s in enumerate(spent)]


def items_to_decide(difference: float, discordance: float, margin: float, alpha: float, power: float,
                    effect: float = 1.0, df: float | None = None, items: int | None = None) -> float | None:
    """Items a paired test needs so that, at the observed difference and discordance, the interval's low
    end clears -margin with probability `power` (one-sided `alpha`): (z_a + z_power)^2 (psi - d^2) / (d + m)^2,
    times the design effect. None when the observed difference is at or below -margin (no number of items
    makes it pass). With `df` (few families) Student's t replaces the normal quantiles; `items` (the count
    judged so far) floors the discordance at 3/items."""
    gap = difference + margin
    if gap <= 0 or not math.isfinite(gap):
        return None
    # no flips seen is not no flips to come: the rule of three bounds the discordance by 3/items
    floor = 3 / items if items else 1e-12
    variance = max(discordance - difference**2, floor)
    quantile = (lambda q: stats.t.ppf(q, df)) if df else stats.norm.ppf
    z = quantile(1 - alpha) + quantile(power)
    return float(effect * z * z * variance / gap**2)


def paired_comparison(base: np.ndarray, variant: np.ndarray, *, families: Sequence | None = None,
                      confidence: float = 0.95) -> dict:
    """Every paired number for one variant and one domain: accuracies, difference, flips, interval."""
    base, variant = np.asarray(base, bool), np.asarray(variant, bool)
    n = len(base)
    flip = flips(base, variant)
    effect, groups = design_effect(variant.astype(float) - base.astype(float), families)
    gained, lost = flip["wrong_to_correct"], flip["correct_to_wrong"]
    # few families: the cluster-robust variance is itself uncertain, so the limits take t with G - 1 degrees
    # of freedom (Cameron & Miller 2015), also when the estimated design effect comes out at 1: with few
    # families that estimate is noisy, and switching to z there let clustered flips pass 5.6 % of the time
    df = groups - 1 if families is not None and 1 < groups < n else None
    low, high = tango_interval(gained / effect, lost / effect, n / effect, confidence, df)
    return {
        "items": n,
        "accuracy_fp16": float(base.mean()) if n else math.nan,
        "accuracy": float(variant.mean()) if n else math.nan,
        # from the counts, so -10/200 is exactly -0.05 and meets a 0.05 margin (no float drift from two means)
        "difference": (int(variant.sum()) - int(base.sum())) / n if n else math.nan,
        "ci_low": low,
        "ci_high": high,
        "confidence": confidence,
        "interval": "tango-score",
        "families": groups,
        "design_effect": effect,
        "degrees_of_freedom": df,
        "effective_items": n / effect if n else 0.0,
        **flip,
        "mcnemar_p": mcnemar_exact(lost, gained),
    }
