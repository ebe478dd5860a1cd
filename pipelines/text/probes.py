"""The project's probe items (eval/<domain>/items.jsonl), generated from seeds and shipped sources.

`scripts/make_sources.py` writes them; a test checks the committed files equal what this module
generates. Each item has a stable `id`, which the A/B stage uses to pair items across variants.
"""

from __future__ import annotations

import random

from pipelines.text import arithmetic, synthetic

PROBE_SEED = 2024
POOL = 1000  # items per domain (math 2000, code_comment 1100); the first look takes 200 (evaluate.look_items)
# Each pool is sized to compare.planning before anything runs: a variant 2 points worse, flips correlated 0.025 within a
# family, passes at least 0.55 of the time (math 0.62, code 0.63, code_comment 0.555, chat 0.60: `quantgate doctor`).
CODE_COMMENT_POOL = 1100


def math_probes(seed: int = PROBE_SEED, count: int = 2 * POOL) -> list[dict]:
    """Half two-digit additions the reference model never trained on, half symbol math (× ÷ √ ² fractions, LaTeX).
    Family: the kind of symbol math, each kind taken in turn so the families are as equal as the kinds' prompts
    allow (power and root have about 30); additions by the first operand's tens digit (25 families)."""
    _, held_out = arithmetic.split_addition_pairs(0, 1000)  # the reference model's held-out pairs (seed 0)
    rng = random.Random(seed)
    # additions are grouped by the first operand's tens digit: items that share the digits a model carries
    items = [{"kind": "add", "family": f"add-{a // 10}", "question": f"{a}+{b}=", "answer": str(a + b)}
             for a, b in held_out[: count // 2]]
    kinds = [k for k in arithmetic.MATH_KINDS if k != "add"]
    seen: set[str] = set()
    while len(items) < count:
        grew = False
        for kind in kinds:
            if len(items) == count:
                break
            for _ in range(200):  # a kind whose prompts have run out is passed over
                _, prompt, answer = arithmetic.math_problem(rng, kind)
                if prompt not in seen:
                    seen.add(prompt)
                    items.append({"kind": kind, "family": kind, "question": prompt, "answer": answer})
                    grew = True
                    break
        if not grew:
            raise ValueError(f"the math kinds have fewer than {count - len(items)} more distinct prompts")
    return [{"id": f"math-{i:04d}", **item} for i, item in enumerate(items)]


def code_comment_probes(seed: int = PROBE_SEED, count: int = CODE_COMMENT_POOL) -> list[dict]:
    """Complete a function from its Chinese comment (its name says nothing): held-out (template, number)
    pairs, at most two names per pair and phrasing. Family: template and phrasing (the same comment words)."""
    _, held_out = synthetic.split_commented_cases(0)  # never trained on, in any phrasing or name
    rng = random.Random(seed)
    picked, seen = [], {}
    for template, n, phrasing, name in held_out:
        if seen.get((template, n, phrasing), 0) < 2:
            seen[(template, n, phrasing)] = seen.get((template, n, phrasing), 0) + 1
            picked.append((template, n, phrasing, name))
    rng.shuffle(picked)
    items = []
    for template, n, phrasing, name in sorted(picked[:count]):
        prompt, body, comment = synthetic.commented_function(template, n, phrasing, name)
        items.append({"template": template, "n": n, "family": f"{template}-p{phrasing}", "comment": comment,
                      "prompt": prompt, "answer": body.strip()})
    return [{"id": f"code_comment-{i:04d}", **item} for i, item in enumerate(items)]


def chat_items(dialogues: list[dict], seed: int, count: int, n_choices: int = 4) -> list[dict]:
    """Given a customer turn, pick the agent reply of the same intent and language."""
    rng = random.Random(seed)
    items = []
    for d in rng.sample(dialogues, min(count, len(dialogues))):
        others = [o["agent"] for o in dialogues if o["lang"] == d["lang"] and o["intent"] != d["intent"]]
        wrong = rng.sample(sorted(set(others)), n_choices - 1)
        gold = rng.randrange(n_choices)
        choices = [" " + c for c in wrong[:gold] + [d["agent"]] + wrong[gold:]]
        items.append({"context": f"Customer: {d['customer']}\nAgent:", "choices": choices, "gold": gold,
                      "family": f"{d['intent']}-{d['lang']}-{d['ask']}"})
    return items


def chat_probes(seed: int = PROBE_SEED, count: int = POOL) -> list[dict]:
    """Pick the agent's reply to a customer turn among 4 (English and Chinese); family: intent and language."""
    items = chat_items(synthetic.dialogues(seed, 4 * count), seed, count)
    return [{"id": f"chat-{i:04d}", **item} for i, item in enumerate(items)]


def code_probes(seed: int = PROBE_SEED, count: int = POOL) -> list[dict]:
    """Complete a function body, run against unit tests: the reference model's held-out cases first,
    then trained ones (`seen_in_training`) up to `count` (there are 1,044 cases in all)."""
    trained, held_out = synthetic.split_function_cases(0)  # the reference model's split (seed 0)
    extra = sorted(trained)
    random.Random(seed).shuffle(extra)
    cases = [(c, False) for c in held_out] + [(c, True) for c in extra[: max(0, count - len(held_out))]]
    items = []
    for i, ((template, n), seen) in enumerate(cases[:count]):
        source = synthetic.function_source(template, n)
        prompt, body = source.rsplit("return", 1)
        items.append({"id": f"code-{i:04d}", "template": template,
                      "family": f"{template}-{'trained' if seen else 'held-out'}", "seen_in_training": seen,
                      "prompt": prompt + "return", "canonical": body, "tests": synthetic.function_tests(template, n)})
    return items


# --------------------------------------------------------------------------------------------
# Math as multiple choice: for a real model that does not answer a bare `25+60=` (the real-model profile)
# --------------------------------------------------------------------------------------------

MATH_CHOICE_SEED = PROBE_SEED + 1


def _near_misses(kind: str, answer: str, question: str) -> list[str]:
    """Wrong answers a model that almost computes would give: off by one, two or ten; for fractions the other
    operation, numerators and denominators added, and a numerator off by one."""
    import re
    from fractions import Fraction

    fraction = re.fullmatch(r"(\d+)(?:/(\d+))?([+-])(\d+)(?:/(\d+))?", question) if kind == "fraction" else None
    if fraction:
        a, b, op, c, d = fraction.groups()
        p, q = Fraction(int(a), int(b or 1)), Fraction(int(c), int(d or 1))
        right = Fraction(answer)
        wrong = [p - q if op == "+" else p + q, Fraction(p.numerator + q.numerator, p.denominator + q.denominator),
                 right + Fraction(1, right.denominator), right - Fraction(1, right.denominator),
                 Fraction(right.denominator, max(1, abs(right.numerator))) if right else Fraction(1, 2)]
        return [arithmetic.frac(w) for w in wrong]
    value = int(answer)
    return [str(value + step) for step in (-10, -2, -1, 1, 2, 10) if value < 0 or value + step >= 0]


def math_choice_probes(seed: int = MATH_CHOICE_SEED, count: int = POOL, n_choices: int = 4) -> list[dict]:
    """Pick the value of an expression among four, scored by log-likelihood: the math generator's kinds (additions,
    × ÷ ^ ² √, fractions, LaTeX) asked as `Question: What is 56÷7?` / `Answer: 56÷7 =`, the wrong choices near misses.
    Written for a real model that does not answer a bare `25+60=` by itself (SmolLM2-135M answers none of those);
    the generator and its seed are the project's own (Apache-2.0). Family: the kind and the expression's first digit
    (items that share the digits a model carries fail together)."""
    rng = random.Random(seed)
    items, seen = [], set()
    while len(items) < count:
        # the nine kinds this pool was first measured with (docs/real-model.md); the same draws as before they grew
        kind, prompt, answer = arithmetic.math_problem(rng, rng.choice(arithmetic.MATH_KINDS[:9]))
        question = prompt.removesuffix("=")
        if question in seen:
            continue
        seen.add(question)
        wrong = sorted(set(_near_misses(kind, answer, question)) - {answer})
        if len(wrong) < n_choices - 1:
            continue
        picked = rng.sample(wrong, n_choices - 1)
        gold = rng.randrange(n_choices)
        choices = [" " + c for c in picked[:gold] + [answer] + picked[gold:]]
        digit = next((ch for ch in question if ch.isdigit()), "0")
        items.append({"kind": kind, "family": f"{kind}-{digit}", "question": question, "choices": choices, "gold": gold})
    return [{"id": f"math_choice-{i:04d}", **item} for i, item in enumerate(items)]
