"""Operating characteristics of the accuracy rule when a pool has few item families (1 to 5, and 8, 20 and 50 for
reference): how often it passes a variant whose true drop is the margin, one as good as fp16, and a better one.

    .venv/bin/python benchmarks/few_families.py [--runs 2000] [--seed 0]

Items of one family fail together, so the rule's interval takes a cluster-robust (CR2) design effect and Student's t
with the Bell-McCaffrey degrees of freedom, or fewer where the flips crowd into few families (judging/stats.py). With few families that variance estimate is itself
noisy; this measures what the rule does there. Each simulated run is made by gate_operating.simulate (each family's
flip propensity drawn from a gamma with coefficient of variation 1: some families break, others do not) and judged
by sequential.run_looks and verdict.judge, the functions compare and gate use; the same run is also judged with its
families ignored (every item independent), the rule before families counted. Rows at the margin give the false-pass
rate, budget (1 - compare.confidence) / 2 = 2.5 %. "5 unequal" puts 60 % of the items in one family and 10 % in
each of four (its Bell-McCaffrey degrees of freedom: 2.08 rather than 4). The last column repeats the margin rows
with the looks under strong clustering (coefficient of variation 1.5: the top fifth of the families hold 65 % of
the flips).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402
from benchmarks.gate_operating import FIDELITY, MARGIN, MEMORY, POLICY, simulate  # noqa: E402
from pipelines.judging import sequential  # noqa: E402
from pipelines.judging.verdict import judge  # noqa: E402

ALPHA = 0.025  # params.yaml's compare.confidence 0.95, one-sided


def spending() -> str:
    """params.yaml's compare.spending: the looks are judged as the pipeline judges them."""
    from pipelines.core.params import load_params

    return load_params(Path(__file__).resolve().parents[1] / "params.yaml").compare.spending
SCENARIOS = [("true drop = margin", -MARGIN, 0.10), ("equal to fp16, 7.5 % flips", 0.0, 0.075),
             ("2 points better, 12 % flips", 0.02, 0.12)]
FAMILIES = [1, 2, 3, 4, 5, "5 unequal", 8, 20, 50]
STRONG_CV = 1.5  # the last column: flip propensities with this coefficient of variation (the top fifth hold 65 %)


SPENDING = spending()


def labels_for(families, n: int, rng) -> np.ndarray:
    """Each item's family: item k in family k % G, or for "5 unequal" 60 % in one family and 10 % in four others,
    in a random order (the pool's evaluation order is a random one)."""
    if families == "5 unequal":
        return rng.permutation(np.repeat(np.arange(5), [int(0.6 * n)] + [int(0.1 * n)] * 4))
    return np.arange(n) % families


def judged(base, variant, labels, looks: list[int], alpha: float, use_families: bool) -> tuple[str, int, float]:
    """(verdict, items used, design effect) that compare gives this run."""
    ids = [f"i{k}" for k in range(len(base))]
    fam = dict(zip(ids, map(str, labels))) if use_families else None
    run = sequential.run_looks(dict(zip(ids, map(bool, base))), dict(zip(ids, map(bool, variant))), ids, looks, fam,
                               MARGIN, alpha, SPENDING)
    run["paired"]["chance"] = 0.0  # generation probes: a guess scores nothing
    verdict, _, _ = judge(run["paired"], FIDELITY, MEMORY, POLICY, identical=False)
    return verdict, run["paired"]["items"], run["paired"]["design_effect"]


def operating(seed: int, runs: int, families, difference: float, flip_rate: float, looks: list[int],
              alpha: float = ALPHA, cv: float = 1.0) -> dict:
    """Pass/inconclusive/fail shares, mean items and design effect over `runs` simulated pools; `naive_pass`: the
    pass share of the same runs judged as if every item were independent. `cv`: of the families' flip propensity."""
    rng = np.random.default_rng(seed)
    verdicts, naive, items, effects = [], [], [], []
    for _ in range(runs):
        labels = labels_for(families, looks[-1], rng)
        base, variant, labels = simulate(rng, looks[-1], difference, flip_rate, int(labels.max()) + 1, labels=labels,
                                         cv=cv)
        verdict, used, effect = judged(base, variant, labels, looks, alpha, True)
        verdicts.append(verdict)
        items.append(used)
        effects.append(effect)
        naive.append(judged(base, variant, labels, looks, alpha, False)[0])
    verdicts = np.array(verdicts)
    return {**{k: float(np.mean(verdicts == k)) for k in ("pass", "inconclusive", "fail")},
            "naive_pass": float(np.mean(np.array(naive) == "pass")), "items": float(np.mean(items)),
            "design_effect": float(np.median([e for e in effects if np.isfinite(e)]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    measured.add_arguments(parser, "few_families")
    args = parser.parse_args()
    single, sequence, whole = [200], sequential.plan(1000, 200, None, 3), [1000]
    jobs = [(g, name, diff, flips, plan, 1.0) for g in FAMILIES for name, diff, flips in SCENARIOS
            for plan in (single, sequence)] + [(g, SCENARIOS[0][0], -MARGIN, SCENARIOS[0][2], whole, 1.0)
                                               for g in FAMILIES]
    jobs += [(g, SCENARIOS[0][0], -MARGIN, SCENARIOS[0][2], sequence, STRONG_CV) for g in FAMILIES]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        # the margin rows (the false-pass rate, near 2.5 %) get every run; the others, far from 0 and 1, half
        futures = [pool.submit(operating, args.seed + k, args.runs if diff == -MARGIN else args.runs // 2, g, diff,
                               flips, plan, ALPHA, cv) for k, (g, _, diff, flips, plan, cv) in enumerate(jobs)]
        results = [f.result() for f in futures]
    seconds = time.perf_counter() - started
    by = {(g, name, plan[0] if len(plan) == 1 else len(plan), cv): r
          for (g, name, _, _, plan, cv), r in zip(jobs, results)}
    se = (ALPHA * (1 - ALPHA) / args.runs) ** 0.5
    header = ["families", "scenario", "one look of 200: pass / inconclusive / fail (ignoring families: pass)",
              f"looks {'/'.join(map(str, sequence))}: pass / inconclusive / fail", "mean items",
              "median design effect, one look", "one look of all 1000 at the margin: pass",
              f"strongly clustered (CV {STRONG_CV:g}), looks {'/'.join(map(str, sequence))} at the margin: pass"]
    rows = []
    for g in FAMILIES:
        for name, _, _ in SCENARIOS:
            one, seq = by[(g, name, 200, 1.0)], by[(g, name, len(sequence), 1.0)]
            at_margin = name.startswith("true drop")

            def cells(x, bold):
                p = f"{x['pass']:.3f}"
                return (f"**{p}**" if bold else p) + f" / {x['inconclusive']:.3f} / {x['fail']:.3f}"
            rows.append([str(g), name, cells(one, at_margin) + f" ({one['naive_pass']:.3f})", cells(seq, at_margin),
                         f"{seq['items']:.0f}", f"{one['design_effect']:.2f}",
                         f"{by[(g, name, 1000, 1.0)]['pass']:.3f}" if at_margin else "",
                         f"**{by[(g, name, len(sequence), STRONG_CV)]['pass']:.3f}**" if at_margin else ""])
            print(" | ".join(rows[-1]))
    print(f"\n{args.runs} runs per margin cell, seed {args.seed}; {seconds:.0f} s; Monte-Carlo standard error at 2.5 %: "
          f"{100 * se:.2f} %")
    note = (f"{args.runs:,} simulated runs per cell at the margin, {args.runs // 2:,} in the other rows (seeds "
            f"{args.seed} on, one per cell); margin {MARGIN:g}, one-sided α {ALPHA:g}, "
            f"{SPENDING} spending over the looks; Monte-Carlo standard error at the 2.5 % budget ± {100 * se:.2f} %; "
            f"{seconds:.0f} s on {args.workers} workers.")
    measured.record(args.record, "few_families",
                    {"header": header, "rows": rows, "runs": args.runs, "seed": args.seed, "seconds": round(seconds, 1),
                     "raw": {f"{g}|{name}|{n}|cv{cv:g}": r for (g, name, n, cv), r in by.items()}}, note=note)


if __name__ == "__main__":
    main()
