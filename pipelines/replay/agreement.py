"""How far a variant's replayed answers sit from fp16's, per request type and context bucket, with intervals.

Exact agreement is a proportion (Wilson 95 %, pipelines/judging/stats.py); similarity is a mean of per-answer
ratios (Student's t); the outcome compares what the answer is for: the final number of a math answer, or whether
it contains the log's reference answer.
"""

from __future__ import annotations

import difflib
import math
import re
import statistics

from pipelines.judging.stats import lower_limit

CONFIDENCE = 0.95
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MATH = "math"


def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> dict:
    """Share with both ends of its Wilson interval (the upper end is 1 - the lower end of the complement)."""
    if n <= 0:
        return {"share": math.nan, "low": math.nan, "high": math.nan}
    share = successes / n
    return {"share": share, "low": lower_limit(share, n, confidence),
            "high": min(1.0, 1 - lower_limit(1 - share, n, confidence))}


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> dict:
    """Mean with a Student's t interval, clipped to [0, 1]; one value bounds nothing ([0, 1])."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "low": 0.0, "high": 1.0}
    spread = statistics.stdev(values)
    half = float(stats.t.ppf(1 - (1 - confidence) / 2, n - 1)) * spread / math.sqrt(n)
    return {"mean": mean, "low": max(0.0, mean - half), "high": min(1.0, mean + half)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where the answers differ (the shorter one's length when one extends the other)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def similarity(a: list[int], b: list[int]) -> float:
    """difflib's ratio over token ids: 1 for equal answers, 0 for answers with nothing in common."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def final_number(text: str) -> str | None:
    """The last number in an answer, normalised (12.50 -> 12.5), or None."""
    found = NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = found[-1]
    return value.rstrip("0").rstrip(".") if "." in value else value


def outcome(kind: str | None, base: list[str], variant: list[str], references: list[str | None]) -> dict | None:
    """The share of requests whose outcome under the variant equals fp16's, with its interval."""
    if kind == "reference":
        pairs = [(ref in b, ref in v) for b, v, ref in zip(base, variant, references) if ref is not None]
        if not pairs:
            return None
        same = sum(b == v for b, v in pairs)
        return {"kind": "reference", "requests": len(pairs), **wilson(same, len(pairs)),
                "fp16_correct": sum(b for b, _ in pairs) / len(pairs),
                "variant_correct": sum(v for _, v in pairs) / len(pairs)}
    if kind == "final_number":
        same = sum(final_number(b) == final_number(v) for b, v in zip(base, variant))
        return {"kind": "final_number", "requests": len(base), **wilson(same, len(base)),
                "fp16_correct": None, "variant_correct": None}
    return None


def summarise(base_ids: list[list[int]], variant_ids: list[list[int]], base_text: list[str], variant_text: list[str],
              references: list[str | None], kind: str | None) -> dict:
    """One cell of shadow.json's agreement (a type, or a type x bucket) from paired answers."""
    n = len(base_ids)
    exact = sum(a == b for a, b in zip(base_ids, variant_ids))
    firsts = [d for a, b in zip(base_ids, variant_ids) if (d := first_difference(a, b)) is not None]
    return {"requests": n,
            "exact": wilson(exact, n),
            "first_difference": {"median": float(statistics.median(firsts)) if firsts else None,
                                 "mean": sum(firsts) / len(firsts) if firsts else None},
            "similarity": mean_interval([similarity(a, b) for a, b in zip(base_ids, variant_ids)]),
            "outcome": outcome(kind, base_text, variant_text, references)}


def agreement(types: list[str], buckets: list[int], base_ids: list[list[int]], variant_ids: list[list[int]],
              base_text: list[str], variant_text: list[str], references: list[str | None]) -> dict:
    """{type: {str(bucket) | "all": cell}} over the replayed requests (all lists in the same request order)."""
    out: dict = {}
    for kind_of_type in sorted(set(types)):  # a type's outcome: its log's reference answers where it has any
        has_reference = any(r is not None for t, r in zip(types, references) if t == kind_of_type)
        kind = "reference" if has_reference else ("final_number" if kind_of_type == MATH else None)
        cells = {}
        for key in [*(str(b) for b in sorted(set(buckets))), "all"]:
            picked = [i for i, (t, b) in enumerate(zip(types, buckets))
                      if t == kind_of_type and (key == "all" or str(b) == key)]
            if picked:
                cells[key] = summarise([base_ids[i] for i in picked], [variant_ids[i] for i in picked],
                                       [base_text[i] for i in picked], [variant_text[i] for i in picked],
                                       [references[i] for i in picked], kind)
        out[kind_of_type] = cells
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
