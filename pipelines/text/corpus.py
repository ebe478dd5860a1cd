"""The reference model's training text: additions, math, the shipped code with its comments, dialogues, functions.

`build_corpus` is a pure function of the `reference:` settings and the shipped code; its sha256 is part of the
recipe that decides whether the shipped weights fit (pipelines/reference.py), so it must not change unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipelines.core.params_sections import ReferenceParams
from pipelines.core.paths import CODE_SOURCES
from pipelines.text import arithmetic, synthetic
from pipelines.text.code_comments import CommentSample, extract


def code_samples(root: Path = CODE_SOURCES) -> list[CommentSample]:
    """Every (comment, code) sample in the shipped code snapshot, in a stable order."""
    found: list[CommentSample] = []
    for path in sorted(root.rglob("*.py")):
        found.extend(extract(path.read_text(encoding="utf-8"), path.name))
    return found


@dataclass
class Corpus:
    """The training documents and the held-out items the skill figures are measured on."""

    documents: list[str]
    held_out_additions: list[tuple[int, int]]
    code: list[CommentSample]
    chat: list[dict]
    code_files: list[str]
    commented: list[str]  # the Chinese-commented functions among the documents


def build_corpus(p: ReferenceParams, code_root: Path = CODE_SOURCES) -> Corpus:
    train_pairs, held_out = arithmetic.split_addition_pairs(p.seed, p.held_out_additions)
    code = code_samples(code_root)
    chat = synthetic.dialogues(p.seed, p.dialogues)
    files = [path.read_text(encoding="utf-8") for path in sorted(code_root.rglob("*.py"))]
    docs = [arithmetic.addition_line(a, b) for a, b in train_pairs] * p.addition_repeats
    docs += arithmetic.math_lines(p.seed + 1, p.math_lines)
    docs += [s.text for s in code] * p.code_repeats
    docs += files
    docs += [synthetic.dialogue_text(d) for d in chat]
    trained_functions, _ = synthetic.split_function_cases(p.seed)
    docs += [synthetic.function_source(t, n) for t, n in trained_functions] * p.function_repeats
    trained_commented, _ = synthetic.split_commented_cases(p.seed)
    commented = ["".join(synthetic.commented_function(*case)[:2]) for case in trained_commented[: p.commented_functions]]
    docs += commented * p.commented_repeats
    return Corpus(docs, held_out, code, chat, files, commented)
