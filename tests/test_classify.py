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
    query = "select a from t\nfor row in rows:\n    print(row)"
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
    assert classifier.classify("# add\nx = f(1)") == "commented"
    assert classifier.classify("x" * 41) == "long"


# ---- code_lines counts Python only; a catch-all is declared, never implied ---------------------------------------

@pytest.mark.parametrize("text, code", [
    ("def add(a, b):\n    return a + b", 2),
    ("import os\nfrom pathlib import Path\nroot = Path(os.getcwd())", 3),
    ("# keep the evens\nevens = [x for x in xs if x % 2 == 0]", 1),  # a comprehension: only Python writes it
    ("x = compute()\nprint(x)", 2),
    ("```python\nx = 1\ny = 2\n```", 2),  # a python fence: every line
    ("```\ndef f():\n    return 1\n```", 2),  # an untagged fence: read line by line
    ("```sql\nSELECT 1;\nUPDATE t SET a = 1;\n```", 0),  # another language's fence: none
    ("[database]\nhost = db.internal\nport = 5432\nuser = alice", 0),  # INI / TOML: key = value is not Python alone
    ("DATABASE_URL=postgres://db/app\nWORKERS=4\nDEBUG=false", 0),
    ("#!/bin/bash\nset -euo pipefail\nfor f in *.log; do\n  gzip \"$f\"\ndone\nreturn 0", 0),
    ("UPDATE orders SET status = 'closed' WHERE id = 4;\nSELECT * FROM orders;", 0),
    ("function total(xs) {\n  let s = 0;\n  for (const x of xs) {\n    s += x;\n  }\n  return s;\n}", 0),
    ("func Sum(xs []int) int {\n\ttotal := 0\n\tfor _, x := range xs {\n\t\ttotal += x\n\t}\n\treturn total\n}", 0),
    ('Traceback (most recent call last):\n  File "/app/a.py", line 3, in f\n    value = int(row["id"])\nKeyError: 1', 0),
])
def test_code_lines_counts_python_and_nothing_else(text, code):
    """code_lines decides the `code` type (code_lines >= 2): SQL, shell, configs, other languages and a traceback's
    quoted source must not reach it, or a Python-measured variant serves them."""
    rule = rules(code={"when": f"code_lines == {code}", "priority": 1})
    assert rule.classify(text) == "code"


def test_python_comments_only():
    counts = rules(c={"when": "comment_lines >= 1", "priority": 1})
    assert counts.classify("# Return the sum\nx = f(1)") == "c"
    assert counts.classify('"""Docstring."""') == "c"
    for other in ("#!/usr/bin/env bash", "#include <stdio.h>", "// C comment", "/* block */"):
        assert counts.classify(other) == UNKNOWN, other


def test_a_catch_all_is_declared_explicitly_and_loses_to_every_positive_rule():
    """What README and docs/request-types.md tell a team that wants one: a type with `when: 'true'` and the lowest
    priority. It takes what nothing else claims, and nothing that another type claims."""
    catch_all = rules(code={"when": "code_lines >= 2", "priority": 20},
                      everything_else={"when": "true", "priority": -1})
    assert catch_all.classify("SELECT 1 FROM t;") == "everything_else"
    assert catch_all.classify("def f(x):\n    return x") == "code"
    without = rules(code={"when": "code_lines >= 2", "priority": 20})
    assert without.classify("SELECT 1 FROM t;") == UNKNOWN
