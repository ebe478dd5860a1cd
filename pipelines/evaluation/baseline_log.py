"""fp16's baseline from an lm-eval sample log: for a team whose fp16 runs only on its GPU fleet, the answers every
variant and candidate is paired with come from `lm_eval --model vllm ... --log_samples` there, or from lm-eval run here
against the OpenAI-compatible endpoint fp16 is served at (`from_endpoint`), not from a run of the model here.

params.yaml `baseline: {source: samples, path: DIR}` (or `{source: endpoint, path: SPEC, endpoint: {...}}`); the
baseline stage reads the log whole (pipelines/evaluation/sample_logs.py: one run, every line a record, errors naming file and line) and, per row, keeps every item of every
look, each checked against this checkout's task: the task version, each item's doc hash against the doc the task here
loads (so the log answered these items, not another pool's), and each answer scored again by the task's own scorer.
A row the log cannot give is refused with its reason, and its variants' rows with it. A log holds no token
distributions: KL against fp16 is not measured for anyone (a candidate may declare it judged elsewhere), and the audit
cannot re-run fp16's records. Prompts are checked where they meet: each variant's prompt hashes against fp16's
(`unpaired_rows`), as a candidate's log is checked in sample_logs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.evaluation import log_records, sample_logs
from pipelines.evaluation.plans import row_of

SOURCE = sample_logs.SOURCE
NO_DISTRIBUTIONS = ("fp16's baseline is an lm-eval sample log (baseline.source: samples): it holds no token "
                    "distributions to compare with (KL, top-1 agreement)")
NO_DISTRIBUTIONS_SERVED = ("fp16's baseline was evaluated through its endpoint (baseline.source: endpoint), which returns "
                           "sampled tokens and at most top logprobs, not the token distributions KL and top-1 agreement "
                           "compare")


def evaluate(folder: str | Path, plans: dict[str, dict], copy_to: Path, allow_unisolated_code: bool = False,
             engine_fields: dict | None = None) -> tuple[dict, list[dict]]:
    """The baseline stage's (result, per-item records) from fp16's log in `folder`, copied into `copy_to` (the
    stage's output) with each file's sha256. A log that does not read is a failed result with the reason; the stage
    stops on it, as it does when fp16 cannot be evaluated here. `allow_unisolated_code`: as for fp16 evaluated here,
    for scoring its code answers again; `engine_fields`: the --gen_kwargs an endpoint's run passed on purpose."""
    import os

    os.environ["QUANTGATE_ALLOW_UNISOLATED_CODE"] = "1" if allow_unisolated_code else "0"
    result: dict = {"variant": "fp16", "device": None, "batch_size": None, "fidelity": None,
                    "not_measured": {"fidelity": NO_DISTRIBUTIONS}, "baseline": {"source": SOURCE, "path": str(folder)}}
    try:
        log = sample_logs.read_log(folder, engine_fields)
        _of_an_unquantized_model(log)
        shutil.rmtree(copy_to, ignore_errors=True)  # a former log's files never stay beside this one's
        result["evidence"] = {**log.describe(), "files": sample_logs.copy_log(log, copy_to)}
        result["batch_size"] = log.describe()["batch_size"]
        summary, items = {}, []
        for row, plan in plans.items():
            task = log_records.row_task(row, plan)[0]
            try:
                summary[row], kept = _row(log, row, plan)
            except QuantgateError as err:  # this row has no baseline: its variants' rows are refused with it
                summary[row] = {"task": task, "status": "refused", "score": None, "stderr": None, "items": 0,
                                "reason": f"fp16's sample log cannot give this row: {err}"}
                continue
            items += kept
    except QuantgateError as err:
        return {**result, "status": "failed", "error": str(err)}, []
    except Exception as err:  # noqa: BLE001 - whatever a log holds: the stage says what, never a bare trace
        return {**result, "status": "failed", "error": f"{folder}: could not be read: {type(err).__name__}: "
                                                       f"{err}"[:2000]}, []
    result.update({"status": "ok", "probes": summary})
    return result, items


def from_endpoint(endpoint: dict, spec: str, plans: dict[str, dict], copy_to: Path, tokenizer_dir: Path,
                  eval_dir: Path, timeout_s: int, allow_unisolated_code: bool = False) -> tuple[dict, list[dict]]:
    """fp16's baseline through the OpenAI-compatible endpoint it is served at (baseline.source: endpoint, `spec` its
    deployment spec): the server checked as admit checks a candidate's (pipelines/evaluation/endpoints.py), lm-eval's
    local-completions run on every item the looks can ask, and the sample log it writes read exactly as a team's log
    of fp16 (`evaluate`) and kept in `copy_to`. A row the server cannot give (`endpoints.run_servable`) is refused
    with the reason; a server that does not answer, or that can give no row, is a failed result, which stops the stage
    as fp16 failing here does."""
    import tempfile

    from pipelines.evaluation import endpoints

    served = {"source": endpoints.SOURCE, "path": spec, "base_url": endpoint["base_url"], "model": endpoint["model"]}
    failed = {"variant": "fp16", "device": None, "batch_size": 1, "fidelity": None, "status": "failed",
              "not_measured": {"fidelity": NO_DISTRIBUTIONS_SERVED}, "baseline": served}
    state = endpoints.checked(endpoint, tokenizer_dir)
    if state["problem"]:
        return {**failed, "error": f"{state['problem']} (once the server is up: dvc repro baseline)"}, []
    try:
        with tempfile.TemporaryDirectory(prefix="lm-eval-baseline-") as tmp:
            skipped, logged = endpoints.run_servable(endpoint, plans, state, tokenizer_dir, eval_dir, timeout_s,
                                                     allow_unisolated_code, Path(tmp))
            if logged is None:
                raise QuantgateError(f"{endpoint['base_url']} can give none of the rows: " + "; ".join(
                    f"{row}: {why}" for row, why in skipped.items()))
            servable = {row: plan for row, plan in plans.items() if row not in skipped}
            result, items = evaluate(logged, servable, copy_to, allow_unisolated_code, endpoint.get("request_fields"))
        endpoints.still_served("baseline fp16", endpoint, state["fingerprint"], "dvc repro -f -s baseline")
    except QuantgateError as err:
        return {**failed, "error": endpoints.scrubbed(str(err), endpoint)}, []
    except Exception as err:  # noqa: BLE001 - whatever the server or lm-eval did: the stage says what, never a trace
        return {**failed, "error": endpoints.scrubbed(f"evaluation through the endpoint broke: {type(err).__name__}: "
                                                      f"{str(err)[:1500]}", endpoint)}, []
    if result["status"] != "ok":
        return {**failed, "error": endpoints.scrubbed(result["error"], endpoint)}, []
    result.update(baseline=served, not_measured={"fidelity": NO_DISTRIBUTIONS_SERVED})
    result["evidence"].update(base_url=endpoint["base_url"], model=endpoint["model"], listed=state["models"],
                              logprobs=state["logprobs"], logprobs_problem=state["logprobs_problem"],
                              fingerprint=state["fingerprint"])
    result["probes"] = {row: result["probes"].get(row) or endpoints.refused_row(
        plans[row], f"fp16's endpoint cannot give this row: {skipped[row]}") for row in plans}  # the plan's order
    return result, items


QUANTIZING = re.compile(r"(?i)quantiz|load_in_[48]bit|kv_cache_dtype|bnb_4bit")


def _of_an_unquantized_model(log: sample_logs.SampleLog) -> None:
    """Refuses a log whose model arguments quantize what it ran (vLLM's quantization= or an fp8 KV cache, hf's
    load_in_8bit): that is a variant's run, not fp16's. Which model it ran is the team's word, shown in the report."""
    args = (log.results.get("config") or {}).get("model_args")
    pairs = args.items() if isinstance(args, dict) else \
        [part.split("=", 1) for part in str(args or "").split(",") if "=" in part]
    for key, value in pairs:
        if QUANTIZING.search(str(key)) and str(value).lower() not in ("", "none", "false", "auto", "0"):
            raise QuantgateError(f"{log.results_file}: config.model_args {key}={value}: a quantized run is a variant's "
                                 "evidence, not fp16's baseline")


def _row(log: sample_logs.SampleLog, row: str, plan: dict) -> tuple[dict, list[dict]]:
    """One row's summary and every record the looks can ask, checked against the task here; raises QuantgateError
    naming file and line."""
    task, wanted_filter, metric = log_records.row_task(row, plan)
    here = log_records.task_here(task, plan)
    path, wanted_filter, _, version = log_records.task_samples(log, plan, task, wanted_filter, here, here.VERSION,
                                                               "the task here is version")
    docs = here.eval_docs
    chance_from = {"configs": {task: {"output_type": here.config.output_type}}}  # the task's here, not the log's word
    mine: dict[str, tuple[str, dict, dict]] = {}
    for number, sample in log.records[task]:
        if sample["filter"] != wanted_filter:
            continue
        where = f"{path}:{number}"
        if not 0 <= sample["doc_id"] < len(docs):
            raise QuantgateError(f"{where}: doc {sample['doc_id']}: task {task} here has {len(docs)} docs")
        doc = docs[sample["doc_id"]]
        if sample["doc_hash"] != log_records.doc_hash(doc):
            raise QuantgateError(f"{where}: doc {sample['doc_id']}'s doc_hash is not the hash of task {task}'s doc "
                                 "here: another item text (another pool file, version or dataset revision), or "
                                 "--samples positions given unsorted")
        if str(here.doc_to_target(doc)) != str(sample["target"]):
            raise QuantgateError(f"{where}: target {sample['target']!r} is not task {task}'s target here for doc "
                                 f"{sample['doc_id']}: an edited log")
        sample = {**sample, "doc": doc}  # ids and scoring from the doc here, never the log's copy of it
        record = log_records.to_record(row, plan, task, metric, sample, where, chance_from)
        mine[record["item_id"]] = (where, record, sample)
    asked = plan["order"][: plan["looks"][-1]] if plan["looks"] else []
    missing = [i for i in asked if i not in mine]
    if missing:
        raise QuantgateError(f"{path}: fp16 answers every item the looks can ask ({len(asked)} of row {row}); the log "
                             f"lacks {len(missing)} of them (e.g. {missing[0]}): evaluate the whole pool (no --limit)")
    log_records.score_again(task, plan, metric, [mine[i] for i in asked], here)
    score = sum(mine[i][1]["correct"] for i in asked) / len(asked) if asked else None
    summary = {"task": task, "status": "ok", "task_version": version, "metric": metric, "score": score,
               "stderr": None, "items": len(asked), "source": path.name}
    if "spec" in plan:
        summary["filter"] = wanted_filter
    return summary, [mine[i][1] for i in asked]


def unpaired_rows(items: list[dict], base_items: list[dict]) -> dict[str, str]:
    """{row: why} where a model's records do not pair with fp16's: an item fp16 never answered, or one asked with
    another prompt (chat template, system instruction, few-shot) or about another text. Evaluated in one process
    they always pair; with fp16's answers from a log of another engine, this is where a drift shows."""
    base = {(row_of(r), str(r.get("item_id"))): r for r in base_items}
    out: dict[str, str] = {}
    for record in items:
        row, item = row_of(record), str(record.get("item_id"))
        theirs = base.get((row, item))
        if row in out:
            continue
        if theirs is None:
            out[row] = f"item {item}: fp16's baseline has no answer to it"
        elif record.get("doc_hash") != theirs.get("doc_hash"):
            out[row] = f"item {item}: doc_hash differs from fp16's: another item text"
        elif record.get("prompt_hash") != theirs.get("prompt_hash"):
            out[row] = (f"item {item}: prompt_hash differs from fp16's: another prompt (chat template, system "
                        "instruction, num_fewshot or few-shot seed) than fp16's log was asked with")
    return out
