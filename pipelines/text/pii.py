"""Mask personal data in production text before anything derived from it is written or logged.

Production requests carry e-mail addresses, phone numbers and ID numbers. The coverage report
shows example requests; they pass through `mask()` first. Order numbers and arithmetic are left
alone: only patterns with the shape of personal identifiers are replaced.
"""

from __future__ import annotations

import re

# Order matters: the longest, most specific identifiers first, so a phone pattern never eats an ID.
PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("EMAIL", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")),
    ("ID", re.compile(r"(?<!\d)\d{17}[\dXx](?!\d)")),  # PRC resident ID
    ("ID", re.compile(r"(?<!\d)\d{3}-\d{2}-\d{4}(?!\d)")),  # US SSN
    ("CARD", re.compile(r"(?<!\d)(?:\d{4}[ -]){3}\d{1,7}(?!\d)|(?<!\d)\d{13,16}(?!\d)")),
    ("PHONE", re.compile(r"(?<![\w+])\+\d{1,3}[ -]?(?:\(\d{1,4}\)[ -]?)?\d{2,4}(?:[ -]\d{2,4}){1,3}(?!\d)")),
    ("PHONE", re.compile(r"(?<!\d)1[3-9]\d{9}(?!\d)")),  # PRC mobile
    ("PHONE", re.compile(r"(?<!\d)\(\d{3}\)\s?\d{3}-\d{4}(?!\d)|(?<![\d-])\d{3}-\d{3}-\d{4}(?!\d)")),  # NANP
]


def mask(text: str) -> str:
    """`text` with e-mail addresses, phone numbers, ID and card numbers replaced by [EMAIL] etc."""
    for label, pattern in PATTERNS:
        text = pattern.sub(f"[{label}]", text)
    return text
