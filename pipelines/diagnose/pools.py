"""Doctor check: is each request type's probe pool large enough to pass a variant a little worse than fp16?

The accuracy rule spends its false-pass budget first, so an undersized pool shows up after hours of evaluation as
`inconclusive`. compare.planning says which variant a pool must be able to pass (pipelines/judging/planning.py);
this says, before anything runs, how often each row's looks would, and how many items would make it often enough.
"""

from __future__ import annotations

from pipelines.diagnose.check import OK, WARN, Check


def pools_check(params) -> Check:
    from pipelines.evaluation.plans import probe_plans
    from pipelines.judging.planning import plan_all

    plans = probe_plans(params.evaluate.domains, params.evaluate)
    planned = plan_all(plans, params.compare, params.evaluate.look_items, params.evaluate.max_looks)
    g = params.compare.planning
    short, parts = [], []
    for row, r in planned["rows"].items():
        parts.append(f"{row} {r['items']} items/{r['families']} families, drop {r['drop']:g}: {r['pass_rate']:.2f}")
        if r["pass_rate"] < g.power:
            pool = plans[row]["pool"]
            if r["items_for_power"] is None:
                short.append(f"{row}: no number of items reaches {g.power:g} with its {r['families']} families; "
                             "add items from more families")
            elif r["items_for_power"] > pool:
                short.append(f"{row}: about {r['items_for_power']} items (the pool has {pool})")
            else:
                short.append(f"{row}: about {r['items_for_power']} items (the looks stop at {r['items']}: "
                             "evaluate.max_items)")
    detail = (f"pass rate of a variant {g.drop_of_margin:g} x the margin below fp16 (flip rate {g.flip_rate:g}, "
              f"within-family correlation {g.icc:g}; compare.planning): " + "; ".join(parts))
    if short:
        return Check("pools", WARN, detail + f". Below {g.power:g}: " + "; ".join(short),
                     "such a variant would mostly be `inconclusive`: add probe items (eval/<type>/) or raise "
                     "evaluate.max_items (docs/compare.md, \"Sizing a pool\")")
    return Check("pools", OK, detail)
