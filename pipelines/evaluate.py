"""Stage `evaluate@<variant>`: the probes through lm-eval, per item, plus fidelity against fp16.

The variant runs in its own process (pipelines/evaluation/harness.py does the work): a crash or a run
past evaluate.timeout_seconds is that variant's recorded failure and the pipeline goes on. Each item
is asked look by look against fp16's answers (the baseline stage's), and stops where the sequential
rule has decided (pipelines/judging/sequential.py).
"""

from __future__ import annotations

import logging

from pipelines.core import logs
from pipelines.core.io import atomic_write_text, read_json, read_jsonl, write_json, write_jsonl
from pipelines.core.isolation import run_isolated
from pipelines.core.params import load_params
from pipelines.core.paths import (BASELINE, BASELINE_RESULTS, EVAL_DIR, EVAL_RESULTS, FIDELITY_BASE, FIDELITY_TEXTS,
                                  REFERENCE_DIR, VARIANTS_DIR)
from pipelines.evaluation.console import EVALUATE_VARIANT, log_probes, pop_texts
from pipelines.evaluation.plans import by_id, correctness, probe_plans, row_of
from pipelines.evaluation import baseline_log, endpoints, sample_logs
from pipelines.models.loading import endpoint_of, log_only, resolve_device

log = logging.getLogger(__name__)


def main(variant: str, failed_because: str | None = None) -> int:
    params = load_params()
    params.model_under_test(variant)
    p = params.evaluate
    if variant == BASELINE:  # its answers are the baseline stage's: one copy under the common layout
        atomic_write_text(EVAL_RESULTS / BASELINE / "items.jsonl", (BASELINE_RESULTS / "items.jsonl").read_text("utf-8"))
        atomic_write_text(EVAL_RESULTS / BASELINE / FIDELITY_TEXTS, (BASELINE_RESULTS / FIDELITY_TEXTS).read_text("utf-8"))
        write_json(EVAL_RESULTS / f"{BASELINE}.json", read_json(BASELINE_RESULTS / "eval.json"))
        log.info("evaluate fp16: the baseline's records (%s) -> %s", BASELINE_RESULTS, EVAL_RESULTS / BASELINE)
        return 0
    if failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        write_jsonl(EVAL_RESULTS / variant / "items.jsonl", [])
        write_jsonl(EVAL_RESULTS / variant / FIDELITY_TEXTS, [])
        write_json(EVAL_RESULTS / f"{variant}.json", {"variant": variant, "device": resolve_device(params.device),
                                                     "batch_size": p.batch_size, "status": "failed",
                                                     "error": failed_because})
        log.warning("evaluate %s: recorded as FAILED (%s)", variant, failed_because)
        return 0
    plans = probe_plans(p.domains, p)
    base_rows = read_jsonl(BASELINE_RESULTS / "items.jsonl")
    if log_only(VARIANTS_DIR / variant) or endpoint_of(VARIANTS_DIR / variant):  # evaluated elsewhere: an lm-eval log
        args = (variant, VARIANTS_DIR / variant, plans, base_rows, read_json(BASELINE_RESULTS / "eval.json"),
                params.compare, p.allow_unisolated_code)
        with logs.progress(total=1, desc=f"evaluate {variant}", bar_format="{desc}: {elapsed}") as bar:
            result, items = (endpoints.evaluate(*args, EVAL_RESULTS / variant / sample_logs.LOG_DIR,
                                                REFERENCE_DIR, EVAL_DIR, p.timeout_seconds)
                             if endpoint_of(VARIANTS_DIR / variant) else sample_logs.evaluate(*args))
            bar.update()
        write_jsonl(EVAL_RESULTS / variant / "items.jsonl", items)
        write_jsonl(EVAL_RESULTS / variant / FIDELITY_TEXTS, [])
        write_json(EVAL_RESULTS / f"{variant}.json", result)
        log_probes(variant, result)
        return 0
    baseline = {d: correctness(by_id(base_rows, d)) for d in plans}
    # fp16's answers from its sample log (baseline.source: samples): no distributions to score fidelity against
    fidelity_base = None if (read_json(BASELINE_RESULTS / "eval.json").get("not_measured") or {}).get("fidelity") \
        else FIDELITY_BASE
    with logs.progress(total=1, desc=f"evaluate {variant}", bar_format="{desc}: {elapsed}") as bar:
        device = resolve_device(params.device)
        done, error = run_isolated(EVALUATE_VARIANT,
                                   (str(VARIANTS_DIR / variant), plans, p, device, fidelity_base, baseline,
                                    params.compare, params.gpus.shares()),
                                   p.timeout_seconds, f"evaluate {variant}", logs.current_log_file)
        bar.update()
    result, items = ({"variant": variant, "device": device, "batch_size": p.batch_size, "status": "failed",
                      "error": error}, []) if error else done
    unpaired = baseline_log.unpaired_rows(items, base_rows)
    for row, why in unpaired.items():  # asked otherwise than fp16 was (its log's prompts): that row's refusal
        result["probes"][row] = {**result["probes"][row], "status": "refused", "items": 0,
                                 "reason": f"does not pair with fp16's records: {why}"}
    items = [r for r in items if row_of(r) not in unpaired]
    write_jsonl(EVAL_RESULTS / variant / "items.jsonl", items)
    write_jsonl(EVAL_RESULTS / variant / FIDELITY_TEXTS, pop_texts(result))  # what `quantgate audit` re-measures
    write_json(EVAL_RESULTS / f"{variant}.json", result)
    log_probes(variant, result)
    return 0
