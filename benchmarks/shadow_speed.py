"""How long the shadow replay takes beside the evaluate stages it joins in the default run.

    .venv/bin/python benchmarks/shadow_speed.py [--no-evaluate] [--no-record]

Needs a finished `dvc repro` (the built variants, results/compare.json and the baseline's records). Times, on
this machine, in this order and one at a time:
1. the shadow stage's work (`pipelines.shadow.run`: the production sample replayed through fp16 and every variant
   compare passed), written into a temporary folder so the workspace's DVC outputs stay as they are
   (goal: at most 120 s on 2 cores);
2. each variant's evaluate stage as the stage runs it (`pipelines.evaluation.harness.evaluate_variant` with the
   baseline's answers, so it stops where the rule decides), and fp16's baseline (every look);
and prints the replay's time, the evaluate stages' sum and their ratio. Writes docs/measured/shadow_speed.json
(docs/shadow.md renders it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402

GOAL_SECONDS = 120.0


def time_shadow(params, report: dict) -> tuple[float, dict]:
    """Seconds of the shadow stage's work, and how many requests and models it replayed."""
    from pipelines import shadow
    from pipelines.core.paths import VARIANTS_DIR
    from pipelines.models.loading import resolve_device

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        started = time.perf_counter()
        result = shadow.run(params, report, VARIANTS_DIR, resolve_device(params.device), out / "shadow.json",
                            out / "shadow_metrics.json", out / "shadow", out / "plots")
        seconds = time.perf_counter() - started
    return seconds, {"requests": result["traffic"]["replayed"], "models": sorted(result["models"])}


def time_evaluate(params, names: list[str]) -> dict[str, float]:
    """Seconds each evaluate stage's work takes (fp16: the baseline stage's, every look)."""
    from pipelines.core.io import read_jsonl
    from pipelines.core.paths import BASELINE, BASELINE_RESULTS, VARIANTS_DIR
    from pipelines.evaluation.harness import evaluate_variant
    from pipelines.evaluation.plans import by_id, correctness, probe_plans
    from pipelines.models.loading import resolve_device

    p = params.evaluate
    plans = probe_plans(p.domains, p)
    base_rows = read_jsonl(BASELINE_RESULTS / "items.jsonl")
    answers = {d: correctness(by_id(base_rows, d)) for d in plans}
    device = resolve_device(params.device)
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        fidelity_base = Path(tmp) / "fidelity.safetensors"
        for name in [BASELINE, *[n for n in names if n != BASELINE]]:
            started = time.perf_counter()
            result, _ = evaluate_variant(str(VARIANTS_DIR / name), plans, p, device, fidelity_base,
                                         None if name == BASELINE else answers, params.compare)
            seconds[name] = time.perf_counter() - started
            print(f"  evaluate {name}: {seconds[name]:.1f} s ({result['status']})", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-evaluate", action="store_true", help="time the replay only")
    measured.add_arguments(parser, "shadow_speed")
    args = parser.parse_args()
    from pipelines.core.io import read_json
    from pipelines.core.params import load_params
    from pipelines.core.paths import COMPARE_REPORT

    params = load_params()
    report = read_json(COMPARE_REPORT)
    shadow_s, what = time_shadow(params, report)
    print(f"shadow replay: {shadow_s:.1f} s for {what['requests']} requests through {', '.join(what['models'])} "
          f"(goal <= {GOAL_SECONDS:.0f} s: ratio {shadow_s / GOAL_SECONDS:.2f})")
    results = {"shadow_seconds": round(shadow_s, 1), "goal_seconds": GOAL_SECONDS, **what,
               "header": ["work", "seconds", "goal"],
               "rows": [[f"shadow replay: {what['requests']} requests through {len(what['models'])} models",
                         f"{shadow_s:.1f}", f"≤ {GOAL_SECONDS:.0f}"]]}
    if not args.no_evaluate:
        evaluate = time_evaluate(params, list(report["variants"]))
        total = sum(evaluate.values())
        print(f"evaluate stages (fp16's baseline and {len(evaluate) - 1} variants): {total:.1f} s; "
              f"shadow / evaluate = {shadow_s / total:.2f}")
        results |= {"evaluate_seconds": {k: round(v, 1) for k, v in evaluate.items()},
                    "evaluate_total_seconds": round(total, 1), "shadow_over_evaluate": round(shadow_s / total, 3)}
        results["rows"] += [[f"evaluate {k}" + (" (baseline: every look)" if k == "fp16" else ""), f"{v:.1f}", ""]
                            for k, v in evaluate.items()]
        results["rows"].append(["evaluate stages together", f"{total:.1f}", f"shadow / evaluate = {shadow_s / total:.2f}"])
    measured.record(args.record, "shadow_speed", results)


if __name__ == "__main__":
    main()
