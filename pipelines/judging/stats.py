"""Paired statistics for one variant against fp16 on the same probe items.

Both models answer the same items, so every number is paired (lm-eval's own stderr is unpaired,
lm-eval issue #3831). The interval of the accuracy difference is Tango's score interval for paired
proportions (Tango 1998, Stat Med 17:891): it inverts the score test, so "the interval's low end is
above -margin" is exactly "the non-inferiority score test rejects at the margin", and it stays honest
with 0-3 discordant items where a percentile bootstrap collapses to a point. Items that come in
families (one template, one kind of math) are not independent: a cluster-robust (CR2) design effect
(Miller 2024, arXiv 2411.00640; Bell & McCaffrey 2002), in which a family's gains cannot cancel its losses
(paired_design_effect), shrinks the counts to their effective size before the interval is taken (Kish's effective
sample size), and the limits use Student's t with the Bell-McCaffrey degrees
of freedom (G - 1 for G equal families, fewer when one family dominates; Imbens & Kolesar 2016), or fewer still when
the flips crowd into a few families (flip_spread_df; Satterthwaite 1946). One family
leaves no between-family variance to estimate: zero degrees of freedom, the interval is all of [-1, 1], and the
rule cannot pass. Looks at a growing number of items spend the false-pass rate
with a spending function (Lan & DeMets 1983; Hwang, Shih & DeCani 1990) through group-sequential boundaries
computed for correlated looks (Jennison & Turnbull 2000), so adding items where the first look was undecided
keeps the error rate of the whole procedure, and spends all of it.
"""

from __future__ import annotations

import functools
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
    """Two-sided exact McNemar p-value: a binomial test of the discordant pairs against 1/2. Binomial(d, 1/2) is
    symmetric, so the two-sided p is 2 P(X <= min(lost, gained)), capped at 1, in exact integers (scipy's
    binomtest gives the same number at forty times the cost, most of a simulated judgement's time)."""
    discordant = lost + gained
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, i) for i in range(min(lost, gained) + 1))
    return min(1.0, 2 * tail / 2**discordant)


def tango_variance(delta: float, gained: float, lost: float, n: float) -> float:
    """Variance of gained - lost under H0: difference = delta, with the nuisance parameter P(lost) at its
    maximum-likelihood value under H0 (closed form, Tango 1998 eq. 5). Counts may be fractional."""
    a = 2 * n
    b = -gained - lost + (2 * n - gained + lost) * delta
    c = -lost * delta * (1 - delta)
    q = (math.sqrt(max(b * b - 4 * a * c, 0.0)) - b) / (2 * a)
    return n * (2 * q + delta * (1 - delta))


def tango_statistic(delta: float, gained: float, lost: float, n: float) -> float:
    """Tango's score statistic for H0: P(variant right) - P(fp16 right) = delta.

    gained/lost are the discordant counts (variant right and fp16 wrong / the reverse); the variance is taken
    under H0 (tango_variance). Decreasing in delta; counts may be fractional (effective counts under clustering).
    """
    variance = tango_variance(delta, gained, lost, n)
    excess = gained - lost - n * delta
    if variance <= 0:
        return math.copysign(math.inf, excess) if excess else 0.0
    return excess / math.sqrt(variance)


def tango_interval(gained: float, lost: float, n: float, confidence: float = 0.95,
                   df: float | None = None) -> tuple[float, float]:
    """Two-sided score interval of the paired difference (variant - fp16), at `confidence`.

    Each limit is where the score statistic equals -/+ the critical value: the normal quantile, or
    Student's t with `df` degrees of freedom (item families: the Bell-McCaffrey degrees of freedom).
    Found by bisection, which cannot fail on a monotone function (60 halvings of (-1, 1) reach 1e-18).
    `df` <= 0 (one family: no between-family variance) bounds nothing: the interval is [-1, 1].
    """
    if n <= 0:
        return math.nan, math.nan
    if df is not None and df <= 0:
        return -1.0, 1.0
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


def _family_labels(families: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(each item's family index, each family's size)."""
    labels = np.unique(np.asarray([str(f) for f in families]), return_inverse=True)[1].reshape(-1)
    return labels, np.bincount(labels)


def cluster_robust_variance(values: np.ndarray, labels: np.ndarray, sizes: np.ndarray) -> float:
    """CR2 variance of the mean of `values` (Bell & McCaffrey 2002): sum_g s_g^2 / (1 - n_g/n) / n^2, s_g the
    family's sum of residuals. With equal families it is CR1's G/(G-1) * sum_g s_g^2 / n^2 exactly; with unequal
    ones CR1 under-states the variance of a dominant family."""
    n = len(values)
    sums = np.bincount(labels, weights=values - values.mean(), minlength=len(sizes))
    return float(np.sum(sums**2 / (1 - sizes / n))) / n**2


def design_effect(diff: np.ndarray, families: Sequence | None, *, parts: Sequence[np.ndarray] = ()) -> tuple[float, int]:
    """(Cluster-robust variance of the mean of `diff` / its i.i.d. variance, number of families).

    `parts`: series that sum to `diff` (a paired difference's gains and losses): the robust variance is then the
    larger of diff's own and the sum of the parts' (paired_design_effect says why). Floored at 1: clustering never
    narrows an interval. Without families every item is its own family (effect 1). One family holding every item:
    effect n (it may all share one fate, one effective item); its interval is not taken from this number
    (paired_comparison: zero degrees of freedom).
    """
    diff = np.asarray(diff, float)
    n = len(diff)
    if families is None or n < 2:
        return 1.0, n
    labels, sizes = _family_labels(families)
    groups = len(sizes)
    if groups < 2:
        return float(n), groups
    iid = float(np.sum((diff - diff.mean()) ** 2)) / (n - 1) / n
    if iid <= 0:
        return 1.0, groups
    robust = cluster_robust_variance(diff, labels, sizes)
    if parts:
        robust = max(robust, sum(cluster_robust_variance(np.asarray(p, float), labels, sizes) for p in parts))
    return max(1.0, robust / iid), groups


def paired_design_effect(base: np.ndarray, variant: np.ndarray, families: Sequence | None) -> tuple[float, int]:
    """Design effect of the paired difference, in which a family's gains cannot hide its losses.

    The difference is gains - losses, so its robust variance is V(gains) + V(losses) - 2 C, C the covariance of the
    families' gain and loss totals. When one flip propensity drives both (a family the quantization unsettles flips
    both ways, the clustered case), C > 0 and the sample's C is what makes a pool whose worst families happened to
    break little look tighter than it is: at 36 families whose flip propensities have coefficient of variation 1.5,
    the difference's own CR2 passed a variant whose true drop is the margin 4.2 % of the time (budget 2.5 %), this
    one 2.3 % (benchmarks/cluster_candidates.py). So C counts only when it widens the interval (C < 0: the variant loses
    in some families and gains in others); with independent items C is about 0 and nothing changes."""
    base, variant = np.asarray(base, bool), np.asarray(variant, bool)
    gains, losses = (~base & variant).astype(float), (base & ~variant).astype(float)
    return design_effect(gains - losses, families, parts=(gains, -losses))


def cluster_degrees_of_freedom(families: Sequence) -> float:
    """Bell-McCaffrey degrees of freedom of the CR2 variance of a mean: (sum lambda)^2 / sum lambda^2 over the
    eigenvalues of the G x G matrix whose quadratic form in i.i.d. errors that variance is. G - 1 for equal
    families, fewer when sizes differ (one family of 195 items and five singletons: about 1), 0 for one family.
    Depends on the family sizes only, so it is known before any item is scored (the rule may take fewer:
    flip_spread_df)."""
    return bell_mccaffrey_df(_family_labels(families)[1])


def bell_mccaffrey_df(sizes: np.ndarray) -> float:
    """cluster_degrees_of_freedom from the family sizes. The matrix is m = (diag(n_g) - n n^T / N) * s s^T with
    s_g^2 = 1 / (1 - n_g/N): sum lambda = trace(m) = N, and sum lambda^2 = |m|_F^2 = sum n_g^2 + ((sum n_g^2 s_g^2)^2
    - sum n_g^4 s_g^4) / N^2 in closed form, O(G) rather than a G x G matrix (a pool of 100,000 single items)."""
    sizes = np.asarray(sizes, float)
    if len(sizes) < 2:
        return 0.0
    n = float(sizes.sum())
    weighted = sizes**2 / (1 - sizes / n)
    frobenius = float(np.sum(sizes**2) + (np.sum(weighted) ** 2 - np.sum(weighted**2)) / n**2)
    return n * n / frobenius


def flip_spread_df(flips_per_family: np.ndarray) -> float:
    """Degrees of freedom the paired variance has when the flips crowd into a few families (inf when they do not).

    Bell-McCaffrey's count assumes every family's items vary alike. When a quantization breaks a few families and
    leaves the rest alone, the CR2 variance rests on those few families' totals: with 4-8 families whose flip
    propensities vary with coefficient of variation 1.5, t on G - 1 passed a variant whose true drop is the margin
    3.4-3.7 % of the time (budget 2.5 %; benchmarks/few_families.py). Satterthwaite's count for a working model in
    which family g's total varies with its expected flips mu_g is (sum mu)^2 / sum mu^2. A family's flip count f is
    near Poisson (E f^2 = mu^2 + mu), so ((sum f)^2 - sum f) / (sum f^2 - sum f) estimates it without the
    downward bias of plugging f in, which would cut the count wherever families hold a flip or two; scaled by
    (G - 1) / G so that flips spread as evenly as chance gives Bell-McCaffrey's G - 1, floored at 1. No family
    with two flips: nothing says they crowd (inf). The rule takes the smaller of this and Bell-McCaffrey's."""
    f = np.asarray(flips_per_family, float)
    groups, total = len(f), float(f.sum())
    excess = float(np.sum(f * f)) - total
    if groups < 2 or excess <= 0:
        return math.inf
    return max(1.0, (total * total - total) / excess * (groups - 1) / groups)


def spent_alpha(fraction: float, alpha: float, kind: str) -> float:
    """Spending function: the false-pass rate spent once `fraction` of the items are in.

    `pocock` and `obrien_fleming`: Lan & DeMets (1983); `hsd:<gamma>`: Hwang, Shih & DeCani (1990),
    alpha (1 - e^(-gamma t)) / (1 - e^(-gamma)), between the two (gamma -4 is close to O'Brien-Fleming, 1 to Pocock).
    """
    t = min(max(fraction, 0.0), 1.0)
    if t <= 0:
        return 0.0
    if kind == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    if kind == "obrien_fleming":
        return float(2 * (1 - stats.norm.cdf(stats.norm.ppf(1 - alpha / 2) / math.sqrt(t))))
    gamma = spending_gamma(kind)
    return alpha * t if gamma == 0 else alpha * (1 - math.exp(-gamma * t)) / (1 - math.exp(-gamma))


def spending_gamma(kind: str) -> float:
    """gamma of an `hsd:<gamma>` spending function; ValueError for any other name."""
    name, _, value = kind.partition(":")
    try:
        gamma = float(value) if name == "hsd" else math.nan
    except ValueError:
        gamma = math.nan
    if not math.isfinite(gamma) or not -10 <= gamma <= 10:
        raise ValueError(f"unknown spending function {kind!r} (pocock, obrien_fleming or hsd:<gamma>, -10 <= gamma <= 10)")
    return gamma


GRID = 801  # points of the numerical integration: the boundaries agree with published tables to 1e-4


def group_sequential_bounds(fractions: Sequence[float], alpha: float, kind: str) -> list[float]:
    """One-sided critical values c_k of correlated looks: under the null, P(Z_1 < c_1, ..., Z_{k-1} < c_{k-1},
    Z_k >= c_k) is the spending function's increment at look k, so the looks together spend exactly `alpha`.

    Z_k is the standardized statistic on the first fraction t_k of the items; its score S_k = Z_k sqrt(t_k)
    has independent normal increments (Jennison & Turnbull 2000, ch. 19: recursive numerical integration of
    the sub-density of S_k on the continuation region). A look that spends nothing gets c = inf. For three
    equal looks at 0.025, O'Brien-Fleming type gives 3.710, 2.511, 1.993 (the published values).
    """
    from scipy import optimize

    bounds, spent_before, t_before = [], 0.0, 0.0
    grid = density = None
    for k, t in enumerate(fractions):
        increment = spent_alpha(t, alpha, kind) - spent_before
        spent_before += max(increment, 0.0)
        if k == 0:
            c = float(stats.norm.isf(increment)) if increment > 0 else math.inf
            top = c * math.sqrt(t) if math.isfinite(c) else 10 * math.sqrt(t)
            grid = np.linspace(-10 * math.sqrt(t), top, GRID)
            density = stats.norm.pdf(grid / math.sqrt(t)) / math.sqrt(t)
        else:
            step = math.sqrt(t - t_before)
            weights = np.full(GRID, grid[1] - grid[0])
            weights[[0, -1]] /= 2  # trapezoid rule
            mass = weights * density

            def excess(c: float) -> float:
                return float(np.sum(mass * stats.norm.sf((c * math.sqrt(t) - grid) / step))) - increment

            c = optimize.brentq(excess, -10, 40, xtol=1e-10) if increment > 0 else math.inf
            top = c * math.sqrt(t) if math.isfinite(c) else grid[-1] + 10 * step
            new = np.linspace(grid[0] - 6 * step, top, GRID)
            density = stats.norm.pdf((new[:, None] - grid[None, :]) / step) / step @ mass
            grid = new
        bounds.append(c)
        t_before = t
    return bounds


def look_alphas(looks: Sequence[int], alpha: float, kind: str) -> list[float]:
    """Nominal one-sided level of each look: 1 - Phi(c_k) of the group-sequential boundary (group_sequential_bounds),
    which accounts for the correlation between looks (they share items), so the looks together pass a variant whose
    true drop is the margin with probability alpha, not less. The looks are at n_k / n_K of the last look's items."""
    return list(_look_alphas(tuple(looks), alpha, kind))


@functools.lru_cache(maxsize=256)
def _look_alphas(looks: tuple[int, ...], alpha: float, kind: str) -> tuple[float, ...]:
    """(cached: the integration takes tens of milliseconds and depends only on the plan)"""
    if not looks:
        return ()
    total = looks[-1]
    return tuple(float(stats.norm.sf(c)) for c in group_sequential_bounds([n / total for n in looks], alpha, kind))


def lower_limit(accuracy: float, items: float, confidence: float) -> float:
    """Low end of the Wilson score interval of a proportion (two-sided `confidence`); `items` may be an effective,
    fractional count (clustered items)."""
    if items <= 0 or not math.isfinite(accuracy):
        return math.nan
    if accuracy <= 0:  # exactly 0, as the formula is: its floating-point rounding (about 1e-18) would read as signal
        return 0.0
    z = float(stats.norm.ppf(1 - (1 - confidence) / 2))
    centre = accuracy + z * z / (2 * items)
    spread = z * math.sqrt(accuracy * (1 - accuracy) / items + z * z / (4 * items * items))
    return max(0.0, (centre - spread) / (1 + z * z / items))


def items_to_decide(difference: float, discordance: float, margin: float, alpha: float, power: float,
                    effect: float = 1.0, df: float | None = None, items: int | None = None) -> float | None:
    """Items a paired test needs so that, at the observed difference and discordance, the interval's low
    end clears -margin with probability `power` (one-sided `alpha`): (z_a + z_power)^2 (psi - d^2) / (d + m)^2,
    times the design effect. None when the observed difference is at or below -margin (no number of items
    makes it pass). With `df` (few families) Student's t replaces the normal quantiles; `items` (the count
    judged so far) floors the discordance at 3/items."""
    gap = difference + margin
    if gap <= 0 or not math.isfinite(gap) or (df is not None and df <= 0):
        return None  # (df <= 0: one family, no number of its items decides)
    # no flips seen is not no flips to come: the rule of three bounds the discordance by 3/items
    floor = 3 / items if items else 1e-12
    variance = max(discordance - difference**2, floor)
    quantile = (lambda q: stats.t.ppf(q, df)) if df is not None else stats.norm.ppf
    z = quantile(1 - alpha) + quantile(power)
    return float(effect * z * z * variance / gap**2)


def paired_comparison(base: np.ndarray, variant: np.ndarray, *, families: Sequence | None = None,
                      confidence: float = 0.95) -> dict:
    """Every paired number for one variant and one domain: accuracies, difference, flips, interval."""
    base, variant = np.asarray(base, bool), np.asarray(variant, bool)
    n = len(base)
    flip = flips(base, variant)
    effect, groups = paired_design_effect(base, variant, families)
    gained, lost = flip["wrong_to_correct"], flip["correct_to_wrong"]
    # families: the cluster-robust variance is itself uncertain, so the limits take t with the Bell-McCaffrey
    # degrees of freedom (G - 1 for equal families), or fewer when the flips crowd into a few families
    # (flip_spread_df), also when the estimated design effect comes out at 1: with few families that estimate is
    # noisy, and switching to z there let clustered flips pass 5.6 % of the time. One family: 0 degrees of
    # freedom, the interval is [-1, 1] (within-family variation says nothing about how another family would
    # fare). Every item its own family: independent items, z.
    df = sizes_df = None
    if families is not None and groups < n:
        labels, sizes = _family_labels(families)
        spread = flip_spread_df(np.bincount(labels, weights=(base != variant).astype(float), minlength=len(sizes)))
        by_sizes = bell_mccaffrey_df(sizes)
        df, sizes_df = round(min(by_sizes, spread), 6), round(by_sizes, 6)
    # (rounded: compare.json's number gives the same interval when taken again)
    low, high = tango_interval(gained / effect, lost / effect, n / effect, confidence, df)
    # fp16's own accuracy, low end at the same confidence over its effective items: is there a signal to lose?
    base_effect = design_effect(base.astype(float), families)[0] if families is not None and groups < n else 1.0
    return {
        "items": n,
        "accuracy_fp16": float(base.mean()) if n else math.nan,
        "accuracy_fp16_low": lower_limit(float(base.mean()), n / base_effect, confidence) if n else math.nan,
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
        "degrees_of_freedom_sizes": sizes_df,  # Bell-McCaffrey's: what df is when the flips do not crowd
        "effective_items": n / effect if n else 0.0,
        **flip,
        "mcnemar_p": mcnemar_exact(lost, gained),
    }
