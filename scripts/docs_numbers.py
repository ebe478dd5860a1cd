#!/usr/bin/env python3
"""Write the numbers README.md and docs/*.md quote from the files they come from, and check that they still match.

    python scripts/docs_numbers.py           # rewrite every stale number block (each file atomically)
    python scripts/docs_numbers.py --check   # exit 1, listing file:line of every stale block and of every
                                             # path the docs name that the project does not ship
    python scripts/docs_numbers.py --list    # the block kinds, and which files each one reads

A number block in a Markdown file is

    <!-- numbers:KIND [ARG] -->
    (Markdown this script writes: a table or a few short sentences)

    _From `results/compare.json` (2026-12-01), made by `dvc repro`; regenerate with `python scripts/docs_numbers.py`._
    <!-- /numbers -->

Everything between the two markers is written here, from results/ (what `dvc repro` writes), params.yaml,
reference_model/recipe.json, results files as an older commit holds them (`git show`), and docs/measured/*.json
(what the benchmarks write when they run: date, machine, command). Never edit inside a block: edit the source and
run this script. One exception: a `params SECTION` block holds a hand-written `key | default | meaning` table whose
key and meaning columns are yours; only its default column is written, from params.yaml's SECTION. The last line of a block names its sources and their dates. A source's date is the date of its
last commit when the file is committed unchanged, else the day the file was last written; once a block is written,
its dates stay until the numbers it shows change. The date of a benchmark's numbers is the one its JSON file
records.

A block whose source is not in this checkout (a commit a shallow clone lacks, per-item records only `dvc repro`
makes) is left as it is and listed as not checked; it does not fail --check.

The renderers, the block machinery and the shipped-paths check live in scripts/docsgen/ (one module per group
of blocks); this file is the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from docsgen.blocks import RENDERERS, Problem, doc_files, process, write_atomic
from docsgen.shipped import unshipped_paths
from docsgen.sources import GENERATOR

ROOT = Path(__file__).resolve().parents[1]


def run(root: Path, check: bool) -> tuple[list[Problem], list[Problem], list[str]]:
    """(problems, blocks not checked, files rewritten)."""
    problems, unchecked, written = [], [], []
    for doc in doc_files(root):
        text = doc.read_text(encoding="utf-8")
        new, stale, skipped = process(root, doc)
        problems += stale
        unchecked += skipped
        if not check and new != text:
            write_atomic(doc, new)
            written.append(str(doc.relative_to(root)))
    if check:
        problems += unshipped_paths(root)
    return problems, unchecked, written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale or a "
                                                             "doc names a path the project does not ship")
    parser.add_argument("--list", action="store_true", help="the block kinds and what each reads")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        for kind, (_, what) in RENDERERS.items():
            print(f"{kind:20} {what}")
        return 0
    root = args.root.resolve()
    problems, unchecked, written = run(root, args.check)
    for p in unchecked:
        print(f"note: {p}")
    if args.check:
        for p in problems:
            print(p)
        if problems:
            print(f"{len(problems)} problem(s); stale blocks are rewritten by: {GENERATOR}")
            return 1
        print("docs: every number block matches its sources; every path they name is shipped")
        return 0
    for p in problems:  # blocks that could not be rendered stay as they were
        if "is stale" not in p.message:
            print(p)
    print("rewrote " + (", ".join(written) if written else "nothing (every block was current)"))
    return 1 if any("is stale" not in p.message for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
