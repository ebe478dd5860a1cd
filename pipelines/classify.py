"""The request classifier: which domain (request type) a piece of text belongs to.

One classifier serves calibration coverage (what share of production traffic is code with
comments?) and routing (which variant serves this request?), so the two can never disagree.
It is rule-based on purpose: explainable, deterministic, no model to ship, and fast enough to run
in front of every request.
"""

from __future__ import annotations

import re

from pipelines.pii import mask

DOMAINS = ("chat", "code", "code_comment", "math")

_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |return\b|for .+ in .+:|while .+:|if .+:|elif .+:|else:|try:|"
    r"except\b|with .+:|raise\b|yield\b|lambda\b|print\(|[A-Za-z_][\w.\[\], ]*\s*[+\-*/]?=\s*\S|"
    r"(public|private|static|const|let|var|function|fn|func|#include)\b|.*[;{}]\s*$)"
)
_COMMENT_LINE = re.compile(r'^\s*(#(?!!)|//|/\*|\*|"""|\'\'\')')
_COMMENT_ASK = re.compile(
    r"\b(comment|comments|commented|docstring|docstrings|document (this|the) (code|function)|annotate)\b|注释|文档字符串",
    re.IGNORECASE,
)
_MATH_SYMBOL = re.compile(r"[√×÷±≤≥≠π∑∫²³]|\\(frac|sqrt|times|div|cdot|sum|int|pi|le|ge)\b|\^\d")
_ARITHMETIC = re.compile(r"\d\s*[-+*/×÷^=]\s*[\d(√\\]|\(\s*\d")
_MATH_ASK = re.compile(r"\b(solve|compute|calculate|simplify|evaluate|equation|fraction|square root)\b|计算|求解|等于多少",
                       re.IGNORECASE)


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


def classify(text: str) -> str:
    """The domain of one request: code_comment > code > math > chat, first match wins."""
    text = mask(text)  # an SSN or a phone number is not arithmetic
    code, comments = _code_lines(text)
    asks_for_comments = bool(_COMMENT_ASK.search(text))
    if comments and (code or asks_for_comments):
        return "code_comment"
    if code >= 2 or (code and asks_for_comments):
        return "code_comment" if asks_for_comments else "code"
    symbols = len(_MATH_SYMBOL.findall(text)) + len(_ARITHMETIC.findall(text))
    if symbols >= 2 or (symbols >= 1 and (_MATH_ASK.search(text) or len(text) < 40)):
        return "math"
    return "chat"
