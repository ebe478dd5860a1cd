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


def docstring_items(seed: int, count: int, n_choices: int = 4) -> list[dict]:
    """Given a function's signature, pick its docstring's first line among those of other functions."""
    rng = random.Random(seed)
    pool = []
    for s in code_samples():
        lines = s.code.split("\n")
        if s.kind == "docstring" and len(lines) > 1 and lines[1].strip().startswith('"""') and lines[0].endswith(":"):
            pool.append((lines[0], lines[1][: len(lines[1]) - len(lines[1].lstrip())], s.comment.splitlines()[0]))
    items = []
    for signature, indent, first in rng.sample(pool, min(count, len(pool))):
        wrong = rng.sample(sorted({f for _, _, f in pool if f != first}), n_choices - 1)
        gold = rng.randrange(n_choices)
        items.append({"context": f'{signature}\n{indent}"""', "choices": wrong[:gold] + [first] + wrong[gold:], "gold": gold})
    return items


def code_comment_probes(seed: int = PROBE_SEED, count: int = ITEMS_PER_DOMAIN) -> list[dict]:
    """Both directions, from the shipped code snapshot: the code a comment describes (half), and the
    right comment (docstring) for a piece of code (half); `direction` says which."""
    to_code = code_comment_items(code_samples(), seed, count // 2)
    to_comment = docstring_items(seed, count - count // 2)
    items = [{"direction": "comment_to_code", **i} for i in to_code] + [{"direction": "code_to_comment", **i} for i in to_comment]
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
