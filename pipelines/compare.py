"""Stage `compare`: every variant against fp16, per domain, turned into a verdict that fails closed.

A verdict is `pass` only when every limit of the domain's policy was checked on a real number:
a missing, NaN or placeholder value, items that do not pair with fp16's or do not follow the look
plan, a missing baseline or a failed upstream stage all give `fail` (the gate then tells a missing
baseline apart as "could not decide"). The accuracy rule is non-inferiority (pipelines/judging/sequential.py):
`pass` when the interval's low end is at or above -margin, `fail` when its high end is below -margin,
`inconclusive` when the interval holds -margin after the last look or fp16 itself is not above the probe's chance
level (no signal). `inconclusive` never routes and never releases.
`judging.verdict.judge` is the one function that turns numbers into a verdict; the gate re-derives with the same rules.
A standard lm-eval task (`requests.<name>.tasks`) is its own row `<domain>:<task>` beside the domain's row, judged
the same way under the domain's policy; `judge` also takes the domain's task-row verdicts, so the domain's
row is the worst of its own and its task rows' (a failing task row fails it, an inconclusive one leaves it
inconclusive unless it fails on its own), and gate and route, which read the domain's row, hold the domain to
every row.
"""

from __future__ import annotations

from pipelines.core.paths import COMPARE_REPORT as REPORT
from pipelines.core.paths import SUMMARY
from pipelines.evaluation.plans import probe_plans
from pipelines.judging.comparison import compare_all, flat_rows, summary
from pipelines.judging.planning import plan_all
from pipelines.judging.plots import plot_all


def main() -> int:
    """Stage `compare`: paired A/B of every variant against fp16 per domain, verdicts, table and plots."""
    import logging

    import pandas as pd

    from pipelines.core.io import atomic_write_text, write_json
    from pipelines.core.lineage import lock_digest, stage_digests
    from pipelines.core.params import load_params
    from pipelines.core.paths import COMPARE_TABLE, PLOTS_DIR, RESULTS, VARIANTS_DIR

    log = logging.getLogger(__name__)
    params = load_params()
    plans = probe_plans(params.evaluate.domains, params.evaluate)
    report = compare_all(list(params.variants), list(params.candidates), plans, params.compare, RESULTS, VARIANTS_DIR,
                         params.judged_elsewhere())
    # what each pool can decide (informational: the gate neither reads nor checks it)
    report["planning"] = plan_all(plans, params.compare, params.evaluate.look_items, params.evaluate.max_looks, report)
    report["dvc_lock_sha256"] = lock_digest()  # what `gate` checks the results against
    report["dvc_lock_stages"] = stage_digests()  # and, when they differ, names the stages that changed since
    write_json(REPORT, report)
    write_json(SUMMARY, summary(report))  # DVC's metrics: `dvc exp show`, `dvc metrics diff`
    atomic_write_text(COMPARE_TABLE, pd.DataFrame(flat_rows(report)).to_csv(index=False))
    write_json(PLOTS_DIR / "differences.json",  # a DVC data plot: `dvc plots diff` across experiments
               [{"row": f"{r['variant']} {r['domain']}", "difference": r["difference"], "ci_low": r["ci_low"],
                 "verdict": r["verdict"]} for r in flat_rows(report)])
    plot_all(report, PLOTS_DIR)
    if report["fp16"]["status"] != "ok":
        log.warning("compare: baseline fp16 unusable (%s): every verdict is fail", report["fp16"]["error"])
    for name, v in report["variants"].items():
        for domain, d in v["domains"].items():
            paired = d.get("paired")
            numbers = (f"{paired['items']} items  acc {paired['accuracy']:.3f} vs {paired['accuracy_fp16']:.3f}  "
                       f"diff {paired['difference']:+.3f} [{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}]  "
                       f"flips -{paired['correct_to_wrong']}/+{paired['wrong_to_correct']}") if paired else ""
            log.info("compare %-8s %-12s %-12s %s", name, domain, d["verdict"].upper(), numbers)
            if d["verdict"] != "pass":
                log.info("    %s", "; ".join(d["reasons"]))
    log.info("compare: results/compare.json, results/summary.json, results/compare.csv, "
             "results/plots/{pareto,flips,kl_percentiles}.png")
    return 0
