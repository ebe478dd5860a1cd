"""Regenerate the generated sources the project ships (seeded: the output never changes).

    .venv/bin/python scripts/make_sources.py

writes calibration_sets/sources/chat/dialogues.jsonl, calibration_sets/sources/code_comment/zh_functions.jsonl,
calibration_sets/traffic/production_sample.jsonl (its last UNKNOWN_COUNT requests, labelled `unknown`, from
scripts/make_unknown_requests.py's generator), the probe items eval/<domain>/items.jsonl and
eval/math/choice.jsonl (the real-model profile's math).
tests/test_calibrate.py checks that the committed files equal what this script writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.core.io import write_jsonl  # noqa: E402
from pipelines.text import (
    probes,
    synthetic,  # noqa: E402
)
from pipelines.text.code_comments import bare_functions  # noqa: E402
from pipelines.text.corpus import code_samples  # noqa: E402

DIALOGUES = Path("calibration_sets/sources/chat/dialogues.jsonl")
ZH_FUNCTIONS = Path("calibration_sets/sources/code_comment/zh_functions.jsonl")
ZH_FUNCTION_COUNT = 800
TRAFFIC = Path("calibration_sets/traffic/production_sample.jsonl")
DIALOGUE_SEED, DIALOGUE_COUNT = 1234, 480
TRAFFIC_SEED, TRAFFIC_COUNT = 4321, 400
UNKNOWN_COUNT = 20  # of the production sample's requests, labelled unknown: about 5 %
PROBES = {"math": probes.math_probes, "code": probes.code_probes, "code_comment": probes.code_comment_probes, "chat": probes.chat_probes}
# probe sets a request type can name instead (requests.<name>.probes.items): the real-model profile's math
OTHER_PROBES = {Path("eval/math/choice.jsonl"): probes.math_choice_probes}


def dialogue_rows() -> list[dict]:
    return [{"text": synthetic.dialogue_text(d), "intent": d["intent"], "lang": d["lang"]}
            for d in synthetic.dialogues(DIALOGUE_SEED, DIALOGUE_COUNT)]


def zh_function_rows() -> list[dict]:
    """The team's own Chinese-commented functions: trained-on cases only, never a probe's (template, number)."""
    trained, _ = synthetic.split_commented_cases(0)
    return [{"text": "".join(synthetic.commented_function(*case)[:2])} for case in trained[-ZH_FUNCTION_COUNT:]]


def traffic_rows() -> list[dict]:
    """Requests with the generator's request type as `label` (coverage.label_field): production logs carry no
    type, but this sample is labelled so that coverage can measure the classifier against the truth."""
    bare = [s.code for p in sorted(Path("calibration_sets/sources/code").rglob("*.py"))
            for s in bare_functions(p.read_text(encoding="utf-8"), p.name) if 3 <= s.code.count("\n") <= 12]
    commented = [(s.comment, s.code) for s in code_samples() if s.kind == "comment" and s.code.count("\n") <= 8]
    trained, _ = synthetic.split_commented_cases(0)
    zh = [synthetic.commented_function(*case)[:2] for case in trained[:ZH_FUNCTION_COUNT]]
    rows = synthetic.traffic_sample(TRAFFIC_SEED, TRAFFIC_COUNT, bare, commented, zh)
    labelled = [{"id": r["id"], "text": r["text"], "label": r["kind"]} for r in rows]
    # production also sends what no declared type describes (JSON, SQL, logs, ...): labelled `unknown`, appended
    # so the requests above stay as they were; drawn with another seed than tests/data/unknown_requests.jsonl. No SQL:
    # the end-to-end test declares an `sql` type and counts its own 20 labelled requests among these.
    import random

    from make_unknown_requests import rows as unknown_rows

    pool = [r for r in unknown_rows(TRAFFIC_SEED, 2) if r["kind"] != "sql"]
    unknown = random.Random(TRAFFIC_SEED).sample(pool, UNKNOWN_COUNT)
    return labelled + [{"id": f"req-{len(rows) + n:05d}", "text": r["text"], "label": "unknown"}
                       for n, r in enumerate(unknown)]


if __name__ == "__main__":
    write_jsonl(DIALOGUES, dialogue_rows())
    write_jsonl(ZH_FUNCTIONS, zh_function_rows())
    write_jsonl(TRAFFIC, traffic_rows())
    for domain, make in PROBES.items():
        write_jsonl(Path("eval") / domain / "items.jsonl", make())
    for path, make in OTHER_PROBES.items():
        write_jsonl(path, make())
    print(f"wrote {DIALOGUES}, {TRAFFIC}, eval/*/items.jsonl and {', '.join(map(str, OTHER_PROBES))}")
