"""Probe items: committed files equal their seeded generators, enough items, stable unique ids, tasks load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.text import probes

GENERATORS = {"math": probes.math_probes, "code": probes.code_probes, "code_comment": probes.code_comment_probes, "chat": probes.chat_probes}


@pytest.mark.parametrize("domain", sorted(GENERATORS))
def test_committed_items_equal_the_generator(domain):
    committed = [json.loads(line) for line in Path(f"eval/{domain}/items.jsonl").read_text().splitlines()]
    assert committed == GENERATORS[domain]()
    ids = [item["id"] for item in committed]
    assert len(ids) >= 200 and len(set(ids)) == len(ids)


def test_committed_math_choice_items_equal_their_generator_with_one_right_answer_among_four():
    """The real-model profile's math pool: four distinct choices, the gold one the expression's value (exact
    arithmetic, fractions reduced), every kind of the math generator, families enough for the interval."""
    import re
    from fractions import Fraction

    committed = [json.loads(line) for line in Path("eval/math/choice.jsonl").read_text().splitlines()]
    assert committed == probes.math_choice_probes() and len(committed) == 1000
    assert len({i["id"] for i in committed}) == 1000 and len({i["question"] for i in committed}) == 1000
    for item in committed:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4 and 0 <= item["gold"] < 4
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b, "÷": lambda a, b: a / b}
    checked = 0
    for item in committed:
        m = re.fullmatch(r"(\d+(?:/\d+)?)([-+×÷])(\d+(?:/\d+)?)", item["question"])
        if m and item["kind"] in ("add", "sub", "mul", "div", "fraction"):
            value = ops[m[2]](Fraction(m[1]), Fraction(m[3]))
            assert Fraction(item["choices"][item["gold"]].strip()) == value, item
            checked += 1
    assert checked > 500
    assert {i["kind"] for i in committed} >= {"add", "sub", "mul", "div", "power", "root", "fraction", "latex_frac"}
    assert len({i["family"] for i in committed}) >= 50
    golds = [i["gold"] for i in committed]
    assert all(golds.count(k) > 200 for k in range(4))  # no position a guess could favour


def test_math_additions_are_held_out_from_reference_training():
    from pipelines.text import arithmetic

    train, _ = arithmetic.split_addition_pairs(0, 1000)
    trained = {f"{a}+{b}=" for a, b in train}
    adds = [i for i in probes.math_probes() if i["kind"] == "add"]
    assert len(adds) == 1000 and not any(i["question"] in trained for i in adds)
    assert {i["kind"] for i in probes.math_probes()} >= {"root", "fraction", "latex_frac", "power", "div"}


def test_every_math_probe_answer_is_its_expressions_value_and_the_kinds_are_about_equal():
    """Each of the 1,000 symbol-math items evaluated independently of the generator (its symbols rewritten as Python,
    exact fractions): the answer is the expression's value. The 16 kinds take turns, so their families differ by at
    most one item, except power and root, whose prompts run out (32 and 28 there are)."""
    import math
    import re
    from collections import Counter
    from fractions import Fraction

    from pipelines.text import arithmetic

    def root(n: int) -> Fraction:
        assert math.isqrt(n) ** 2 == n, f"√{n} is not a whole number"
        return Fraction(math.isqrt(n))

    assert list(arithmetic.COMPOSED_KINDS) == arithmetic.MATH_KINDS[9:]  # every kind is drawn, and drawn by its name
    with pytest.raises(ValueError, match="no math kind 'latex_time'"):
        arithmetic.math_problem(__import__("random").Random(0), "latex_time")
    items = [i for i in probes.math_probes() if i["kind"] != "add"]
    rewrite = [(r"\\frac\{(\d+)\}\{(\d+)\}", r"(F(\1)/\2)"), (r"\\sqrt\{(\d+)\}", r"R(\1)"), (r"√(\d+)", r"R(\1)"),
               (r"\\times|\\cdot|×", "*"), (r"\\div|÷", "/"), (r"\^", "**"), ("²", "**2"), ("³", "**3"),
               (r"(\d+)/(\d+)", r"(F(\1)/\2)")]
    for item in items:
        expression = item["question"].removesuffix("=")
        for pattern, python in rewrite:
            expression = re.sub(pattern, python, expression)
        value = eval(expression, {"F": Fraction, "R": root})  # our own generated text
        assert value == Fraction(item["answer"]), item
    sizes = Counter(i["kind"] for i in items)
    assert len(sizes) == 16 and sizes["power"] == 32 and sizes["root"] == 28
    assert max(sizes.values()) - min(v for k, v in sizes.items() if k not in ("power", "root")) <= 1


def test_multiple_choice_items_have_one_gold_among_four():
    for item in probes.chat_probes():
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4 and 0 <= item["gold"] < 4


def test_task_yamls_load_in_lm_eval():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path="eval", include_defaults=False)
    assert {"quantgate_math", "quantgate_chat", "quantgate_code_comment", "quantgate_code",
            "quantgate_math_choice"} <= set(tm.all_tasks)


def test_code_items_pass_their_own_tests_with_the_canonical_body():
    """Every item is solvable: prompt + canonical body passes its tests; a wrong body fails them."""
    for item in probes.code_probes()[::25]:
        namespace: dict = {}
        exec(item["prompt"] + item["canonical"] + "\n" + item["tests"], namespace)  # our own canonical code
        with pytest.raises(AssertionError):
            exec(item["prompt"] + " None\n" + item["tests"], {})
    held = [i for i in probes.code_probes() if not i["seen_in_training"]]
    assert len(held) >= 100


def test_code_comment_probes_need_the_comment_and_are_held_out():
    """The answer is in the Chinese comment only (the name says nothing), and no (template, number) pair
    of a probe was in the reference model's training text, in any phrasing."""
    from pipelines.text import synthetic

    items = probes.code_comment_probes()
    trained, _ = synthetic.split_commented_cases(0)
    trained_pairs = {(t, n) for t, n, _, _ in trained}
    names = {line.split("(")[0][4:] for item in items for line in item["prompt"].splitlines()[:1]}
    assert names <= set(synthetic.NEUTRAL_NAMES)
    assert {i["family"] for i in items} == {f"{t}-p{p}" for t in synthetic.ZH_COMMENTS for p in range(3)}
    for item in items:
        assert (item["template"], item["n"]) not in trained_pairs
        assert str(item["n"]) in item["comment"] and str(item["n"]) in item["answer"] and item["prompt"].endswith("return")


def test_code_probe_tests_reject_a_miscopied_number():
    """A quantized model's typical code error is a wrong number in the body (`x == 13` for `is_31`): each code
    probe's tests pass its canonical body and fail the same body with any other number of its template's range."""
    from pipelines.text import synthetic

    for item in probes.code_probes():
        n = int(item["prompt"].split("(")[0].rsplit("_", 1)[1])
        assert str(n) in item["canonical"]
        run = lambda body: exec(item["prompt"] + body + "\n" + item["tests"], {})  # noqa: E731
        run(item["canonical"])
        body = lambda number: synthetic.function_source(item["template"], number).rsplit("return", 1)[1]  # noqa: E731
        assert item["canonical"] == body(n)
        for other in synthetic.FUNCTION_RANGE[item["template"]]:
            if other != n:
                with pytest.raises(AssertionError):
                    run(body(other))
