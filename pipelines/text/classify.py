"""The request classifier: which request type a piece of text belongs to.

One classifier serves calibration coverage (what share of production traffic is code with comments?)
and routing (which variant serves this request?), so the two can never disagree. Its rules are data:
each request type declares them in params.yaml (`requests.<name>.classify`, docs/request-types.md) as named
regular expressions and a `when` expression over their match counts and three built-in counts:

    code_lines     lines that look like code (fenced blocks count as code)
    comment_lines  comment lines (#, //, /*, docstring quotes)
    chars          the request's length in characters

e.g. `when: "sql_keyword >= 2 and code_lines == 0"`. Expressions allow numbers, `true`/`false`, + and -,
comparisons, `and`, `or`, `not` and parentheses, nothing else: they are parsed, never `eval`ed. Of the types
whose `when` holds, the highest `priority` wins; a tie there is `ambiguous`, and no match at all is `unknown`
(both are served by fp16). Explainable, deterministic, no model to ship, fast enough to run in front of every
request; it imports no torch and no pydantic, so the router stays light.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping

from pipelines.text.pii import mask

UNKNOWN = "unknown"  # no request type's rule holds
AMBIGUOUS = "ambiguous"  # two or more hold at the same, highest priority
UNDECIDED = (UNKNOWN, AMBIGUOUS)
BUILTIN_COUNTS = ("code_lines", "comment_lines", "chars")

_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |return\b|for .+ in .+:|while .+:|if .+:|elif .+:|else:|try:|"
    r"except\b|with .+:|raise\b|yield\b|lambda\b|print\(|[A-Za-z_][\w.\[\], ]*\s*[+\-*/]?=\s*\S|"
    r"(public|private|static|const|let|var|function|fn|func|#include)\b|.*[;{}]\s*$)"
)
_COMMENT_LINE = re.compile(r'^\s*(#(?!!)|//|/\*|\*|"""|\'\'\')')


def _code_lines(text: str) -> tuple[int, int]:
    """(code-like lines, comment lines) in `text`, counting fenced blocks as code."""
    code = comments = 0
    fenced = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if _COMMENT_LINE.match(line):
            comments += 1
        elif fenced or _CODE_LINE.match(line):
            code += 1
    return code, comments


_COMPARE = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
            ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
_CONSTANTS = {"true": True, "false": False}
# Long enough for any rule a person writes (the shipped ones are under 100); short enough that the parser, and the
# nested functions built from it, stay far from Python's recursion limit.
MAX_WHEN_CHARS = 500


def compile_when(text: str, names: set[str]) -> Callable[[Mapping[str, int]], object]:
    """A `when` expression as a function of the counts; ValueError naming what is not allowed."""
    if len(text.strip()) > MAX_WHEN_CHARS:
        raise ValueError(f"when {text[:60]!r}...: {len(text.strip())} characters, more than {MAX_WHEN_CHARS}; "
                         "split it with named patterns")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"when {text!r}: not an expression ({err.msg})") from None

    def build(node: ast.AST) -> Callable[[Mapping[str, int]], object]:
        if isinstance(node, ast.BoolOp):
            parts = [build(v) for v in node.values]
            if isinstance(node.op, ast.And):
                return lambda env: all(p(env) for p in parts)
            return lambda env: any(p(env) for p in parts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            inner = build(node.operand)
            return (lambda env: not inner(env)) if isinstance(node.op, ast.Not) else (lambda env: -inner(env))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left, right = build(node.left), build(node.right)
            if isinstance(node.op, ast.Add):
                return lambda env: left(env) + right(env)
            return lambda env: left(env) - right(env)
        if isinstance(node, ast.Compare):
            first = build(node.left)
            rest = [(_COMPARE[type(op)], build(c)) for op, c in zip(node.ops, node.comparators)
                    if type(op) in _COMPARE]
            if len(rest) != len(node.ops):
                raise ValueError(f"when {text!r}: only <, <=, >, >=, == and != compare")

            def compare(env):
                value = first(env)
                for fn, other in rest:
                    nxt = other(env)
                    if not fn(value, nxt):
                        return False
                    value = nxt
                return True
            return compare
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                constant = _CONSTANTS[node.id]
                return lambda env: constant
            if node.id not in names:
                raise ValueError(f"when {text!r}: unknown name {node.id!r}; use a pattern name "
                                 f"({', '.join(sorted(names - set(BUILTIN_COUNTS))) or 'none declared'}), "
                                 f"{', '.join(BUILTIN_COUNTS)}, true or false")
            key = node.id
            return lambda env: env[key]
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            constant = node.value
            return lambda env: constant
        raise ValueError(f"when {text!r}: {type(node).__name__} is not allowed (numbers, names, + -, comparisons, "
                         "and/or/not, parentheses)")

    return build(tree)


class Rule:
    """One request type's compiled rule."""

    def __init__(self, name: str, patterns: dict[str, re.Pattern], when, priority: int):
        self.name, self.patterns, self.when, self.priority = name, patterns, when, priority

    @classmethod
    def compile(cls, name: str, spec: Mapping) -> Rule:
        """From `{patterns, when, priority}`; ValueError names the bad pattern or expression."""
        patterns = {}
        for key, regex in (spec.get("patterns") or {}).items():
            if key in BUILTIN_COUNTS or key in _CONSTANTS or not key.isidentifier():
                raise ValueError(f"pattern name {key!r}: an identifier other than {', '.join(BUILTIN_COUNTS)}, "
                                 "true and false")
            try:
                patterns[key] = re.compile(regex)
            except re.error as err:
                raise ValueError(f"pattern {key!r}: not a regular expression ({err})") from None
        when = compile_when(str(spec.get("when", "false")), set(patterns) | set(BUILTIN_COUNTS))
        return cls(name, patterns, when, int(spec.get("priority", 0)))

    def holds(self, text: str, builtins: dict[str, int]) -> bool:
        counts = dict(builtins)
        for key, pattern in self.patterns.items():
            counts[key] = sum(1 for _ in pattern.finditer(text))
        return bool(self.when(counts))


class Classifier:
    """Every declared request type's rule; `classify` names the type of one request."""

    def __init__(self, specs: Mapping[str, Mapping]):
        self.rules = [Rule.compile(name, spec.model_dump() if hasattr(spec, "model_dump") else spec)
                      for name, spec in specs.items()]
        self.types = [rule.name for rule in self.rules]

    def matches(self, text: str) -> list[str]:
        """The types whose rule holds, highest priority first (ties in declaration order)."""
        text = mask(text)  # an SSN or a phone number is not arithmetic
        code, comments = _code_lines(text)
        builtins = {"code_lines": code, "comment_lines": comments, "chars": len(text)}
        held = [rule for rule in self.rules if rule.holds(text, builtins)]
        return [rule.name for rule in sorted(held, key=lambda r: -r.priority)]

    def classify(self, text: str) -> str:
        """The request type of `text`, or UNKNOWN (no rule holds) or AMBIGUOUS (a tie at the top priority)."""
        held = self.matches(text)
        if not held:
            return UNKNOWN
        priority = {rule.name: rule.priority for rule in self.rules}
        if len(held) > 1 and priority[held[0]] == priority[held[1]]:
            return AMBIGUOUS
        return held[0]
