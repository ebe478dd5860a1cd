"""The project's probe items (eval/<domain>/items.jsonl), generated from seeds and shipped sources.

`scripts/make_sources.py` writes them; a test checks the committed files equal what this module
generates. Each item has a stable `id`, which the A/B stage uses to pair items across variants.
"""

from __future__ import annotations

import random

from pipelines import synthetic
from pipelines.reference import chat_items, code_comment_items, code_samples

PROBE_SEED = 2024
ITEMS_PER_DOMAIN = 200


def math_probes(seed: int = PROBE_SEED, count: int = ITEMS_PER_DOMAIN) -> list[dict]:
    """Half two-digit additions the reference model never trained on, half symbol math (× ÷ √ ² fractions, LaTeX)."""
    _, held_out = synthetic.split_addition_pairs(0, 500)  # the reference model's held-out pairs (seed 0)
    rng = random.Random(seed)
    items = [{"kind": "add", "question": f"{a}+{b}=", "answer": str(a + b)} for a, b in held_out[: count // 2]]
    while len(items) < count:
        kind, prompt, answer = synthetic.math_problem(rng)
        if kind != "add":
            items.append({"kind": kind, "question": prompt, "answer": answer})
    return [{"id": f"math-{i:04d}", **item} for i, item in enumerate(items)]


def code_comment_probes(seed: int = PROBE_SEED, count: int = ITEMS_PER_DOMAIN) -> list[dict]:
    """Pick the code a comment describes among 4 (from the shipped code snapshot)."""
    items = code_comment_items(code_samples(), seed, count)
    return [{"id": f"code_comment-{i:04d}", **item} for i, item in enumerate(items)]


def chat_probes(seed: int = PROBE_SEED, count: int = ITEMS_PER_DOMAIN) -> list[dict]:
    """Pick the agent's reply to a customer turn among 4 (English and Chinese)."""
    items = chat_items(synthetic.dialogues(seed, 4 * count), seed, count)
    return [{"id": f"chat-{i:04d}", **item} for i, item in enumerate(items)]


def code_probes(seed: int = PROBE_SEED, count: int = ITEMS_PER_DOMAIN) -> list[dict]:
    """Complete a function body, run against unit tests: the reference model's held-out cases first,
    then trained ones (`seen_in_training`) up to `count`."""
    trained, held_out = synthetic.split_function_cases(0)  # the reference model's split (seed 0)
    extra = sorted(trained)
    random.Random(seed).shuffle(extra)
    cases = [(c, False) for c in held_out] + [(c, True) for c in extra[: max(0, count - len(held_out))]]
    items = []
    for i, ((template, n), seen) in enumerate(cases[:count]):
        source = synthetic.function_source(template, n)
        prompt, body = source.rsplit("return", 1)
        items.append({"id": f"code-{i:04d}", "template": template, "seen_in_training": seen,
                      "prompt": prompt + "return", "canonical": body, "tests": synthetic.function_tests(template, n)})
    return items
