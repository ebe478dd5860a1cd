"""Extract (comment, code) pairs from Python source with Python's own tokenizer and parser.

A calibration set without code comments is what broke the GPTQ checkpoint in the incident behind
this project, so comments are taken as real tokens (`tokenize`), never by regex on '#', and each is
kept together with the code it describes. Trivial comments carry no language and are dropped.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass

# Comments that say nothing about the code beside them.
TRIVIAL_COMMENT = re.compile(
    r"^#\s*(!|-\*-|.*coding[:=]|noqa|type:\s*ignore|pragma|pylint:|fmt:|isort:|mypy:|"
    r"copyright|license|spdx-license|all rights reserved|-+$|=+$|#+$|$)",
    re.IGNORECASE,
)
MAX_CODE_LINES = 6


@dataclass(frozen=True)
class CommentSample:
    """A comment or docstring and the code it describes, with where it came from."""

    kind: str  # "comment", "docstring", or "code" (no comment at all)
    comment: str
    code: str
    source: str  # file name
    line: int  # 1-based line of the comment

    @property
    def text(self) -> str:
        """The rendering used for calibration and training: comment, then the code."""
        if self.kind in ("docstring", "code"):
            return self.code
        return f"{self.comment}\n{self.code}"


def _is_trivial(comment: str) -> bool:
    return bool(TRIVIAL_COMMENT.match(comment.strip()))


def _code_after(lines: list[str], start: int) -> str:
    """The block that follows line index `start`: up to the first blank line or dedent."""
    block: list[str] = []
    indent = None
    for raw in lines[start:]:
        if not raw.strip():
            break
        if raw.lstrip().startswith("#"):
            if block:
                break
            continue
        this_indent = len(raw) - len(raw.lstrip())
        if indent is None:
            indent = this_indent
        elif this_indent < indent:
            break
        block.append(raw.rstrip())
        if len(block) >= MAX_CODE_LINES:
            break
    if not block:
        return ""
    base = min(len(b) - len(b.lstrip()) for b in block)
    return "\n".join(b[base:] for b in block)


def _comment_samples(source: str, name: str) -> list[CommentSample]:
    lines = source.splitlines()
    samples: list[CommentSample] = []
    run: list[tokenize.TokenInfo] = []  # consecutive full-line comments

    def flush() -> None:
        if not run:
            return
        text = "\n".join(t.string.strip() for t in run)
        kept = [t for t in run if not _is_trivial(t.string)]
        first = run[0]
        last_row = run[-1].start[0]
        run.clear()
        if not kept or len(text) < 12:
            return
        code = _code_after(lines, last_row)
        if code:
            samples.append(CommentSample("comment", "\n".join(t.string.strip() for t in kept), code, name, first.start[0]))

    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#"):
            if run and tok.start[0] != run[-1].start[0] + 1:
                flush()
            run.append(tok)
        elif tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        else:
            flush()
    flush()
    return samples


def _docstring_samples(source: str, name: str) -> list[CommentSample]:
    lines = source.splitlines()
    samples = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or _is_trivial("# " + doc.splitlines()[0]):
            continue
        body_end = min(node.end_lineno or node.lineno, node.lineno + 15)
        chunk = lines[node.lineno - 1 : body_end]
        base = len(chunk[0]) - len(chunk[0].lstrip())
        code = "\n".join(c[base:].rstrip() for c in chunk)
        samples.append(CommentSample("docstring", doc.strip(), code, name, node.lineno))
    return samples


def extract(source: str, name: str) -> list[CommentSample]:
    """Every non-trivial comment and docstring in `source`, each with the code it describes.

    Raises SyntaxError (with `name` and line) when the file is not valid Python.
    """
    _parse(source, name)
    found = _comment_samples(source, name) + _docstring_samples(source, name)
    return sorted(found, key=lambda s: (s.line, s.kind))


def _parse(source: str, name: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as err:
        raise SyntaxError(f"{name}:{err.lineno}: not valid Python ({err.msg})") from None


def _strip_docstrings(node: ast.AST) -> None:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            child.body = body[1:] or [ast.Pass()]


def bare_functions(source: str, name: str) -> list[CommentSample]:
    """Every top-level function and method as code alone: comments and docstrings removed (the `code` domain)."""
    found = []
    for node in ast.walk(_parse(source, name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _strip_docstrings(node)
            found.append(CommentSample("code", "", ast.unparse(node), name, node.lineno))
    return sorted(found, key=lambda s: s.line)
