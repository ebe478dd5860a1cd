"""The request classifier: which request type a piece of text belongs to.

One classifier serves calibration coverage (what share of production traffic is code with comments?)
and routing (which variant serves this request?), so the two can never disagree. Its rules are data:
each request type declares them in params.yaml (`requests.<name>.classify`, docs/request-types.md) as named
regular expressions and a `when` expression over their match counts and three built-in counts:

    code_lines     lines of Python (a python fence's lines; not SQL, shell, configs or other languages)
    comment_lines  Python comment lines (#, docstring quotes)
    chars          the request's length in characters

e.g. `when: "sql_keyword >= 2 and code_lines == 0"`. Expressions allow numbers, `true`/`false`, + and -,
comparisons, `and`, `or`, `not` and parentheses, nothing else: they are parsed, never `eval`ed. Of the types
whose `when` holds, the highest `priority` wins; a tie there is `ambiguous`, and no match at all is `unknown`
(both are served by fp16): a quantized variant serves only what a declared rule positively claims. Explainable,
deterministic, no model to ship, fast enough to run in front of every request; it imports no torch and no
pydantic, so the router stays light.
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

# What counts as code is Python's (the shipped code probes are Python): a line opening a Python block (`def f(x):`,
# `for x in xs:`, `else:`) or importing; a Python statement (return, raise, an assignment, a call); never a line that
# ends in `;` or `{` or holds shell syntax (`$`, `&&`, `||`), which Python does not write.
_PY_OPENER = re.compile(
    r"^\s*((async\s+)?def\s+\w+\s*\(.*\)\s*(->.*)?|class\s+\w+(\(.*\))?|(for|async\s+for)\s+.+\s+in\s+.+|while\s+.+|"
    r"if\s+.+|elif\s+.+|else|try|except(\s+.+)?|finally|(async\s+)?with\s+.+)\s*:\s*(#.*)?$"
    r"|^\s*(import\s+[\w.]+(\s+as\s+\w+)?(\s*,\s*[\w.]+(\s+as\s+\w+)?)*|from\s+[\w.]+\s+import\s+[\w*(, ]+)\s*(#.*)?$")
_PY_STATEMENT = re.compile(
    r"^\s*(return\b|yield\b|raise\b|assert\s|del\s|global\s|nonlocal\s|pass$|break$|continue$|@[\w.]+|lambda\b|"
    r"[A-Za-z_][\w.]*(\[[^\]]*\])*(\s*,\s*[A-Za-z_][\w.]*)*\s*([-+*/%&|^@]|//|\*\*|<<|>>)?=(?!=)\s*\S|"
    r"[A-Za-z_][\w.]*\(.*\)\s*(#.*)?$)")
_NOT_PYTHON = re.compile(r"[;{]\s*$|\$|&&|\|\|")
_PY_EVIDENCE = re.compile(r"\w\(|\sfor\s.+\sin\s|\b(None|True|False|self|lambda)\b")  # a statement no config writes
# Python's comments: `#` (not a shebang or a C preprocessor line) and docstring quotes
_COMMENT_LINE = re.compile(r'^\s*(#(?!!|(include|define|pragma|ifn?def|endif)\b)|"""|\'\'\')')
_TRACEBACK_FRAME = re.compile(r'^\s*File ".*", line \d+')  # the next line is quoted source, not code sent
_PY_FENCE = ("python", "py", "python3")


def _code_lines(text: str) -> tuple[int, int]:
    """(Python code lines, Python comment lines) in `text`.

    A python-tagged fence's lines are code, another language's are not, an untagged one's are read like the rest:
    a line counts when it opens a Python block or imports, or is a Python statement in a text that has such an
    opener or a statement only Python writes (a call, a comprehension, None/True/False/self): the `key = value`
    lines of a config or `return 0` in a shell function are not Python on their own.
    """
    code = comments = 0
    fence: str | None = None  # the open fence's language tag
    statements, opened, quoted = 0, False, False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            continue
        if fence and fence not in _PY_FENCE:
            continue
        after_frame, quoted = quoted, bool(_TRACEBACK_FRAME.match(line))
        if after_frame:
            continue
        if _COMMENT_LINE.match(line):
            comments += 1
        elif fence:
            code += 1
        elif _PY_OPENER.match(line):
            code, opened = code + 1, True
        elif _PY_STATEMENT.match(line) and not _NOT_PYTHON.search(line):
            statements, opened = statements + 1, opened or bool(_PY_EVIDENCE.search(line))
    return code + (statements if opened else 0), comments


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
