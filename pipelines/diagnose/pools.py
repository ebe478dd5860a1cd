"""Doctor check: is each request type's probe pool large enough to pass a variant a little worse than fp16?

The accuracy rule spends its false-pass budget first, so an undersized pool shows up after hours of evaluation as
`inconclusive`. compare.planning says which variant a pool must be able to pass (pipelines/judging/planning.py);
this says, before anything runs, how often each request type's looks would, and how many items would make it often
enough. Only the project's probe pools are planned here: a standard lm-eval task's pool is its dataset, which the
doctor does not load (compare.json's `planning` covers those rows), and this row only ever warns. It also reads the
last compare (results/compare.json) for rows of the same pools whose variants crowded their flips more than the plan
assumes: the plan's correlation is an assumption, and those rows are the evidence against it.
"""

from __future__ import annotations

import math
from pathlib import Path

from pipelines.core.paths import COMPARE_REPORT
from pipelines.diagnose.check import OK, WARN, Check


def more_clustered_than_planned(icc: float, pools: dict[str, dict], report: Path = COMPARE_REPORT) -> list[str]:
    """`<variant> <row> <icc>` for each row of the last compare whose judged variant showed a larger within-family
    correlation of flips (compare.json's planning.rows.<row>.observed_icc) than the plan assumes: the pools are sized
    for `icc`, and a variant whose flips crowd more is undecided more often than planned. Only rows planned on the same
    pool as now (`pools`: planning.plan_all's rows; the same items and families); nothing when there is no readable
    compare.json (a fresh run) or it is not compare's shape."""
    from pipelines.core.errors import QuantgateError
    from pipelines.core.io import read_json

    try:
        report_rows = read_json(report)["planning"]["rows"]
    except (QuantgateError, OSError, ValueError, LookupError, TypeError):  # missing, unreadable, not compare's
        return []
    found = []
    for row, plan in (report_rows.items() if isinstance(report_rows, dict) else []):
        now = pools.get(row)
        if not (isinstance(plan, dict) and now and isinstance(plan.get("observed_icc"), dict)
                and (plan.get("items"), plan.get("families")) == (now["items"], now["families"])):
            continue
        for name, seen in sorted(plan["observed_icc"].items()):
            if isinstance(seen, (int, float)) and not isinstance(seen, bool) and math.isfinite(seen) and seen > icc:
                found.append(f"{name} {row} {seen:g}")
    return found


def pools_check(params) -> Check:
    from pipelines.evaluation.plans import probe_plans
    from pipelines.judging.planning import MAX_ITEMS, plan_all

    try:
        plans = probe_plans(params.evaluate.domains, params.evaluate.model_copy(update={"tasks": {}}))
        planned = plan_all(plans, params.compare, params.evaluate.look_items, params.evaluate.max_looks)
    except Exception as err:  # noqa: BLE001 - informational: a pool the planner cannot read is for `evaluate` to refuse
        return Check("pools", WARN, f"could not plan the probe pools: {type(err).__name__}: {err}")
    g = params.compare.planning
    short, parts = [], []
    for row, r in planned["rows"].items():
        pool = plans[row]["pool"]
        parts.append(f"{row} {r['items']} items/{r['families']} families, drop {r['drop']:g}: {r['pass_rate']:.2f}")
        if r["pass_rate"] >= g.power:
            continue
        if r["short_of"] == "empty":
            short.append(f"{row}: its pool eval/{row}/ has no items")
        elif r["short_of"] == "families":
            short.append(f"{row}: no number of items reaches {g.power:g} with its {r['families']} families; "
                         "add items from more families")
        elif r["items_for_power"] is None:
            short.append(f"{row}: more than {MAX_ITEMS:,} items")
        else:
            capped = " (and evaluate.max_items stops the looks at " + str(r["items"]) + ")" if r["items"] < pool else ""
            where = (f"the pool has {pool}{capped}" if r["items_for_power"] > pool
                     else f"the looks stop at {r['items']}: evaluate.max_items")
            short.append(f"{row}: about {r['items_for_power']} items ({where})")
    detail = (f"pass rate of a variant {g.drop_of_margin:g} x the margin below fp16 (flip rate {g.flip_rate:g}, "
              f"within-family correlation {g.icc:g}; compare.planning): " + "; ".join(parts))
    if short:
        detail += f". Below {g.power:g}: " + "; ".join(short)
    crowded = more_clustered_than_planned(g.icc, planned["rows"], COMPARE_REPORT)
    if crowded:
        detail += (f". The last compare ({COMPARE_REPORT}) judged rows of these pools whose flips crowded more than "
                   f"{g.icc:g} (variant, row, observed correlation): " + ", ".join(crowded)
                   + "; a variant like that is undecided more often than planned")
    remedies = (["such a variant would mostly be `inconclusive`: add probe items (eval/<type>/) or raise "
                 "evaluate.max_items"] if short else []) + (
        ["set compare.planning.icc from compare.json's planning.rows.<type>.observed_icc and size the pools again"]
        if crowded else [])
    if short or crowded:
        return Check("pools", WARN, detail, "; ".join(remedies) + " (docs/compare.md, \"Sizing a pool\")")
    return Check("pools", OK, detail)
