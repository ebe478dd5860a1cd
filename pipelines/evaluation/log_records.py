"""A sample log's records as this checkout's evidence: the task and filter a row reads, each record as evaluate's
per-item record, checked against the task here (the hashes lm-eval wrote beside it, the version, the settings that
make the answers), and each kept answer scored again by the task's own scorer. Shared by a candidate's log
(sample_logs.py, paired with fp16's records) and fp16's own (baseline_log.py, checked against the tasks alone).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from pipelines.core.errors import QuantgateError
from pipelines.evaluation import standard_tasks

if TYPE_CHECKING:
    from pipelines.evaluation.sample_logs import SampleLog

REMEDY = "write it again with `lm_eval ... --log_samples --output_path DIR` (one run per folder)"


def doc_hash(doc) -> str:
    """The hash lm-eval logs as a record's doc_hash (lm_eval/evaluator.py writes it so)."""
    from lm_eval.utils import handle_non_serializable, hash_string

    return hash_string(json.dumps(doc, indent=2, default=handle_non_serializable, ensure_ascii=False))


def _response(value) -> str:
    """A filtered response as the in-process evaluation writes it: lm-eval's log keeps a multiple-choice answer
    (log-likelihood, is-greedy) as a list of strings, an evaluation in memory as a tuple."""
    if isinstance(value, list):
        return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def row_task(row: str, plan: dict) -> tuple[str, str | None, str]:
    """(lm-eval task, filter or None for "the one there is", metric) of a plan row."""
    if "spec" in plan:
        from pipelines.evaluation.harness import task_configs

        cfg = task_configs({row: plan})[row]
        filt, metric = standard_tasks.scoring(cfg)
        return cfg["task"], filt, metric
    return plan["probe"]["task"], None, plan["probe"]["metric"]


def to_record(row: str, plan: dict, task: str, metric: str, sample: dict, where: str, results: dict) -> dict:
    """One log record as evaluate's per-item record (pipelines/evaluation/harness.py writes the same fields)."""
    from pipelines.evaluation.harness import item_chance

    from lm_eval.utils import hash_string

    if sample["doc_hash"] != doc_hash(sample["doc"]) or \
            str(sample.get("target_hash", hash_string(str(sample["target"])))) != hash_string(str(sample["target"])):
        raise QuantgateError(f"{where}: the record's doc or target is not what its doc_hash/target_hash were made from: "
                             f"an edited log ({REMEDY})")
    value = sample.get(metric)
    if value is None:
        raise QuantgateError(f"{where}: no metric {metric!r} in the record (the task's metric here)")
    if value not in (0, 1):
        raise QuantgateError(f"{where}: metric {metric!r} is {value!r}, not 0/1 per item: only pass/fail metrics pair")
    if "spec" in plan:
        item, family, domain = standard_tasks.item_id(plan["task"], sample["doc_id"]), None, plan["domain"]
    else:
        doc = sample["doc"] if isinstance(sample["doc"], dict) else {}
        item, family, domain = str(doc.get("id")), doc.get("family"), row
    record = {"domain": domain, "task": task, "item_id": item, "family": family, "doc_id": sample["doc_id"],
              "doc_hash": sample["doc_hash"], "prompt_hash": sample["prompt_hash"], "target": str(sample["target"]),
              "response": _response((sample["filtered_resps"] or [None])[0]), "correct": bool(value),
              # a log keeps `arguments` as text: a multiple-choice item's choices are its responses, one per choice
              "chance": item_chance({"configs": results.get("configs") or {}}, task,
                                    {"arguments": sample["filtered_resps"]})}
    if "spec" in plan:
        record["filter"] = sample["filter"]
    return record


def task_samples(log: SampleLog, plan: dict, task: str, wanted_filter: str | None, here, version_here, whose: str):
    """(samples file, the filter that scores, the log's filters, the log's task version) of a row's task; raises
    QuantgateError naming the file when the log lacks the task, has another version, answered or scored with other
    settings than the task `here` (`SETTINGS`), or has no single scoring filter."""
    path = log.files.get(task)
    if path is None:
        raise QuantgateError(f"{log.folder}: no samples_{task}_<date>.jsonl (the log has {', '.join(sorted(log.files))}): "
                             f"run lm_eval with --tasks {task} (`--include_path eval` for the probes)")
    version = (log.results.get("versions") or {}).get(task)
    if str(version) != str(version_here):
        raise QuantgateError(f"{log.results_file}: versions.{task} is {version!r}, {whose} {version_here!r}: another "
                             "task definition does not pair")
    logged, mine = dict((log.results.get("configs") or {}).get(task) or {}), here.dump_config()
    marker = logged.get("metadata") if isinstance(logged.get("metadata"), dict) else {}
    marker = marker.get("quantgate") if isinstance(marker.get("quantgate"), dict) else {}
    if "spec" in plan and plan["task"] in standard_tasks.SANDBOXED and marker.get("sandbox") is not True:
        # a log scored by quantgate's own scorer (endpoints.run_servable's) goes on: SETTINGS must match, and every
        # answer is scored again here in the sandbox, so the marker vouches for nothing by itself
        raise QuantgateError(f"{task}: quantgate scores it in its own sandbox, lm-eval's log elsewhere (HF code_eval, "
                             "another filter and metric): its logged scores do not pair; judge it here or through its "
                             "endpoint, or leave it out")
    engine = (log.results.get("config") or {}).get("gen_kwargs")  # an endpoint's request_fields (read_log checked)
    if isinstance(engine, dict) and isinstance(logged.get("generation_kwargs"), dict):  # lm-eval merges them in
        logged["generation_kwargs"] = {k: v for k, v in logged["generation_kwargs"].items()
                                       if k not in engine or k in (mine.get("generation_kwargs") or {})}
    for key in SETTINGS:  # prompt_hash covers the prompt only: how it was answered and scored is the config's
        if _setting(logged, key) != _setting(mine, key):
            raise QuantgateError(f"{log.results_file}: configs.{task}.{key} is {logged.get(key)!r}, the task here has "
                                 f"{mine.get(key)!r}: answered or scored otherwise than here, so it does not pair")
    filters = sorted({r["filter"] for _, r in log.records[task]})
    if wanted_filter is None and len(filters) != 1:
        raise QuantgateError(f"{path}: filters {filters}; the probe task {task} scores through exactly one")
    return path, wanted_filter or filters[0], filters, version


SETTINGS = ("output_type", "generation_kwargs", "filter_list", "metric_list", "target_delimiter", "fewshot_delimiter",
            "repeats", "num_fewshot")  # of a task's config: what makes and scores its answers beside the prompt


def _setting(config: dict, key: str) -> str:
    value = config.get(key) or (0 if key == "num_fewshot" else None)  # lm-eval logs an unset num_fewshot as 0
    return re.sub(r" at 0x[0-9a-f]+", "", json.dumps(value, sort_keys=True, default=str))  # a function's address


def task_here(task: str, plan: dict):
    """The lm-eval task object of a plan row as this checkout defines it (eval/, the row's overrides)."""
    from pipelines.core.logs import library_output
    from pipelines.core.paths import EVAL_DIR
    with library_output("lm_eval"):
        if "spec" in plan:
            from pipelines.evaluation.harness import task_configs
            cfg = next(iter(task_configs({task: plan}).values()))
            return standard_tasks.task_manager(True, str(EVAL_DIR)).load([cfg])["tasks"][cfg["task"]]
        return standard_tasks.task_manager(False, str(EVAL_DIR)).load([task])["tasks"][task]


def score_again(task: str, plan: dict, metric: str, kept: list[tuple[str, dict, dict]], scorer=None) -> None:
    """Each kept answer scored here by the task's own process_results from the logged response: a log whose score
    was edited, or made by another scorer (a machine whose sandbox refused the code, say), is refused, not believed."""
    from pipelines.core.logs import library_output

    scorer = scorer or task_here(task, plan)
    with library_output("lm_eval"):
        for where, record, sample in kept:
            responses = sample["filtered_resps"]
            if responses and isinstance(responses[0], list):  # multiple choice: (log-likelihood, is-greedy) per choice
                responses = [(float(ll), str(greedy) == "True") for ll, greedy in responses]
            again = scorer.process_results(sample["doc"], responses).get(metric)
            if again is None or bool(again) != record["correct"]:
                raise QuantgateError(f"{where}: item {record['item_id']}: the log scores it {metric} "
                                     f"{sample.get(metric)!r}, the task here scores its response "
                                     f"{again if again is None else float(again)!r}: an edited "
                                     "log, another version of the scorer, or code scored where the sandbox refused it")
