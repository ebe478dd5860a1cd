"""Stage `baseline`: fp16 answers every look of every probe pool, and its next-token distributions are stored once.

Every variant's evaluate stage pairs its answers with these and scores its fidelity against these
distributions. It runs in its own process; a crash or a run past evaluate.timeout_seconds stops the
pipeline with the cause, since without a baseline no variant can be judged. With `baseline.source: samples` fp16's
answers come from its lm-eval sample log instead (pipelines/evaluation/baseline_log.py), and no distributions are stored.
"""

from __future__ import annotations

import logging
import os
import shutil

from pipelines.core import logs
from pipelines.core.errors import QuantgateError
from pipelines.core.io import write_json, write_jsonl
from pipelines.core.isolation import run_isolated
from pipelines.core.params import load_params
from pipelines.core.paths import BASELINE, BASELINE_RESULTS, FIDELITY_BASE, FIDELITY_TEXTS, VARIANTS_DIR
from pipelines.evaluation import baseline_log, sample_logs
from pipelines.evaluation.console import EVALUATE_VARIANT, log_probes, pop_texts
from pipelines.evaluation.plans import probe_plans
from pipelines.models.loading import resolve_device

log = logging.getLogger(__name__)


def main() -> int:
    params = load_params()
    p = params.evaluate
    plans = probe_plans(p.domains, p)
    if params.baseline.source == baseline_log.SOURCE:
        return _from_log(params.baseline.path, plans, p.allow_unisolated_code)
    shutil.rmtree(BASELINE_RESULTS / sample_logs.LOG_DIR, ignore_errors=True)  # a former baseline log's copy
    staged = FIDELITY_BASE.with_name(f".{FIDELITY_BASE.name}.new")  # in place only together with the records
    with logs.progress(total=1, desc="baseline fp16 (every look)", bar_format="{desc}: {elapsed}") as bar:
        done, error = run_isolated(EVALUATE_VARIANT,
                                   (str(VARIANTS_DIR / BASELINE), plans, p, resolve_device(params.device), staged, None,
                                    None, params.gpus.shares()),
                                   p.timeout_seconds, f"evaluate {BASELINE}", logs.current_log_file)
        bar.update()
    result, items = done or ({"error": error}, [])
    if error or result["status"] != "ok":  # no baseline, no A/B: stop here rather than judge against nothing
        for leftover in (staged, staged.with_name(f".{staged.name}.tmp")):  # also what a killed process left
            leftover.unlink(missing_ok=True)
        raise QuantgateError(f"the fp16 baseline could not be evaluated: {result['error']}")
    os.replace(staged, FIDELITY_BASE)
    return _write(result, items, pop_texts(result), "")  # the texts: what `quantgate audit` re-measures


def _from_log(folder: str, plans: dict[str, dict], allow_unisolated_code: bool) -> int:
    """fp16's records from its lm-eval sample log (baseline.source: samples), the log copied beside them."""
    result, items = baseline_log.evaluate(folder, plans, BASELINE_RESULTS / sample_logs.LOG_DIR, allow_unisolated_code)
    if result["status"] != "ok":
        raise QuantgateError(f"the fp16 baseline could not be read from its sample log: {result['error']}")
    FIDELITY_BASE.unlink(missing_ok=True)  # no distributions: KL against fp16 is not measured (baseline_log.py)
    return _write(result, items, [], f"fp16's sample log {folder}: ")


def _write(result: dict, items: list[dict], texts: list[dict], source: str) -> int:
    """The stage's records, however fp16 answered: what every variant is paired with."""
    write_jsonl(BASELINE_RESULTS / "items.jsonl", items)
    write_jsonl(BASELINE_RESULTS / FIDELITY_TEXTS, texts)
    write_json(BASELINE_RESULTS / "eval.json", result)
    log_probes(BASELINE, result)
    log.info("baseline: %s%s -> %s", source, ", ".join(f"{d} {r['items']}" for d, r in result["probes"].items()),
             BASELINE_RESULTS)
    return 0
