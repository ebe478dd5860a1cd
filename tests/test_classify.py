"""The request classifier's declared rules: the expression language, priorities, unknown and ambiguous."""

from __future__ import annotations

import pytest

from pipelines.text.classify import AMBIGUOUS, UNKNOWN, Classifier, compile_when


@pytest.mark.parametrize("when, counts, expected", [
    ("a >= 2", {"a": 2}, True),
    ("a >= 2", {"a": 1}, False),
    ("a + b >= 2 and not c", {"a": 1, "b": 1, "c": 0}, True),
    ("a + b >= 2 and not c", {"a": 1, "b": 1, "c": 1}, False),
    ("1 <= a < 3", {"a": 3}, False),  # a chained comparison holds only when every link does
    ("1 <= a < 3", {"a": 2}, True),
    ("a - b == -1 or false", {"a": 1, "b": 2}, True),
    ("true", {}, True),
])
def test_when_expressions_evaluate_like_their_reading(when, counts, expected):
    assert bool(compile_when(when, set(counts))(counts)) is expected


@pytest.mark.parametrize("when, error", [
    ("a.__class__", "Attribute is not allowed"),
    ("[a][0]", "Subscript is not allowed"),
    ("(lambda: 1)()", "Call is not allowed"),
    ("a * 2", "BinOp is not allowed"),
    ("a in b", "only <, <=, >, >=, == and != compare"),
    ("'text' == a", "Constant is not allowed"),
    ("b > 1", "unknown name 'b'"),
    ("a >=", "not an expression"),
    ("+".join(["a"] * 5000), "9999 characters, more than 500"),  # a RecursionError in the parser, before the limit
    ("+".join(["a"] * 251), "501 characters, more than 500"),
])
def test_anything_else_is_refused_naming_it(when, error):
    with pytest.raises(ValueError, match=error):
        compile_when(when, {"a"})


def test_the_longest_allowed_expression_compiles_and_evaluates():
    longest = "+".join(["a"] * 249) + ">0"  # 248 levels of nested + on the left
    assert len(longest) <= 500 and compile_when(longest, {"a"})({"a": 1}) is True
    not_chain = "not " * 124 + "a"  # the deepest nesting that fits
    assert compile_when(not_chain, {"a"})({"a": 1}) is True


def rules(**specs):
    return Classifier(specs)


def test_the_highest_priority_wins_and_a_tie_is_ambiguous():
    classifier = rules(sql={"patterns": {"kw": r"(?i)\bselect\b"}, "when": "kw >= 1", "priority": 25},
                       code={"when": "code_lines >= 2", "priority": 20},
                       chat={"when": "true", "priority": 0})
    query = "SELECT a\nFROM t WHERE x = 1;\nx = 2"
    assert classifier.matches(query) == ["sql", "code", "chat"]
    assert classifier.classify(query) == "sql"
    assert classifier.classify("def f(x):\n    return x") == "code"
    assert classifier.classify("hello") == "chat"
    tied = rules(sql={"patterns": {"kw": r"(?i)\bselect\b"}, "when": "kw >= 1", "priority": 20},
                 code={"when": "code_lines >= 2", "priority": 20})
    assert tied.classify(query) == AMBIGUOUS
    assert tied.classify("hello") == UNKNOWN  # no catch-all declared: nothing matches


def test_builtin_counts_and_pii_masking():
    classifier = rules(math={"patterns": {"digits": r"\d+\s*[-+]\s*\d+"}, "when": "digits >= 1", "priority": 1},
                       long={"when": "chars > 40", "priority": 0},
                       commented={"when": "comment_lines >= 1 and code_lines >= 1", "priority": 2})
    assert classifier.classify("12 + 30") == "math"
    # a phone number is masked before the rules see it: not arithmetic
    assert classifier.classify("call me at 555-123-4567") == UNKNOWN
    assert classifier.classify("# add\nx = 1") == "commented"
    assert classifier.classify("x" * 41) == "long"
