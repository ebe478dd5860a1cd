"""Stage `memory-report`: every variant's memory on one chart each, and its growth against fp16.

The summary is what compare and record read; the charts are for people, so a machine without matplotlib
(the air-gapped GPU check, scripts/gpu_check.py) still gets the summary.
"""

from __future__ import annotations

import importlib.util
import logging

from pipelines.core.io import read_json, write_json
from pipelines.core.params import load_params
from pipelines.core.paths import MEMORY_RESULTS, MEMORY_SUMMARY, PLOTS_DIR
from pipelines.measure import verdict

log = logging.getLogger(__name__)


def main() -> int:
    params = load_params()
    results = {}
    for name in [*params.variants, *params.candidates]:
        path = MEMORY_RESULTS / f"{name}.json"
        results[name] = read_json(path) if path.is_file() else {"status": "failed", "error": f"{path} missing"}
    summary = verdict.summarize(results, params.memory)
    write_json(MEMORY_SUMMARY, summary)
    if importlib.util.find_spec("matplotlib") is None:
        log.warning("memory-report: charts not drawn: matplotlib is not installed here")
    else:
        from pipelines.measure import plots

        plots.plot_all(results, PLOTS_DIR)
    for name, row in summary["variants"].items():
        if row["status"] == "ok":
            excess = row["growth_excess_pct"]
            log.info("memory-report %-10s footprint %10s B  growth excess vs fp16 %s  leak %s%s", name,
                     f"{row['footprint_bytes']:,}", "n/a" if excess is None else f"{excess:+.3f} %", row["leak"],
                     f"  OUT OF MEMORY: {row['oom']}" if row["oom"] else "")
        else:
            log.info("memory-report %-10s %s: %s", name, row["status"].upper().replace("_", " "),
                     row.get("error") or row.get("reason"))
    return 0
