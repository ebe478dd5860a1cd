"""Seeded symbol math: the reference model's math lines, the math probes' items and the production sample's math
requests, each a (kind, prompt, answer) from one generator.

A pure function of its seed, like everything in pipelines/text/synthetic.py, so every machine builds the same lines.
"""

from __future__ import annotations

import random
from fractions import Fraction


def addition_pairs() -> list[tuple[int, int]]:
    """All two-digit additions a+b (10 <= a, b <= 99)."""
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


def split_addition_pairs(seed: int, held_out: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split the two-digit additions into (train, held_out) so skill is measured on unseen sums."""
    pairs = addition_pairs()
    random.Random(seed).shuffle(pairs)
    return pairs[held_out:], pairs[:held_out]


def addition_line(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}"


def frac(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


# The kinds of math line the reference model learns and the math probes ask, each a probe family of its own: items
# of one kind fail together. Seventeen kinds give the probe pool 25 families (with the additions' nine), which is what
# compare.planning asks of a pool for a variant 2 points worse to pass (docs/compare.md, "Sizing a pool").
MATH_KINDS = ["add", "sub", "mul", "div", "power", "root", "fraction", "latex_frac", "multi_step",
              "latex_times", "latex_div", "square_sum", "order_ops", "root_sum", "sqrt_times", "power_plus",
              "fraction_times"]


def math_problem(rng: random.Random, kind: str | None = None) -> tuple[str, str, str]:
    """One (kind, prompt, answer) math item, of `kind` or of a kind drawn at random; prompt + answer is the full
    training line."""
    kind = kind or rng.choice(MATH_KINDS)
    if kind not in MATH_KINDS:
        raise ValueError(f"no math kind {kind!r}: one of {', '.join(MATH_KINDS)}")
    if kind in COMPOSED_KINDS:
        return kind, *COMPOSED_KINDS[kind](rng)
    if kind == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return kind, f"{a}+{b}=", str(a + b)
    if kind == "sub":
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        return kind, f"{a}-{b}=", str(a - b)
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return kind, f"{a}×{b}=", str(a * b)
    if kind == "div":
        b, q = rng.randint(2, 12), rng.randint(2, 12)
        return kind, f"{b * q}÷{b}=", str(q)
    if kind == "power":
        a, e = rng.randint(2, 9), rng.choice([2, 3])
        sym = rng.choice([f"{a}^{e}", f"{a}{'²' if e == 2 else '³'}"])
        return kind, f"{sym}=", str(a**e)
    if kind == "root":
        r = rng.randint(2, 15)
        sym = rng.choice([f"√{r * r}", f"\\sqrt{{{r * r}}}"])
        return kind, f"{sym}=", str(r)
    if kind == "fraction":
        p, q = Fraction(rng.randint(1, 5), rng.randint(2, 6)), Fraction(rng.randint(1, 5), rng.randint(2, 6))
        op = rng.choice(["+", "-"])
        res = p + q if op == "+" else p - q
        return kind, f"{frac(p)}{op}{frac(q)}=", frac(res)
    if kind == "latex_frac":
        d, k = rng.randint(2, 9), rng.randint(1, 9)
        n = rng.randint(1, d - 1)
        return kind, f"\\frac{{{n}}}{{{d}}}\\times {d * k}=", str(n * k)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9)
    op = rng.choice(["+", "-"])
    inner = a + b if op == "+" else a - b
    return "multi_step", f"({a}{op}{b})×{c}=", str(inner * c)


def _latex_times(rng: random.Random) -> tuple[str, str]:
    a, b, sym = rng.randint(2, 12), rng.randint(2, 12), rng.choice(["\\times", "\\cdot"])
    return f"{a}{sym} {b}=", str(a * b)


def _latex_div(rng: random.Random) -> tuple[str, str]:
    b, q = rng.randint(2, 12), rng.randint(2, 12)
    return f"{b * q}\\div {b}=", str(q)


def _square_sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 12), rng.randint(1, 12)
    return f"{a}²+{b}²=", str(a * a + b * b)


def _order_ops(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(1, 20), rng.randint(2, 9), rng.randint(2, 9)
    return f"{a}+{b}×{c}=", str(a + b * c)


def _root_sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"√{a * a}+√{b * b}=", str(a + b)


def _sqrt_times(rng: random.Random) -> tuple[str, str]:
    r, k = rng.randint(2, 12), rng.randint(2, 12)
    return f"\\sqrt{{{r * r}}}\\times {k}=", str(r * k)


def _power_plus(rng: random.Random) -> tuple[str, str]:
    a, e, b = rng.randint(2, 9), rng.choice([2, 3]), rng.randint(1, 20)
    return f"{a}^{e}+{b}=", str(a**e + b)


def _fraction_times(rng: random.Random) -> tuple[str, str]:
    d, k = rng.randint(2, 9), rng.randint(1, 9)
    n = rng.randint(1, d - 1)
    return f"{n}/{d}×{d * k}=", str(n * k)


# kinds that compose two operations or write one in LaTeX (added 2026-12-05 to grow the probe families): each
# draws its (prompt, answer) from the rng
COMPOSED_KINDS = {"latex_times": _latex_times, "latex_div": _latex_div, "square_sum": _square_sum, "order_ops": _order_ops,
             "root_sum": _root_sum, "sqrt_times": _sqrt_times, "power_plus": _power_plus,
             "fraction_times": _fraction_times}


def math_lines(seed: int, count: int) -> list[str]:
    """`count` seeded math lines of every kind, e.g. '√49=7', '\\frac{3}{4}\\times 8=6'."""
    rng = random.Random(seed)
    return [p + a for _, p, a in (math_problem(rng) for _ in range(count))]
