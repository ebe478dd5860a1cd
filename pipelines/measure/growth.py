"""Growth statistics over a series of memory readings: slopes, the end of warm-up, the rate that remains.

Pure numbers (no torch): the soak (pipelines/measure/phases.py) uses them to decide when to stop and what it saw.
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (bytes per token, bytes per round)."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of the pairwise slopes: one spike (a one-off allocation) cannot move it, unlike least squares."""
    if len(xs) < 2:
        return float("nan")
    return float(stats.theilslopes(np.asarray(ys, float), np.asarray(xs, float))[0])


def median3(values: list[float]) -> list[float]:
    """Running median of three: one-off spikes (a single allocation in one round) vanish, steps stay."""
    if len(values) < 3:
        return list(values)
    return [values[0]] + [float(np.median(values[i - 1 : i + 2])) for i in range(1, len(values) - 1)] + [values[-1]]


def warmup_end(values: list[float], tail: int, floor: float) -> int | None:
    """First measured round after which memory never rises more than `floor` above the lowest level seen
    since that round (one-off spikes ignored), with at least `tail` rounds to show it. None: it never
    settled. Rises are measured from the running minimum, so memory that drops (a pool handed back) and
    then grows again is growth. What comes before the returned round is warm-up: caches and pools filling,
    which stops; a leak never settles. A leak that grows in steps rarer than every `tail` rounds can look
    settled: raise `memory.tail_rounds` to look for slower ones."""
    smooth = median3(values)
    for start in range(0, len(smooth) - tail + 1):
        low, rise = smooth[start], 0.0
        for value in smooth[start:]:
            low = min(low, value)
            rise = max(rise, value - low)
        if rise <= floor:
            return start
    return None


def growth_rate(values: list[float], tail: int, floor: float) -> float | None:
    """Bytes per round memory still grows by: 0 once it has settled (warmup_end), else the Theil-Sen slope
    of the last `tail` rounds (never below 0)."""
    if len(values) < 2:
        return None
    if warmup_end(values, tail, floor) is not None:
        return 0.0
    window = values[-tail:]
    return max(0.0, theil_sen(list(range(len(window))), window))
