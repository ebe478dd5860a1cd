"""Paired statistics for one variant against fp16 on the same probe items.

Both models answer the same items, so the comparison is paired: the bootstrap resamples items (not
models), McNemar's test looks only at the items where the two disagree, and the detectable difference
comes from the discordance actually seen. lm-eval's own stderr is unpaired (lm-eval issue #3831).
"""

from __future__ import annotations

import math

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


def paired_bootstrap(base: np.ndarray, variant: np.ndarray, resamples: int, seed: int,
                     confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval of mean(variant) - mean(base), resampling items with replacement."""
    diff = np.asarray(variant, float) - np.asarray(base, float)
    n = len(diff)
    if n == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # chunks keep memory flat for large item counts
        stop = min(start + 1000, resamples)
        means[start:stop] = diff[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def detectable_difference(n: int, discordant_rate: float, power: float, confidence: float = 0.95) -> float:
    """Smallest accuracy difference a paired test over n items detects with the given power.

    Normal approximation for paired binary outcomes: the per-item difference has variance
    psi - delta^2 <= psi (psi = discordant share), so delta = (z_{1-a/2} + z_power) * sqrt(psi / n).
    An observed psi of 0 is not taken at face value: the rule of three bounds it below by 3/n.
    """
    if n <= 0:
        return math.inf
    psi = max(discordant_rate, 3.0 / n)
    z = stats.norm.ppf(1 - (1 - confidence) / 2) + stats.norm.ppf(power)
    return float(z * math.sqrt(psi / n))


def paired_comparison(base: np.ndarray, variant: np.ndarray, *, resamples: int, seed: int,
                      confidence: float, power: float) -> dict:
    """Every paired number the verdict needs, for one variant and one domain."""
    base, variant = np.asarray(base, bool), np.asarray(variant, bool)
    n = len(base)
    flip = flips(base, variant)
    low, high = paired_bootstrap(base, variant, resamples, seed, confidence)
    return {
        "items": n,
        "accuracy_fp16": float(base.mean()) if n else math.nan,
        "accuracy": float(variant.mean()) if n else math.nan,
        # from the counts, so -10/200 is exactly -0.05 and meets a 0.05 margin (no float drift from two means)
        "difference": (int(variant.sum()) - int(base.sum())) / n if n else math.nan,
        "ci_low": low,
        "ci_high": high,
        **flip,
        "mcnemar_p": mcnemar_exact(flip["correct_to_wrong"], flip["wrong_to_correct"]),
        "detectable_difference": detectable_difference(n, flip["flip_rate"], power, confidence),
    }
