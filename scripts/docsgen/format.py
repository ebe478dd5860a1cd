"""How the docs print numbers: signed differences with a real minus sign, intervals, counts, percentages, tables."""

from __future__ import annotations

MINUS = "\u2212"


def signed(x: float, nd: int = 3) -> str:
    """+0.010, -0.015 (with a real minus sign), +0.000 for zero."""
    text = f"{abs(x):.{nd}f}"
    return (MINUS if x < 0 and float(text) != 0 else "+") + text


def interval(low: float, high: float, nd: int = 3) -> str:
    return f"[{signed(low, nd)}, {signed(high, nd)}]"


def count(n) -> str:
    return f"{int(n):,}"


def pct(x: float, nd: int = 1) -> str:
    return f"{100 * x:.{nd}f} %"


def small(x: float | None) -> str:
    """A KL value: 4 decimals under 0.01, else 3."""
    if x is None:
        return "–"
    return f"{x:.4f}" if abs(x) < 0.01 else f"{x:.3f}"


def span(values: list[float], fmt, sep: str = "–") -> str:
    """'a–b' of the smallest and largest, or one value when they print the same."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def minus(text: str) -> str:
    return text.replace("-", MINUS) if text.startswith("-") else text


def words(items: list[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out
