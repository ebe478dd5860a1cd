"""Looks: how many probe items a variant is judged on, and when more items are worth evaluating.

A domain's probe pool is taken in a fixed pseudo-random order (sha256 of domain and item id), so every
look is a random sample of the pool whatever order the items file has. Look k uses the first n_k
items: `evaluate.look_items` at the first look, the cap (`evaluate.max_items` or the pool) at the last,
at most `evaluate.max_looks` looks. At each look the accuracy rule decides on evidence only: `pass` when the
interval's low end is at or above -margin (the drop is smaller than the margin), `fail` when its high end is
below -margin (the drop is larger), and, while the interval holds -margin, `inconclusive`: then the next look
adds items, and after the last one the row stays inconclusive with the items that would decide it. Each look's
interval is taken at its group-sequential level (stats.look_alphas: boundaries computed for looks that share
items), so looking again neither raises the chance of passing a variant whose true drop is the margin above
alpha nor wastes any of it; the same levels bound the chance of failing a variant whose drop is the margin.
The first decisive look is the decision; the same function decides in `evaluate` (whether to evaluate
more), `compare` and `gate`.
"""

from __future__ import annotations

import hashlib

import numpy as np

from pipelines.judging import stats

PASS, FAIL, UNDECIDED = "pass", "fail", "inconclusive"


def plan(pool: int, look_items: int, max_items: int | None, max_looks: int = 3) -> list[int]:
    """Item counts of the looks: look_items first, the cap (the pool, or max_items) last, at most
    `max_looks` looks evenly spaced between them. Few looks keep each look's share of the false-pass
    rate large, so a close call is decided at the cap rather than left open."""
    cap = min(pool, max_items) if max_items else pool
    if cap <= 0:
        return []
    if cap <= look_items or max_looks <= 1:
        return [cap]
    steps = max_looks - 1
    looks = [round(look_items + (cap - look_items) * k / steps) for k in range(steps + 1)]
    return sorted(set(looks))


def ordered(ids: list[str], domain: str) -> list[str]:
    """The pool's fixed evaluation order: sorted by sha256(domain/id), independent of the file's order."""
    return sorted(ids, key=lambda i: hashlib.sha256(f"{domain}/{i}".encode()).hexdigest())


def accuracy_rule(paired: dict, margin: float) -> tuple[str, str]:
    """The non-inferiority decision on one look's paired numbers, and the reason in words."""
    low, high, diff = paired["ci_low"], paired["ci_high"], paired["difference"]
    interval = f"[{low:+.3f}, {high:+.3f}] ({100 * paired['confidence']:.2f} % interval, {paired['items']} items)"
    if low >= -margin:
        return PASS, f"accuracy interval {interval} stays above -{margin:.3f}"
    if high < -margin:
        return FAIL, f"accuracy drops {-diff:.3f}: interval {interval} lies below -{margin:.3f}"
    if paired.get("degrees_of_freedom") == 0:  # stats.paired_comparison: every item in one family
        return UNDECIDED, (f"one family: all {paired['items']} items share one family, so the accuracy difference "
                           "cannot be judged from within-family variation (the interval is [-1, +1])")
    return UNDECIDED, f"accuracy interval {interval} straddles -{margin:.3f}"


def run_looks(base: dict[str, bool], variant: dict[str, bool], order: list[str], looks: list[int],
              families: dict[str, str] | None, margin: float, alpha: float, spending: str) -> dict:
    """Apply the accuracy rule look by look; stop at the first decisive look or where the variant's items end.

    base/variant: item id -> correct. Returns the decisive (or last available) look's paired numbers, the
    look it came from, and every look's interval (the history), plus `complete`: whether the variant had
    every item the looks taken so far needed.
    """
    alphas = stats.look_alphas(looks, alpha, spending)
    history, result = [], None
    for k, (n, a) in enumerate(zip(looks, alphas)):
        ids = order[:n]
        if not all(i in variant and i in base for i in ids):
            break
        paired = stats.paired_comparison(np.array([base[i] for i in ids]), np.array([variant[i] for i in ids]),
                                         families=[families[i] for i in ids] if families else None,
                                         confidence=1 - 2 * a)
        decision, reason = accuracy_rule(paired, margin)
        history.append({"look": k + 1, "items": n, "alpha": a, "ci_low": paired["ci_low"], "ci_high": paired["ci_high"],
                        "difference": paired["difference"], "decision": decision})
        result = {"look": k + 1, "looks": looks, "alpha": a, "alpha_total": alpha, "spending": spending,
                  "decision": decision, "reason": reason, "paired": paired}
        if decision != UNDECIDED:
            break
    if result is None:
        return {"look": 0, "looks": looks, "decision": UNDECIDED, "history": history, "paired": None,
                "reason": f"fewer items than the first look needs ({looks[0] if looks else 0})"}
    result["history"] = history
    return result


def needed_items(result: dict) -> int:
    """How many items (in pool order) the looks taken so far needed: what evaluate must have scored
    (the first look's, when not even that was complete)."""
    looks = result["looks"]
    return looks[max(result.get("look") or 0, 1) - 1] if looks else 0


def more_items(result: dict) -> int | None:
    """Items the next look adds, or None when the decision is made or the looks are used up."""
    if result["decision"] != UNDECIDED or not result.get("look") or result["look"] >= len(result["looks"]):
        return None
    return result["looks"][result["look"]] - result["looks"][result["look"] - 1]

