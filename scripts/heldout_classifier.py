"""Held-out check of the request classifier: tests/data/heldout_requests.jsonl (written by hand, blind to the
rules) run through Classifier(params.yaml coverage.classify). Prints share per label and per unknown kind, and
every misrouted request. Reproduce: .venv/bin/python scripts/heldout_classifier.py"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from pipelines.core.params import load_params
from pipelines.text.classify import Classifier

DATA = Path("tests/data/heldout_requests.jsonl")


def main() -> None:
    classifier = Classifier(load_params().coverage.classify)
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    got = [classifier.classify(r["text"]) for r in rows]
    per_label: dict[str, Counter] = {}
    per_kind: dict[str, Counter] = {}
    for r, g in zip(rows, got):
        per_label.setdefault(r["label"], Counter())[g] += 1
        if r["label"] == "unknown":
            per_kind.setdefault(r["kind"], Counter())[g] += 1
    outcomes = sorted({g for g in got} | {"unknown", "chat"})
    print(f"{'label':<10}{'n':>4}  " + "  ".join(f"{o:>9}" for o in outcomes))
    for label in sorted(per_label):
        c = per_label[label]
        n = sum(c.values())
        print(f"{label:<10}{n:>4}  " + "  ".join(f"{c[o] / n:>9.3f}" for o in outcomes))
    print("\nunknown set per kind (got counts):")
    for kind in sorted(per_kind):
        c = per_kind[kind]
        print(f"  {kind:<15} {c['unknown']}/{sum(c.values())} unknown  {dict(sorted((c - Counter(unknown=c['unknown'])).items()))}")
    print("\nmisrouted:")
    for r, g in zip(rows, got):
        if g != r["label"]:
            text = r["text"].replace("\n", "\\n")[:80]
            print(f"  [{r['label']}->{g}] ({r['kind']}) {text}")


if __name__ == "__main__":
    main()
