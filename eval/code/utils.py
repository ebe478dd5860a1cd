"""lm-eval hook for the code probes: each completion runs in quantgate's sandbox, never in this process.

pass@1 is 1 only when the program ran to its end (run_python's token, written after the last assert): a
completion that exits, is killed or raises before the tests finish scores 0. A request type declared
`runs_code: true` scores the same way when its task's `process_results` is this hook (or calls run_python).

QUANTGATE_ALLOW_UNISOLATED_CODE=1 (set by the evaluate stage from params `evaluate.allow_unisolated_code`)
lets code run where namespaces are unavailable; otherwise such runs are refused and score 0.
"""

import os

from pipelines.core.sandbox import run_python


def process_results(doc, results):
    program = doc["prompt"] + results[0] + "\n" + doc["tests"]
    outcome = run_python(program, allow_unisolated=os.environ.get("QUANTGATE_ALLOW_UNISOLATED_CODE") == "1")
    return {"pass@1": 1.0 if outcome.passed else 0.0}
