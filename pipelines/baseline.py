"""Stage `baseline`: fp16 answers every look of every probe pool, and its next-token distributions are stored once.

Every variant's evaluate stage pairs its answers with these and scores its fidelity against these
distributions. It runs in its own process; a crash or a run past evaluate.timeout_seconds stops the
pipeline with the cause, since without a baseline no variant can be judged. With `baseline.source: samples` fp16's
answers come from its lm-eval sample log instead, with `endpoint` from lm-eval run against the server it is served at
(pipelines/evaluation/baseline_log.py), and no distributions are stored.
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
from pipelines.core.paths import (BASELINE, BASELINE_RESULTS, EVAL_DIR, FIDELITY_BASE, FIDELITY_TEXTS, REFERENCE_DIR,
                                  VARIANTS_DIR)
from pipelines.evaluation import baseline_log, sample_logs
from pipelines.evaluation.console import EVALUATE_VARIANT, log_probes, pop_texts
from pipelines.evaluation.plans import probe_plans
from pipelines.models.loading import resolve_device

log = logging.getLogger(__name__)


def main() -> int:
    params = load_params()
    p = params.evaluate
    plans = probe_plans(p.domains, p)
    if params.baseline.source != "here":
        return _from_log(params.baseline, plans, p)
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


def _from_log(baseline, plans: dict[str, dict], p) -> int:
    """fp16's records from its lm-eval sample log (baseline.source: samples), or from the one lm-eval writes against
    fp16's endpoint (source: endpoint), the log copied beside them."""
    copy_to = BASELINE_RESULTS / sample_logs.LOG_DIR
    if baseline.source == "endpoint":
        result, items = baseline_log.from_endpoint(baseline.endpoint.model_dump(), baseline.path, plans, copy_to,
                                                   REFERENCE_DIR, EVAL_DIR, p.timeout_seconds, p.allow_unisolated_code)
        where = f"fp16's endpoint {baseline.endpoint.base_url} ({baseline.endpoint.model})"
    else:
        result, items = baseline_log.evaluate(baseline.path, plans, copy_to, p.allow_unisolated_code)
        where = f"fp16's sample log {baseline.path}"
    if result["status"] != "ok":
        raise QuantgateError(f"the fp16 baseline could not be read from {where}: {result['error']}")
    FIDELITY_BASE.unlink(missing_ok=True)  # no distributions: KL against fp16 is not measured (baseline_log.py)
    return _write(result, items, [], f"{where}: ")


def _write(result: dict, items: list[dict], texts: list[dict], source: str) -> int:
    """The stage's records, however fp16 answered: what every variant is paired with."""
    write_jsonl(BASELINE_RESULTS / "items.jsonl", items)
    write_jsonl(BASELINE_RESULTS / FIDELITY_TEXTS, texts)
    write_json(BASELINE_RESULTS / "eval.json", result)
    log_probes(BASELINE, result)
    log.info("baseline: %s%s -> %s", source, ", ".join(f"{d} {r['items']}" for d, r in result["probes"].items()),
             BASELINE_RESULTS)
    return 0
