"""Judging what `memory` measured: the leak verdict for one soak, and every variant's growth against fp16.

`pipelines/memory.py` measures; this module only reads its results (no torch), and
`pipelines/measure/plots.py` draws them.
"""

from __future__ import annotations

import math

from pipelines.core.params_sections import MemoryParams
from pipelines.core.paths import BASELINE


def leak_verdict(soak_result: dict, footprint: int, p: MemoryParams) -> dict:
    """Leak when memory never settled (it still grows at the last round) and the growth rate over `rounds`
    rounds exceeds leak_tolerance_pct of the load footprint. Warm-up that plateaus is not a leak."""
    rate = soak_result.get("growth_bytes_per_round")
    if rate is None or not math.isfinite(rate) or footprint <= 0:
        return {"leak": None, "reason": "too few measured rounds or no footprint to judge"}
    projected = rate * p.rounds
    pct = 100 * projected / footprint
    leak = pct > p.leak_tolerance_pct
    measured = len(soak_result["rounds"])
    warm = soak_result.get("warmup_end_round")
    state = (f"settled at round {warm} of {measured} (rises under the {p.noise_floor_bytes:,} B noise floor after it)"
             if warm is not None else f"still growing {rate:,.0f} B/round over the last {soak_result['tail_rounds']} "
             f"of {measured} rounds")
    return {"leak": leak, "growth_bytes_per_round": rate, "projected_growth_bytes": projected,
            "growth_pct_of_footprint": pct, "tolerance_pct": p.leak_tolerance_pct, "noise_floor_bytes": p.noise_floor_bytes,
            "reason": f"{state}; over {p.rounds} rounds that is {pct:.3f} % of the load footprint: "
                      f"{'a leak' if leak else 'not a leak'} (tolerance {p.leak_tolerance_pct} %)"}


def _ooms(r: dict) -> str | None:
    """Every out-of-memory error one variant's measurement saw, with its phase; None when there was none."""
    ooms = [f"sweep at {x['tokens']} tokens: {x['oom']}" for x in r["sweep"]["lengths"] if x.get("oom")]
    if r["soak"].get("oom"):
        ooms.append(r["soak"]["oom"])
    if (r.get("allocator") or {}).get("ooms"):
        ooms.append(f"the CUDA allocator ran out of memory {r['allocator']['ooms']} times (caught and retried)")
    return "; ".join(ooms) or None


def summarize(results: dict[str, dict], p: MemoryParams, baseline: str = BASELINE) -> dict:
    """Per variant: footprint, peaks, growth rate, leak verdict, OOM, and growth_excess_pct against fp16.

    growth_excess_pct = 100 x (variant's growth rate - fp16's) x `rounds` / fp16's footprint, where the growth
    rate is 0 for memory that settled (warm-up that plateaus counts as nothing) and the last rounds' slope for
    memory that never did: extra growth on a common denominator, so 3 % means 'grows 3 % of an fp16 model more
    over the rounds'.
    """
    base = results.get(baseline)
    base_ok = bool(base) and base.get("status") == "ok"
    base_growth = base["soak"]["growth_bytes_per_round"] if base_ok else None
    rows = {}
    for name, r in results.items():
        if r.get("status") != "ok":
            rows[name] = {"status": "failed", "error": r.get("error", "no result")}
            continue
        growth = r["soak"]["growth_bytes_per_round"]
        row = {"status": "ok", "device": r["device"], "footprint_bytes": r["load"]["footprint_bytes"],
               "theoretical_weight_bytes": r["load"]["theoretical_weight_bytes"],
               "peak_by_tokens": {str(x["tokens"]): x.get("decode_peak_increase") for x in r["sweep"]["lengths"]},
               "fitted_bytes_per_token": r["sweep"]["fitted_bytes_per_token"],
               "theoretical_kv_bytes_per_token": r["sweep"]["theoretical_kv_bytes_per_token"],
               "measured_rounds": len(r["soak"]["rounds"]), "warmup_end_round": r["soak"].get("warmup_end_round"),
               "growth_bytes_per_round": growth,
               "growth_bytes_per_request": None if growth is None else growth / r["soak"]["requests_per_round"],
               "leak": r["leak"]["leak"], "oom": _ooms(r),
               "fragmentation": r["soak"]["fragmentation"]["one_minus_allocated_over_reserved"],
               "growth_excess_pct": None}
        if base_ok and growth is not None and base_growth is not None:
            row["growth_excess_pct"] = 100 * (growth - base_growth) * p.rounds / base["load"]["footprint_bytes"]
        if base_ok:
            row["footprint_saving_pct"] = 100 * (1 - r["load"]["footprint_bytes"] / base["load"]["footprint_bytes"])
        rows[name] = row
    return {"baseline": baseline, "baseline_ok": base_ok, "noise_floor_bytes": p.noise_floor_bytes, "variants": rows}
