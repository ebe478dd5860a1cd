"""Which clustered-variance method the accuracy rule takes, chosen on measured operating characteristics: each
candidate judges the same simulated runs, look by look, at the group-sequential levels the rule uses.

    .venv/bin/python benchmarks/cluster_candidates.py [--runs 1000] [--seed 0] [--workers 2]

Pool: 600 items in 36 families, looks 200/400/600 (params.yaml's spending), margin 0.05, one-sided 2.5 %. Runs are made
by gate_operating.simulate and shuffled (the pool's hash order): at the margin with the families' flip propensities
varying with coefficient of variation 1, 1.5 and 2 (the false-pass rate: budget 2.5 %, goal under clustering 3 %),
and at a 2-point drop with independent items in declared families and with CV 1 (the power); and few_families.py's
pool, 1,000 items in 4 or 8 families, looks 200/600/1000, at the margin with CV 1.5; and the pass rate of a variant as
good as fp16 with very few flips (0.6 % in 4 families, 0.3 % in 36), independent: where a few flips share a family by
chance, which the flips' Satterthwaite count reads as crowding. Candidates:
- rule: the shipped one (stats.paired_comparison, sequential.accuracy_rule): Tango's interval at effective counts,
  design effect max(V(gains - losses), V(gains) + V(losses)) / V_iid, t on the smaller of the Bell-McCaffrey degrees
  of freedom and the flips' Satterthwaite count (stats.flip_spread_df);
- rule-bm: the same on the Bell-McCaffrey degrees of freedom alone (the rule before flip_spread_df);
- before: rule-bm with the difference's own CR2 variance (the rule until this benchmark);
- wild-rademacher / wild-mammen: a wild cluster bootstrap-t with the null imposed (Cameron, Gelbach & Miller 2008;
  1,999 draws, a fixed seed), Rademacher or Mammen weights, on the CR2 t statistic of the difference;
- pairs-t: a pairs cluster bootstrap-t (families resampled, 1,999 draws);
- johnson: the CR2 t statistic corrected for the family totals' skewness (Johnson 1978), t critical values;
- score: a cluster-robust score test, the variance from the families' totals at the null;
- kurtosis-df: the rule's interval with degrees of freedom min(Bell-McCaffrey, 2 (sum a_g)^2 / sum a_g^2), a_g the
  families' CR2 terms (the family totals' kurtosis).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402
from benchmarks.gate_operating import MARGIN, flip_rate_for, simulate, spending  # noqa: E402
from pipelines.judging import sequential, stats  # noqa: E402

POOL, FAMILIES, DRAWS = 600, 36, 1999
CELLS = [("false pass, CV 1", -MARGIN, 1.0, FAMILIES, POOL), ("false pass, CV 1.5", -MARGIN, 1.5, FAMILIES, POOL),
         ("false pass, CV 2", -MARGIN, 2.0, FAMILIES, POOL),
         ("false pass, 4 families, CV 1.5", -MARGIN, 1.5, 4, 1000),  # few_families.py's pool: 1,000 items
         ("false pass, 8 families, CV 1.5", -MARGIN, 1.5, 8, 1000),
         ("pass at -2 points, independent items", -0.02, 0.0, FAMILIES, POOL),
         ("pass at -2 points, CV 1", -0.02, 1.0, FAMILIES, POOL),
         # what the few-families fix costs where a few flips share a family by chance: an equal variant, independent
         ("pass, equal with 0.6 % flips, 4 families", 0.0, 0.0, 4, 1000, 0.006),
         ("pass, equal with 0.3 % flips, 36 families", 0.0, 0.0, FAMILIES, POOL, 0.003)]
PASS, FAIL, OPEN = sequential.PASS, sequential.FAIL, sequential.UNDECIDED


def decide(upper: float, lower: float, alpha: float) -> str:
    """From one-sided p-values (H0: drop >= margin; H0: drop <= margin)."""
    return PASS if upper <= alpha else FAIL if lower <= alpha else OPEN


def interval_rule(base, variant, labels, alpha, effect: float, df: float) -> str:
    gained, lost, n = int(np.sum(~base & variant)), int(np.sum(base & ~variant)), len(base)
    low, high = stats.tango_interval(gained / effect, lost / effect, n / effect, 1 - 2 * alpha, df)
    return PASS if low >= -MARGIN else FAIL if high < -MARGIN else OPEN


def rule(base, variant, labels, alpha):
    return sequential.accuracy_rule(stats.paired_comparison(base, variant, families=labels, confidence=1 - 2 * alpha),
                                    MARGIN)[0]


def rule_bm(base, variant, labels, alpha):
    effect = stats.paired_design_effect(base, variant, labels)[0]
    return interval_rule(base, variant, labels, alpha, effect, stats.cluster_degrees_of_freedom(labels))


def before(base, variant, labels, alpha):
    effect = stats.design_effect(variant.astype(float) - base.astype(float), labels)[0]
    return interval_rule(base, variant, labels, alpha, effect, stats.cluster_degrees_of_freedom(labels))


def kurtosis_df(base, variant, labels, alpha):
    effect = stats.paired_design_effect(base, variant, labels)[0]
    d = variant.astype(float) - base.astype(float)
    sizes = np.bincount(labels).astype(float)
    terms = np.bincount(labels, weights=d - d.mean()) ** 2 / (1 - sizes / len(d))
    df = stats.cluster_degrees_of_freedom(labels)
    if terms.sum() > 0:
        df = min(df, 2 * terms.sum() ** 2 / float(np.sum(terms**2)))
    return interval_rule(base, variant, labels, alpha, effect, df)


def cr2_t(weights: np.ndarray, totals: np.ndarray, sizes: np.ndarray, n: int) -> np.ndarray:
    """CR2 t statistics of the mean for each row of family weights applied to the families' totals of d + margin."""
    shift = weights @ totals / n
    resid = weights * totals[None, :] - shift[:, None] * sizes[None, :]
    variance = np.sum(resid**2 / (1 - sizes / n)[None, :], axis=1) / n**2
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(variance > 0, shift / np.sqrt(variance), np.sign(shift) * np.inf)


WEIGHTS: dict = {}


def weights(kind: str, groups: int) -> np.ndarray:
    """DRAWS x groups bootstrap weights from a fixed seed (the same draws for every run)."""
    if (kind, groups) not in WEIGHTS:
        rng = np.random.default_rng(20261205)
        if kind == "rademacher":
            w = rng.choice([-1.0, 1.0], size=(DRAWS, groups))
        elif kind == "mammen":
            s5 = math.sqrt(5)
            w = np.where(rng.random((DRAWS, groups)) < (s5 + 1) / (2 * s5), -(s5 - 1) / 2, (s5 + 1) / 2)
        else:  # pairs: which family each draw takes
            w = rng.integers(0, groups, size=(DRAWS, groups))
        WEIGHTS[(kind, groups)] = w
    return WEIGHTS[(kind, groups)]


def totals_of(base, variant, labels):
    d = variant.astype(float) - base.astype(float)
    return np.bincount(labels, weights=d + MARGIN), np.bincount(labels).astype(float), len(d)


def wild(kind):
    def candidate(base, variant, labels, alpha):
        totals, sizes, n = totals_of(base, variant, labels)
        observed = cr2_t(np.ones((1, len(totals))), totals, sizes, n)[0]
        drawn = cr2_t(weights(kind, len(totals)), totals, sizes, n)  # the null imposed: residuals about -margin
        return decide((1 + np.sum(drawn >= observed)) / (DRAWS + 1), (1 + np.sum(drawn <= observed)) / (DRAWS + 1),
                      alpha)
    return candidate


def pairs_t(base, variant, labels, alpha):
    d = variant.astype(float) - base.astype(float)
    totals, sizes = np.bincount(labels, weights=d), np.bincount(labels).astype(float)
    groups = len(totals)

    def t_parts(t, s):
        mean = t.sum(-1) / s.sum(-1)
        resid = t - s * mean[..., None]
        return mean, np.sqrt(groups / (groups - 1) * np.sum(resid**2, -1)) / s.sum(-1)

    mean, se = t_parts(totals, sizes)
    observed = (mean + MARGIN) / se if se > 0 else math.copysign(math.inf, mean + MARGIN)
    idx = weights("pairs", groups)
    m, s = t_parts(totals[idx], sizes[idx])
    with np.errstate(divide="ignore", invalid="ignore"):
        drawn = np.where(s > 0, (m - mean) / s, 0.0)
    return decide((1 + np.sum(drawn >= observed)) / (DRAWS + 1), (1 + np.sum(drawn <= observed)) / (DRAWS + 1), alpha)


def johnson(base, variant, labels, alpha):
    totals, sizes, n = totals_of(base, variant, labels)
    mean = totals.sum() / n
    resid = totals - sizes * mean
    variance = np.sum(resid**2 / (1 - sizes / n)) / n**2
    if variance <= 0:
        return PASS if mean > 0 else FAIL if mean < 0 else OPEN
    t = mean / math.sqrt(variance)
    skew = np.sum(resid**3) / n**3 / variance**1.5
    corrected = t + skew / 6 * (1 + 2 * t * t)
    critical = scipy_stats.t.isf(alpha, stats.cluster_degrees_of_freedom(labels))
    return PASS if corrected >= critical else FAIL if corrected <= -critical else OPEN


def score(base, variant, labels, alpha):
    totals, sizes, n = totals_of(base, variant, labels)
    variance = np.sum(totals**2 / (1 - sizes / n))
    z = totals.sum() / math.sqrt(variance) if variance > 0 else math.inf
    critical = scipy_stats.t.isf(alpha, stats.cluster_degrees_of_freedom(labels))
    return PASS if z >= critical else FAIL if z <= -critical else OPEN


CANDIDATES = {"rule": rule, "rule-bm": rule_bm, "before": before, "wild-rademacher": wild("rademacher"), "wild-mammen": wild("mammen"),
              "pairs-t": pairs_t, "johnson": johnson, "score": score, "kurtosis-df": kurtosis_df}


def cell(name: str, difference: float, cv: float, families: int, pool: int, runs: int, seed,
         rate: float | None = None) -> dict:
    """Pass / inconclusive / fail shares of one candidate in one cell; `rate`: the flip rate, else the flip model's."""
    looks = sequential.plan(pool, 200, None, 3)
    alphas = stats.look_alphas(looks, 0.025, spending())
    rng = np.random.default_rng(seed)
    counts = {PASS: 0, OPEN: 0, FAIL: 0}
    for _ in range(runs):
        base, variant, labels = simulate(rng, pool, difference, rate or flip_rate_for(difference), families, cv=cv)
        order = rng.permutation(pool)
        base, variant, labels = base[order], variant[order], labels[order]
        decision = OPEN
        for n, alpha in zip(looks, alphas):
            decision = CANDIDATES[name](base[:n], variant[:n], np.unique(labels[:n], return_inverse=True)[1], alpha)
            if decision != OPEN:
                break
        counts[decision] += 1
    return {k: v / runs for k, v in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    measured.add_arguments(parser, "cluster_candidates")
    args = parser.parse_args()
    seeds = np.random.SeedSequence(args.seed).spawn(len(CELLS))  # every candidate judges the same runs of a cell
    jobs = [(name, what, diff, cv, g, pool, seed, *rate) for name in CANDIDATES
            for (what, diff, cv, g, pool, *rate), seed in zip(CELLS, seeds)]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(cell, *zip(*[(n, d, cv, g, size, args.runs, s, (r or [None])[0])
                                               for n, _, d, cv, g, size, s, *r in jobs])))
    seconds = time.perf_counter() - started
    by = {(name, what): r for (name, what, *_), r in zip(jobs, results)}
    header = ["candidate", *[cell[0] for cell in CELLS]]
    rows = [[name, *[f"{by[(name, cell[0])][PASS]:.3f}" for cell in CELLS]] for name in CANDIDATES]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(row))
    se = math.sqrt(0.025 * 0.975 / args.runs)
    note = (f"{args.runs:,} simulated runs per cell (seed {args.seed}; every candidate judges the same runs), 600 items "
            f"in 36 families, looks 200/400/600 (4 and 8 families: 1,000 items, looks 200/600/1000), {spending()} spending, margin {MARGIN:g}, one-sided 2.5 %; "
            f"Monte-Carlo standard error at 2.5 %: ± {100 * se:.2f} %; {seconds:.0f} s on {args.workers} workers.")
    print(note)
    measured.record(args.record, "cluster_candidates", {"header": header, "rows": rows, "runs": args.runs,
                                                         "seed": args.seed, "seconds": round(seconds, 1)}, note=note)


if __name__ == "__main__":
    main()
