"""Operating characteristics of the accuracy rule: how often it passes a variant, by how good the variant truly is.

    .venv/bin/python benchmarks/gate_operating.py [--runs 2000] [--seed 0]

Simulates paired probe results (fp16 and a variant answering the same items) and judges each simulated
run with the project's own functions: sequential.run_looks (the looks and the accuracy rule that evaluate,
compare and gate share) and verdict.judge (the verdict). Items come in families, as probe items do
(templates, kinds of math): with `families`, each family gets its own flip propensity (gamma-distributed,
coefficient of variation 1), so flips cluster the way a quantization that breaks one template makes them.

Scenarios (margin 0.05; the false-pass budget is (1 - compare.confidence) / 2, params.yaml's unless
--confidence says otherwise):
- the true drop equals the margin (the variant is exactly as bad as allowed): pass rate = false-pass rate,
  goal <= 0.05, with and without families;
- a variant exactly as good as fp16 with ~7.5 % of items flipping (goal: passes >= 0.6 at 200 items);
- a variant 2 points better with ~12 % flips (goal >= 0.7 at 200 items);
each at one look of 200 items and with the default plan of a 1000-item pool (looks of 200, 600 and 1000
items, Pocock spending), with the mean number of items the decision used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402
from pipelines.core.params_requests import PolicyParams  # noqa: E402
from pipelines.judging import sequential  # noqa: E402
from pipelines.judging.verdict import judge  # noqa: E402

MARGIN = 0.05
POLICY = PolicyParams(max_accuracy_drop=MARGIN, max_flip_rate=0.99, kl_percentile="p99", max_kl=1.0,
                      max_growth_excess_pct=1.0, min_memory_saving_pct=10.0)
FIDELITY = {"tokens": 1000, "kl": {"p99": 0.1}}
MEMORY = {"growth_excess_pct": 0.0, "leak": False, "oom": None}


def simulate(rng, n: int, difference: float, flip_rate: float, families: int | None, accuracy: float = 0.75,
             labels: np.ndarray | None = None):
    """(fp16 correct, variant correct, family labels) for n items; the population difference is `difference`.
    `labels` (0 .. families - 1 per item) sets unequal families; by default item k is in family k % families."""
    if labels is None:
        labels = np.arange(n) % families if families else np.arange(n)
    base = rng.random(n) < accuracy
    p_loss, p_gain = (flip_rate - difference) / 2, (flip_rate + difference) / 2  # unconditional rates
    loss, gain = p_loss / accuracy, p_gain / (1 - accuracy)  # given fp16 right / wrong
    if families:
        weight = rng.gamma(1.0, 1.0, families)[labels]  # mean 1, CV 1: some families break, others do not
    else:
        weight = np.ones(n)
    flips = rng.random(n) < np.where(base, np.minimum(1, loss * weight), np.minimum(1, gain * weight))
    return base, base ^ flips, labels


def judge_run(base, variant, labels, looks: list[int], alpha: float) -> tuple[str, int]:
    """The verdict compare gives this run, and the items it used."""
    ids = [f"i{k}" for k in range(len(base))]
    b = dict(zip(ids, map(bool, base)))
    v = dict(zip(ids, map(bool, variant)))
    fam = dict(zip(ids, map(str, labels)))
    run = sequential.run_looks(b, v, ids, looks, fam, MARGIN, alpha, "pocock")
    verdict, _, _ = judge(run["paired"], FIDELITY, MEMORY, POLICY, identical=False)
    return verdict, run["paired"]["items"]


def scenario(rng, runs: int, difference: float, flip_rate: float, families: int | None, looks: list[int],
             alpha: float) -> dict:
    verdicts, items = [], []
    for _ in range(runs):
        base, variant, labels = simulate(rng, looks[-1], difference, flip_rate, families)
        verdict, used = judge_run(base, variant, labels, looks, alpha)
        verdicts.append(verdict)
        items.append(used)
    verdicts = np.array(verdicts)
    return {k: float(np.mean(verdicts == k)) for k in ("pass", "inconclusive", "fail")} | {"items": float(np.mean(items))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--confidence", type=float, default=None,
                        help="compare.confidence to simulate (default: params.yaml's)")
    measured.add_arguments(parser, "gate_operating")
    args = parser.parse_args()
    if args.confidence is None:
        from pipelines.core.params import load_params

        args.confidence = load_params(Path(__file__).resolve().parents[1] / "params.yaml").compare.confidence
    alpha = (1 - args.confidence) / 2
    rng = np.random.default_rng(args.seed)
    single, sequence = [200], sequential.plan(1000, 200, None, 3)  # the default plan of a 1000-item pool
    rows = [
        ("true drop = margin, independent items", -MARGIN, 0.10, None, "<= 0.05"),
        ("true drop = margin, flips clustered in 8 families", -MARGIN, 0.10, 8, "<= 0.05"),
        ("equal to fp16, 7.5 % flips", 0.0, 0.075, None, ">= 0.6"),
        ("equal to fp16, 7.5 % flips, 8 families", 0.0, 0.075, 8, ""),
        ("2 points better, 12 % flips", 0.02, 0.12, None, ">= 0.7"),
        ("2 points better, 12 % flips, 8 families", 0.02, 0.12, 8, ""),
        ("10 points worse, 15 % flips", -0.10, 0.15, None, "fail"),
    ]
    started = time.perf_counter()
    print(f"{args.runs} simulated runs per row; margin {MARGIN}, compare.confidence {args.confidence} (one-sided "
          f"alpha {alpha:g}), Pocock spending over looks\n")
    print(f"{'scenario':52} {'goal':>8} | {'one look of 200':^28} | {'looks ' + '/'.join(map(str, sequence)):^37}")
    print(f"{'':52} {'':>8} | {'pass':>8} {'inconcl.':>9} {'fail':>8} | {'pass':>8} {'inconcl.':>9} {'fail':>8} {'items':>7}")
    table = []
    for name, difference, flip_rate, families, goal in rows:
        one = scenario(rng, args.runs, difference, flip_rate, families, single, alpha)
        seq = scenario(rng, args.runs, difference, flip_rate, families, sequence, alpha)
        print(f"{name:52} {goal:>8} | {one['pass']:8.3f} {one['inconclusive']:9.3f} {one['fail']:8.3f} | "
              f"{seq['pass']:8.3f} {seq['inconclusive']:9.3f} {seq['fail']:8.3f} {seq['items']:7.0f}")
        table.append({"scenario": name, "true_difference": difference, "flip_rate": flip_rate, "families": families,
                      "goal": goal, "one_look": one, "looks": seq})
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s")
    measured.record(args.record, "gate_operating",
                    {"runs": args.runs, "seed": args.seed, "margin": MARGIN, "confidence": args.confidence,
                     "alpha": alpha, "spending": "pocock", "one_look_plan": single, "looks_plan": list(sequence),
                     "seconds": round(seconds, 1), "rows": table})


if __name__ == "__main__":
    main()
