"""Operating characteristics of the accuracy rule, next to three peers' rules judged on the same simulated data.

    .venv/bin/python benchmarks/gate_operating.py [--runs 2000] [--seed 0] [--workers 2] [--no-goals]

Simulates paired probe results (fp16 and a variant answering the same items) and judges each simulated run
four ways:
- quantgate: sequential.run_looks (the looks and the accuracy rule that evaluate, compare and gate share,
  group-sequential levels from params.yaml's compare.spending) and verdict.judge: pass / inconclusive / fail,
  and the items the decision used;
- llm-compressor (tests/lmeval/test_lmeval.py): pass when round(variant / fp16 accuracy, 2) >= 0.95;
- vLLM (.buildkite/lm-eval-harness/test_lm_eval_correctness.py): pass when the variant's accuracy is at least
  the stored value times (1 - 0.08), the stored value being fp16's accuracy measured on the same items;
- GPTQModel (tests/models/model_test.py): pass when 0.95 <= variant / fp16 accuracy <= 1.10
  (DEFAULT_FLOOR_PCT 0.05, DEFAULT_CEIL_PCT 0.10).
The peers take every item of the pool, point estimates, and only pass or fail.

Flip model: fp16 is right on 75 % of items; the variant gains 2.5 % of the items and loses 2.5 % plus the drop, so
the flip rate is 0.05 + |difference|. Items come in families, as probe items do (templates, kinds of math). Pools: the
default plan of a 600-item pool in 36 families (looks 200/400/600), the 1,100-item math look of the pool's shape before 2026-12-05, 17 families (looks
200/650/1100), a 200-item pool in 20 families (one look) and the shipped chat pool, 1,000 items in 36 families (looks
200/600/1000). Each pool four ways (CASES): independent items without
families; families declared but items independent (the shipped pools always declare them); clustered, each family
with its own flip propensity (gamma, coefficient of variation 1: half the flips in about 7 of 36 families); strongly
clustered (CV 1.5: the top fifth of the families hold 65 % of the flips, half of them in 5 of 36). Beside each cell,
the pass rate planning.pass_rate predicts for it (the planner quantgate doctor and compare.json use: within-family
correlation 0 for independent items, the flip model's own for the clustered cases). Goals are checked at the end.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import measured  # noqa: E402
from pipelines.core.params_requests import PolicyParams  # noqa: E402
from pipelines.judging import planning, sequential  # noqa: E402
from pipelines.judging.verdict import judge  # noqa: E402

MARGIN = 0.05
BASE_ACCURACY = 0.75
GAIN = 0.025  # share of the items the variant gets right where fp16 is wrong (it loses GAIN + drop)
POLICY = PolicyParams(max_accuracy_drop=MARGIN, max_flip_rate=0.99, kl_percentile="p99", max_kl=1.0,
                      max_growth_excess_pct=1.0, min_memory_saving_pct=10.0, min_agreement=0.5)
FIDELITY = {"tokens": 1000, "kl": {"p99": 0.1}}
MEMORY = {"growth_excess_pct": 0.0, "leak": False, "oom": None}
DIFFERENCES = [-0.08, -0.05, -0.02, 0.0, 0.02]
POOLS = [("default", 600, 36), ("math", 1100, 17), ("small", 200, 20), ("chat", 1000, 36)]  # (name, items, families)
# (case, families declared, coefficient of variation of the families' flip propensity)
CASES = [("independent", False, 0.0), ("declared", True, 0.0), ("clustered", True, 1.0), ("strong", True, 1.5)]
PEERS = ("llm-compressor", "vllm", "gptqmodel")
FLIP_MODEL = ("fp16 right on 75 % of items; the variant gains 2.5 % of the items and loses 2.5 % + the drop "
              "(flip rate 0.05 + |difference|); clustered: each family's flip propensity gamma with coefficient of "
              "variation 1 (strongly: 1.5)")

SPENDING: str | None = None  # --spending (set before the worker processes fork)


@functools.lru_cache(maxsize=None)
def spending() -> str:
    """params.yaml's compare.spending (or --spending): how the looks share the false-pass rate."""
    if SPENDING:
        return SPENDING
    from pipelines.core.params import load_params

    return load_params(ROOT / "params.yaml").compare.spending


def flip_rate_for(difference: float) -> float:
    """The flip model: gains of GAIN, losses of GAIN + drop (or gains of GAIN + gain, losses of GAIN)."""
    return round(2 * GAIN + abs(difference), 10)


def simulate(rng, n: int, difference: float, flip_rate: float, families: int | None, accuracy: float = 0.75,
             labels: np.ndarray | None = None, cv: float = 1.0):
    """(fp16 correct, variant correct, family labels) for n items; the population difference is `difference`.
    `labels` (0 .. families - 1 per item) sets unequal families; by default item k is in family k % families.
    `cv`: coefficient of variation of the families' flip propensity (gamma, mean 1; 0: independent items)."""
    if labels is None:
        labels = np.arange(n) % families if families else np.arange(n)
    base = rng.random(n) < accuracy
    p_loss, p_gain = (flip_rate - difference) / 2, (flip_rate + difference) / 2  # unconditional rates
    loss, gain = p_loss / accuracy, p_gain / (1 - accuracy)  # given fp16 right / wrong
    if families and cv > 0:
        shape = 1 / cv**2  # mean 1, coefficient of variation cv: some families break, others do not
        weight = rng.gamma(shape, 1 / shape, families)[labels]
    else:
        weight = np.ones(n)
    flips = rng.random(n) < np.where(base, np.minimum(1, loss * weight), np.minimum(1, gain * weight))
    return base, base ^ flips, labels


def judge_run(base, variant, labels, looks: list[int], alpha: float, declared: bool = True) -> tuple[str, int]:
    """The verdict compare gives this run (params.yaml's spending), and the items it used. Labels that give every
    item its own family, or declared=False, are independent items (no families)."""
    ids = [f"i{k}" for k in range(len(base))]
    b = dict(zip(ids, map(bool, base)))
    v = dict(zip(ids, map(bool, variant)))
    independent = not declared or len(np.unique(labels)) == len(labels)
    fam = None if independent else dict(zip(ids, map(str, labels)))
    run = sequential.run_looks(b, v, ids, looks, fam, MARGIN, alpha, spending())
    run["paired"]["chance"] = 0.0  # generation items: chance level 0
    verdict, _, _ = judge(run["paired"], FIDELITY, MEMORY, POLICY, identical=False)
    return verdict, run["paired"]["items"]


def peer_verdicts(base, variant) -> dict[str, bool]:
    """Whether each peer's rule passes the variant on every item of the pool (point estimates)."""
    fp16, acc = float(np.mean(base)), float(np.mean(variant))
    ratio = acc / fp16 if fp16 else float("inf")
    return {"llm-compressor": round(ratio, 2) >= 0.95,  # recovery >= 0.95, rounded to 2 places
            "vllm": acc >= fp16 * (1 - 0.08),  # stored value = fp16's, rtol 0.08
            "gptqmodel": 0.95 <= ratio <= 1.10}  # DEFAULT_FLOOR_PCT 0.05, DEFAULT_CEIL_PCT 0.10


def chunk(seed, runs: int, pool: int, families: int, declared: bool, cv: float, looks: list[int], difference: float,
          alpha: float) -> dict:
    """Counts over `runs` simulated runs of one cell: quantgate's verdicts, its items, each peer's passes. The pool's
    items are shuffled, as the pool's hash order shuffles them, so every look holds items of every family."""
    rng = np.random.default_rng(seed)
    counts = {"pass": 0, "inconclusive": 0, "fail": 0, "items": 0, **{p: 0 for p in PEERS}}
    for _ in range(runs):
        base, variant, labels = simulate(rng, pool, difference, flip_rate_for(difference), families, BASE_ACCURACY,
                                         cv=cv)
        order = rng.permutation(pool)
        base, variant, labels = base[order], variant[order], labels[order]
        verdict, used = judge_run(base, variant, labels, looks, alpha, declared)
        counts[verdict] += 1
        counts["items"] += used
        for peer, passed in peer_verdicts(base, variant).items():
            counts[peer] += passed
    return counts


def planned_icc(difference: float, cv: float) -> float:
    """The flip model's within-family correlation as the rule's design effect sees it: gains and losses each vary
    between families (gamma, coefficient of variation cv), (P(gain)^2 + P(loss)^2) cv^2 / (flip rate - d^2)."""
    flips = flip_rate_for(difference)
    gain, loss = (flips + difference) / 2, (flips - difference) / 2
    return (gain**2 + loss**2) * cv**2 / (flips - difference**2)


def planned(cell: dict, alpha: float) -> float:
    """planning.pass_rate's prediction for a cell (families spread evenly over the looks)."""
    looks = cell["looks"]
    if cell["declared"]:
        sizes = [np.bincount(np.arange(k) % cell["families"]).astype(float) for k in looks]
    else:
        sizes = [np.ones(k) for k in looks]
    return planning.pass_rate(looks, sizes, drop=-cell["true_difference"], flip_rate=cell["flip_rate"],
                              icc=planned_icc(cell["true_difference"], cell["cv"]), margin=MARGIN, alpha=alpha,
                              spending=spending())


def goals(cells: list[dict]) -> list[dict]:
    """The targets: {what, value, limit, met}. False pass at the margin in every pool and case (budget 0.025 for
    independent items, 0.03 clustered); on the 600-item pool, and on the 1,000-item one the shipped pools are sized
    like, the pass rate at -2 points (0.65 with families declared, 0.55 clustered), the fail rate there, the pass
    rate of an equal variant and its mean items (at most 0.6 of the pool)."""
    out = []

    def cell(pool, case, difference):
        return next(c for c in cells if c["pool"] == pool and c["case"] == case
                    and abs(c["true_difference"] - difference) < 1e-9)

    def check(what, value, limit, at_most):
        out.append({"what": what, "value": round(value, 4), "limit": limit, "comparison": "<=" if at_most else ">=",
                    "met": bool(value <= limit if at_most else value >= limit)})

    for _, items, groups in POOLS:
        for case, _, cv in CASES:
            check(f"{items} items, {case_name(case, groups)}: false pass at the margin (-{MARGIN:g})",
                  cell(items, case, -MARGIN)["quantgate"]["pass"], 0.03 if cv else 0.025, True)
    for items in (600, 1000):
        for case, power in (("declared", 0.65), ("clustered", 0.55), ("strong", 0.55)):
            q = lambda d: cell(items, case, d)["quantgate"]  # noqa: E731
            name = f"{items} items, {case_name(case, 36)}"
            check(f"{name}: pass at -0.02", q(-0.02)["pass"], power, False)
            check(f"{name}: fail at -0.02", q(-0.02)["fail"], 0.02, True)
            check(f"{name}: pass at 0", q(0.0)["pass"], 0.95, False)
            check(f"{name}: mean items at 0 (0.6 x pool)", q(0.0)["items"], 0.6 * items, True)
    return out


def case_name(case: str, groups: int) -> str:
    return {"independent": "independent", "declared": f"{groups} families declared, independent items",
            "clustered": f"{groups} families, clustered (CV 1)", "strong": f"{groups} families, strongly clustered (CV 1.5)"}[case]


def items_for(pool: int, groups: int, looks: list[int], case: str, power: float, alpha: float) -> int | None:
    """The pool size planning says reaches `power` at -2 points in this case (families spread evenly; the planner's
    own search)."""
    cv = next(cv for name, _, cv in CASES if name == case)

    def rate_at(n: int) -> float:
        return planned({"pool": n, "looks": sequential.plan(n, looks[0], None, len(looks)), "declared": True,
                        "families": groups, "true_difference": -0.02, "flip_rate": flip_rate_for(-0.02), "cv": cv}, alpha)

    return planning.items_for_power(rate_at, pool, rate_at(pool), power)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="simulated runs per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=250, help="runs per job (progress granularity)")
    parser.add_argument("--confidence", type=float, default=None,
                        help="compare.confidence to simulate (default: params.yaml's)")
    parser.add_argument("--spending", default=None,
                        help="compare.spending to simulate instead of params.yaml's (with --no-record: the docs keep the default's)")
    parser.add_argument("--goals", action=argparse.BooleanOptionalAction, default=True,
                        help="print the goals with PASS/MISS at the end (default: on)")
    measured.add_arguments(parser, "gate_operating")
    args = parser.parse_args()
    if args.confidence is None:
        from pipelines.core.params import load_params

        args.confidence = load_params(ROOT / "params.yaml").compare.confidence
    alpha = round((1 - args.confidence) / 2, 12)
    global SPENDING
    SPENDING = args.spending
    kind = spending()
    cells = []
    for pool, items, groups in POOLS:
        looks = sequential.plan(items, 200, None, 3)
        for case, declared, cv in CASES:
            for difference in DIFFERENCES:
                cells.append({"pool": items, "pool_name": pool, "case": case, "families": groups if declared else None,
                              "declared": declared, "cv": cv, "looks": looks, "true_difference": difference,
                              "flip_rate": flip_rate_for(difference)})
    print(f"{args.runs} simulated runs per cell, seed {args.seed}; margin {MARGIN:g}, compare.confidence "
          f"{args.confidence:g} (one-sided alpha {alpha:g}), spending {kind}; base accuracy {BASE_ACCURACY:g}")
    print(f"flip model: {FLIP_MODEL}\n")
    seeds = np.random.SeedSequence(args.seed).spawn(len(cells))
    jobs = []
    for k, c in enumerate(cells):
        sizes = [min(args.chunk, args.runs - s) for s in range(0, args.runs, args.chunk)]
        for size, seed in zip(sizes, seeds[k].spawn(len(sizes))):
            jobs.append((k, seed, size, c))
    totals = [dict.fromkeys(("pass", "inconclusive", "fail", "items", *PEERS), 0) for _ in cells]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as executor:
        futures = {executor.submit(chunk, seed, size, c["pool"], groups_of(c), c["declared"], c["cv"], c["looks"],
                                   c["true_difference"], alpha): (k, size) for k, seed, size, c in jobs}
        with tqdm(total=len(cells) * args.runs, unit="run", file=sys.stderr, smoothing=0.05) as bar:
            for future in as_completed(futures):
                k, size = futures[future]
                for key, value in future.result().items():
                    totals[k][key] += value
                bar.update(size)
    seconds = time.perf_counter() - started
    for c, t in zip(cells, totals):
        c["quantgate"] = {v: t[v] / args.runs for v in ("pass", "inconclusive", "fail")} | {"items": t["items"] / args.runs}
        c["peers"] = {p: t[p] / args.runs for p in PEERS}
        c["planned_pass"] = round(planned(c, alpha), 4)
    head = (f"{'pool':58} {'diff':>6} {'flips':>6} | {'qg pass':>8} {'inconcl':>8} {'fail':>6} {'items':>6} "
            f"{'planned':>7} | {'llm-comp':>8} {'vllm':>6} {'gptqm':>6}")
    print(head + "\n" + "-" * len(head))
    for c in cells:
        q, p = c["quantgate"], c["peers"]
        pool = f"{c['pool']} items, {case_name(c['case'], groups_of(c))} ({'/'.join(map(str, c['looks']))})"
        print(f"{pool:58} {c['true_difference']:+6.2f} {c['flip_rate']:6.3f} | {q['pass']:8.3f} {q['inconclusive']:8.3f} "
              f"{q['fail']:6.3f} {q['items']:6.0f} {c['planned_pass']:7.3f} | "
              f"{p['llm-compressor']:8.3f} {p['vllm']:6.3f} {p['gptqmodel']:6.3f}")
    checks = goals(cells)
    sizing = [{"case": case, "power": power, "pool": 600, "families": 36,
               "items": items_for(600, 36, sequential.plan(600, 200, None, 3), case, power, alpha)}
              for case, power in (("declared", 0.65), ("clustered", 0.55), ("strong", 0.55))]
    print(f"\n{seconds:.0f} s on {args.workers} workers")
    if args.goals:
        print("\ngoals:")
        for g in checks:
            print(f"  {'PASS' if g['met'] else 'MISS'}  {g['what']}: {g['value']:g} (goal {g['comparison']} {g['limit']:g})")
        print("\nthe 600-item pool's shape (36 families), sized by planning.pass_rate for a -2-point variant:")
        for s in sizing:
            print(f"  {case_name(s['case'], 36)}: pass rate {s['power']:g} needs "
                  + (f"about {s['items']} items" if s["items"] else "more families (items alone do not reach it)"))
    measured.record(args.record, "gate_operating",
                    {"runs": args.runs, "seed": args.seed, "margin": MARGIN, "alpha": alpha, "spending": kind,
                     "confidence": args.confidence, "base_accuracy": BASE_ACCURACY, "flip_model": FLIP_MODEL,
                     "seconds": round(seconds, 1), "workers": args.workers,
                     "cells": [{k: c[k] for k in ("pool", "case", "families", "declared", "cv", "looks",
                                                  "true_difference", "flip_rate", "quantgate", "planned_pass", "peers")}
                               for c in cells],
                     "goals": checks, "sizing": sizing})


def groups_of(cell: dict) -> int:
    """The pool's family count (also for the undeclared case, whose items are independent)."""
    return next(g for _, items, g in POOLS if items == cell["pool"])


if __name__ == "__main__":
    main()
