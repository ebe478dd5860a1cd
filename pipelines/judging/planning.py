"""Before anything is evaluated: how often a request type's looks would pass a variant a little worse than fp16, and
how many items would make that often enough.

The accuracy rule keeps its false-pass budget first, so a pool too small for the drops real checkpoints have leaves
them `inconclusive`. `quantgate doctor` and compare.json's `planning` say so from the pool alone: for the planning
variant of `compare.planning` (a drop inside the row's margin, a flip rate, a within-family correlation of flips) the
chance that the looks pass it, and the pool size at which that chance reaches `compare.planning.power` (None when
no number of items does: the families' shared fate caps what items can show, and more families are needed).

The model is the rule's own large-sample form: at look k the difference has variance (psi - d^2) deff_k / n_k with
deff_k = 1 + (m_k - 1) icc (m_k the size-weighted mean family size of the look's items; the rule's estimate of it
is floored at 1, which costs declared families some power even when items are independent), the looks are nested (each
look's estimate is the next one's plus an independent part), and look k passes when the difference clears -margin
by the look's critical value (stats.look_alphas; Student's t on the Bell-McCaffrey degrees of freedom, which the rule
cuts where flips crowd into few families, stats.flip_spread_df: under one icc they crowd only by chance) times its
standard error under the null (Tango's variance at -margin). A fixed seed makes it the same number on every machine;
benchmarks/gate_operating.py prints it beside the simulated pass rate of the rule itself.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats

from pipelines.judging import sequential, stats

DRAWS = 40_000  # Monte-Carlo draws of the looks' estimates: standard error under 0.0025 on a pass rate
MAX_ITEMS = 100_000  # the search for the items a target power needs stops here ...
PLATEAU = 8  # ... or where 8 steps of 10 % more items raised the pass rate by less than 0.005 (families cap it)


def look_family_sizes(order: Sequence[str], families: dict[str, str] | None, looks: Sequence[int]) -> list[np.ndarray]:
    """Each look's family sizes: the families of the first n_k items in pool order (every item its own family
    without families)."""
    out = []
    for n in looks:
        ids = order[:n]
        counts = Counter(families[i] for i in ids) if families else Counter(ids)
        out.append(np.array(sorted(counts.values()), float))
    return out


def floored_effect(effect: float, df: float) -> float:
    """E[max(1, estimated design effect)] when the estimate is effect x chi2_df / df: the rule floors its estimate at
    1, so with families declared even independent items pay for the estimate's noise (closed form:
    P(W <= 1/effect) + effect P(chi2_{df+2} > df/effect))."""
    if df <= 0:
        return effect
    w = df / effect
    return float(scipy_stats.chi2.cdf(w, df) + effect * scipy_stats.chi2.sf(w, df + 2))


def pass_rate(looks: Sequence[int], sizes: Sequence[np.ndarray], *, drop: float, flip_rate: float, icc: float,
              margin: float, alpha: float, spending: str) -> float:
    """Chance that the looks pass a variant `drop` below fp16 that flips `flip_rate` of the items, when each kind of
    flip (gains, losses) shares a family with correlation `icc`. `sizes`: each look's family sizes
    (look_family_sizes).

    One design effect, 1 + (m - 1) icc (floored at 1 as the rule floors its estimate), for both the estimate's spread
    and the interval's width. Under one flip propensity per family the difference itself clusters less than each
    kind of flip, but the rule's own estimate of the effect then varies from pool to pool, and its low draws are
    where it passes; the two roughly cancel. Taking the difference's smaller correlation for the spread alone put the
    plan up to 21 points under the simulated pass rate at a 2-point drop in benchmarks/gate_operating.py's clustered
    cells, where this one is within 2.6 points (the rule's cut of the degrees of freedom where flips crowd,
    stats.flip_spread_df, is not modelled: for equal variants under strong clustering it promises up to 8 points more)."""
    if not looks:
        return 0.0
    delta = -drop
    gained, lost = (flip_rate + delta) / 2, (flip_rate - delta) / 2
    if min(gained, lost) < 0:
        raise ValueError(f"flip rate {flip_rate} is below the drop {drop}: a drop needs at least as many flips")
    null_variance = stats.tango_variance(-margin, gained, lost, 1.0)
    variance = flip_rate - delta**2
    alphas = stats.look_alphas(list(looks), alpha, spending)
    se_alt, se_null, critical = [], [], []
    for n, size, a in zip(looks, sizes, alphas):
        independent = len(size) == n  # every item its own family: the rule takes z
        df = None if independent else stats.bell_mccaffrey_df(size)
        mean_size = float(np.sum(size**2)) / n  # size-weighted: the family an item is in, on average
        effect = 1.0 if independent else floored_effect(1 + (mean_size - 1) * icc, df)
        se_alt.append(math.sqrt(variance * effect / n))
        se_null.append(math.sqrt(null_variance * effect / n))
        if df is not None and df <= 0:
            critical.append(math.inf)  # one family: the rule cannot pass
        else:
            critical.append(float(scipy_stats.t.isf(a, df) if df else scipy_stats.norm.isf(a)))
    # nested looks: estimate_k = estimate_K + independent noise with variance se_k^2 - se_{k+1}^2 (backwards in k)
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((DRAWS, len(looks)))
    estimate = np.empty((DRAWS, len(looks)))
    estimate[:, -1] = delta + se_alt[-1] * noise[:, -1]
    for k in range(len(looks) - 2, -1, -1):
        estimate[:, k] = estimate[:, k + 1] + math.sqrt(max(se_alt[k] ** 2 - se_alt[k + 1] ** 2, 0.0)) * noise[:, k]
    passed = np.zeros(DRAWS, bool)
    failed = np.zeros(DRAWS, bool)
    for k in range(len(looks)):
        open_ = ~(passed | failed)
        passed |= open_ & (estimate[:, k] + margin >= critical[k] * se_null[k])
        failed |= open_ & (estimate[:, k] + margin < -critical[k] * se_null[k])
    return float(passed.mean())


def scaled_sizes(sizes: np.ndarray, pool: int, looks: Sequence[int]) -> list[np.ndarray]:
    """A larger pool's looks: its families grown in the same shares, its single items (items without a family, each
    its own) grown in number, so each look's sizes add up to about its items."""
    sizes = np.asarray(sizes, float)
    families, singles = sizes[sizes > 1], int(np.sum(sizes == 1))
    return [np.concatenate([np.maximum(1.0, np.round(families * n / pool)), np.ones(round(singles * n / pool))])
            for n in looks]


def items_for_power(rate_at, start: int, start_rate: float, power: float) -> tuple[int | None, str | None]:
    """(The smallest pool size, from `start` up in 10 % steps rounded to 50 items, whose rate_at(n) reaches `power`;
    what stopped the search when none did: "families" where 8 steps raised the rate by less than 0.005, "items" at
    MAX_ITEMS.) `start_rate`: rate_at(start), already known."""
    if start_rate >= power:
        return start, None
    n, rates = start, [start_rate]
    while n < MAX_ITEMS:
        if len(rates) > PLATEAU and rates[-1] <= rates[-1 - PLATEAU] + 0.005:
            return None, "families"
        n = math.ceil(n * 1.1 / 50) * 50
        rates.append(rate_at(n))
        if rates[-1] >= power:
            return n, None
    return None, "items"


def pool_plan(row: str, plan: dict, p, look_items: int, max_looks: int) -> dict:
    """For one row's plan (evaluation.plans.probe_plans): the planning variant's pass rate with the row's looks (and
    with independent items), and the items that reach compare.planning.power: the looks' cap when it already does,
    else the smallest larger pool (items_for_power; the same families in the same shares, looks of look_items up to
    max_looks) that does. `p`: CompareParams."""
    g = p.planning
    margin = p.policy_for(plan.get("domain") or row).max_accuracy_drop
    looks = plan["looks"]
    drop = g.drop_of_margin * margin
    kw = dict(drop=drop, flip_rate=max(g.flip_rate, drop), margin=margin, alpha=p.alpha, spending=p.spending)
    sizes = look_family_sizes(plan["order"], plan["families"], looks)
    rate = pass_rate(looks, sizes, icc=g.icc, **kw)
    independent = pass_rate(looks, [np.ones(n) for n in looks], icc=0.0, **kw)
    whole = sizes[-1] if sizes else np.array([])

    def grown(n: int) -> float:
        trial = sequential.plan(n, look_items, None, max_looks)
        return pass_rate(trial, scaled_sizes(whole, looks[-1], trial), icc=g.icc, **kw)

    needed, limit = items_for_power(grown, looks[-1], rate, g.power) if looks else (None, "empty")
    return {"items": looks[-1] if looks else 0, "drop": round(drop, 6), "families": int(len(whole)),
            "pass_rate": round(rate, 3), "pass_rate_independent": round(independent, 3), "items_for_power": needed,
            # why none was found: "families" (the rate stopped rising), "items" (MAX_ITEMS), "empty" (no items)
            "short_of": limit}


def observed_icc(paired: dict | None, plan: dict) -> float | None:
    """The within-family correlation a judged row showed, in compare.planning.icc's terms: (design effect - 1) /
    (m - 1), m the size-weighted mean family size of the items it was judged on (0 where the floored design effect
    is 1; None without paired numbers, flips or families: nothing to measure it on)."""
    if not paired or not paired.get("items") or not paired.get("flip_rate"):
        return None
    size = look_family_sizes(plan["order"], plan["families"], [paired["items"]])[0]
    mean_size = float(np.sum(size**2)) / paired["items"]
    return round((paired["design_effect"] - 1) / (mean_size - 1), 4) if mean_size > 1 else None


def plan_all(plans: dict[str, dict], p, look_items: int, max_looks: int, report: dict | None = None) -> dict:
    """compare.json's `planning`: the assumptions and every row's pool_plan; with compare's report, also each judged
    variant's observed_icc per row (what a team sets compare.planning.icc from)."""
    rows = {row: pool_plan(row, plan, p, look_items, max_looks) for row, plan in plans.items()}
    for name, variant in ((report or {}).get("variants") or {}).items():
        for row, judged in (variant.get("domains") or {}).items():
            if row in rows:
                icc = observed_icc(judged.get("paired"), plans[row])
                rows[row].setdefault("observed_icc", {})[name] = icc
    return {"assumptions": p.planning.model_dump(), "rows": rows}
