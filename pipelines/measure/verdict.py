"""Judging what `memory` measured: the leak verdict for one soak, and every variant's growth against fp16.

`pipelines/memory.py` measures; this module only reads its results (no torch), and
`pipelines/measure/plots.py` draws them.
"""

from __future__ import annotations

import math

from pipelines.core.params_sections import MemoryParams
from pipelines.core.paths import BASELINE


def leak_verdict(soak_result: dict, footprint: int, p: MemoryParams, cause: dict | None = None) -> dict:
    """Leak when memory never settled (it still grows at the last round) and the growth rate over `rounds`
    rounds exceeds leak_tolerance_pct of the load footprint, or the tracer confirmed a leak (one site growing in
    every third of the traced rounds), whatever its rate. Warm-up that plateaus is not a leak, nor is growth
    the tracer saw stop (`cause`, pipelines/measure/attribution.py): a bounded cache, whose final size is then
    judged as growth against fp16 (summarize). Fragmentation on CUDA (the reserve grows while the bytes in use
    settled) is judged by the same rule on the reserve's growth."""
    rate = soak_result.get("growth_bytes_per_round")
    if (cause or {}).get("class") == "fragmentation" and cause.get("judged") and footprint > 0:
        reserved = cause["reserved_growth_bytes_per_round"]
        pct = 100 * reserved * p.rounds / footprint
        return {"leak": pct > p.leak_tolerance_pct, "growth_bytes_per_round": reserved,
                "projected_growth_bytes": reserved * p.rounds, "growth_pct_of_footprint": pct,
                "tolerance_pct": p.leak_tolerance_pct, "noise_floor_bytes": p.noise_floor_bytes,
                "class": "fragmentation",
                "reason": f"the bytes in use settled, the allocator's reserve did not: {cause['evidence']}; judged on "
                          f"the reserve: {pct:.3f} % of the load footprint over {p.rounds} rounds (tolerance "
                          f"{p.leak_tolerance_pct} %)"}
    if rate is None or not math.isfinite(rate) or footprint <= 0:
        return {"leak": None, "reason": "too few measured rounds or no footprint to judge"}
    if (cause or {}).get("class") == "cache" and cause.get("status") == "ok":
        pct = 100 * cause["size_bytes"] / footprint
        return {"leak": False, "growth_bytes_per_round": 0.0, "projected_growth_bytes": cause["size_bytes"],
                "growth_pct_of_footprint": pct, "tolerance_pct": p.leak_tolerance_pct,
                "noise_floor_bytes": p.noise_floor_bytes, "class": "cache",
                "reason": f"grew {rate:,.0f} B/round in the soak, then stopped under the tracer: a bounded cache, not a "
                          f"leak; its {cause['size_bytes']:,} B ({pct:.3f} % of the load footprint) count as growth "
                          f"against fp16"}
    projected = rate * p.rounds
    pct = 100 * projected / footprint
    confirmed = (cause or {}).get("class") == "leak" and cause.get("status") == "ok"
    leak = pct > p.leak_tolerance_pct or confirmed  # the tolerance is for growth no allocation site explains
    measured = len(soak_result["rounds"])
    warm = soak_result.get("warmup_end_round")
    state = (f"settled at round {warm} of {measured} (rises under the {p.noise_floor_bytes:,} B noise floor after it)"
             if warm is not None else f"still growing {rate:,.0f} B/round over the last {soak_result['tail_rounds']} "
             f"of {measured} rounds")
    return {"leak": leak, "growth_bytes_per_round": rate, "projected_growth_bytes": projected,
            "growth_pct_of_footprint": pct, "tolerance_pct": p.leak_tolerance_pct, "noise_floor_bytes": p.noise_floor_bytes,
            "class": (cause or {}).get("class"),
            "reason": f"{state}; over {p.rounds} rounds that is {pct:.3f} % of the load footprint: "
                      f"{'a leak' if leak else 'not a leak'} (tolerance {p.leak_tolerance_pct} %"
                      + ("; a leak the tracer confirmed fails under it too" if confirmed else "") + ")"
                      + (f"; {cause['class']}: {cause.get('evidence') or cause.get('error')}" if cause else "")}


def projected_growth(r: dict, p: MemoryParams, baseline: bool = False) -> float | None:
    """Bytes a variant's memory grows by over `rounds` rounds: a bounded cache's final size, judged fragmentation's
    reserve growth, else the soak's growth rate (0 once settled) times `rounds`. For the baseline, what is
    subtracted from every variant's: a cache counts 0 (its size is not a lower bound), the rest as measured."""
    judged = r.get("leak") or {}
    if judged.get("class") == "cache":
        return 0.0 if baseline else judged["projected_growth_bytes"]
    if judged.get("class") == "fragmentation" and not baseline:
        return judged["projected_growth_bytes"]
    growth = r["soak"]["growth_bytes_per_round"]
    return None if growth is None else growth * p.rounds


def _ooms(r: dict) -> str | None:
    """Every out-of-memory error one variant's measurement saw, with its phase; None when there was none."""
    ooms = [f"sweep at {x['tokens']} tokens: {x['oom']}" for x in r["sweep"]["lengths"] if x.get("oom")]
    if r["soak"].get("oom"):
        ooms.append(r["soak"]["oom"])
    if (r.get("allocator") or {}).get("ooms"):
        ooms.append(f"the CUDA allocator ran out of memory {r['allocator']['ooms']} times (caught and retried)")
    return "; ".join(ooms) or None


def describe(variant: str, cause: dict | None) -> str | None:
    """One line for results/report.md: what grows, how fast, of what class, and where."""
    if not cause:
        return None
    if cause["class"] == "fragmentation":
        return f"{variant}: fragmentation: {cause['evidence']}"
    if cause.get("status") == "failed":
        return f"{variant}: grows, cause not traced: {cause['error']}"
    top = (cause.get("sites") or [None])[0]
    rate = cause.get("soak_growth_bytes_per_round") or 0
    where = (f"{top['share']:.0%} under {top['frame'] or top['native']} in {top['library']}"
             if top and top.get("share") else "no allocation site found")
    label = {"cache": f"a bounded cache of {cause.get('size_bytes', 0) / 1e6:.2f} MB",
             "leak": "a leak", "unbounded": "unbounded growth"}[cause["class"]]
    return f"{variant} grows {rate / 1e6:.2f} MB/round in the soak, {label}: {where}"


def summarize(results: dict[str, dict], p: MemoryParams, baseline: str = BASELINE) -> dict:
    """Per variant: footprint, peaks, growth rate, leak verdict, OOM, and growth_excess_pct against fp16.

    growth_excess_pct = 100 x (variant's projected growth - fp16's) / fp16's footprint, where the projected growth
    is 0 for memory that settled (warm-up that plateaus counts as nothing), a bounded cache's final size for growth
    the tracer saw stop, and the last rounds' slope x `rounds` for memory that never did: extra growth on a common
    denominator, so 3 % means 'grows 3 % of an fp16 model more over the rounds'.
    """
    base = results.get(baseline)
    base_ok = bool(base) and base.get("status") == "ok"
    base_growth = projected_growth(base, p, baseline=True) if base_ok else None
    rows = {}
    for name, r in results.items():
        if r.get("status") == "not_measured":  # a candidate evaluated elsewhere (its sample log): no model here
            rows[name] = {"status": "not_measured", "reason": r.get("reason") or "not measured"}
            continue
        if r.get("status") != "ok":
            rows[name] = {"status": "failed", "error": r.get("error", "no result"),  # environment: this machine's
                          **{k: r[k] for k in ("cause", "reason", "remedy") if r.get(k)}}
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
               "growth_class": (r.get("growth_cause") or {}).get("class"),
               "growth_cause": describe(name, r.get("growth_cause")),
               "growth_excess_pct": None}
        after = r["load"].get("tensor_bytes_after_forward")
        if after is not None and after != r["load"]["tensor_bytes"]:  # only where the forward unpacked weights
            row["serving_tensor_bytes"] = after
        projected = projected_growth(r, p)
        if base_ok and projected is not None and base_growth is not None:
            row["growth_excess_pct"] = 100 * (projected - base_growth) / base["load"]["footprint_bytes"]
        if base_ok:
            row["footprint_saving_pct"] = 100 * (1 - r["load"]["footprint_bytes"] / base["load"]["footprint_bytes"])
        rows[name] = row
    return {"baseline": baseline, "baseline_ok": base_ok, "noise_floor_bytes": p.noise_floor_bytes, "variants": rows}
