"""lm-eval sample logs as evidence: a candidate evaluated where it really runs (lm-eval's hf, vllm or sglang backend,
an API), judged with the same statistics, looks, rules, routing, record and gate as a variant evaluated here.

A team runs `lm_eval ... --log_samples --output_path DIR` and declares `candidates.<name>: {path: DIR, source: samples}`.
admit reads the log whole (every line a record, one run, the fields pairing needs; errors name file and line) and copies
it into models/variants/<name>/samples/, so DVC hashes it like a checkpoint and an edited log is a stale input.
evaluate pairs its records with fp16's on (task, filter, doc_id), doc and prompt hashes and the task version checked,
and keeps exactly the items the look plan needed, as an evaluation run here stops where its decision is made.
A log holds no token distributions and no model: KL, memory, the shadow replay and the audit's re-run are not
measured for it, and compare says so in the row (pipelines/judging/comparison.py, `not_measured`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.io import sha256_file
from pipelines.evaluation.log_records import REMEDY, row_task, score_again, task_here, task_samples, to_record
from pipelines.evaluation.plans import by_id, correctness
from pipelines.judging import sequential
from pipelines.models.loading import LOG_SOURCE

SOURCE = LOG_SOURCE  # candidates.<name>.source, and the manifest's `source`
LOG_DIR = "samples"  # models/variants/<name>/samples/: the admitted copy of the log
SAMPLES_FILE = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d\d-\d\dT[\d.\-]+)\.jsonl$")
RESULTS_FILE = re.compile(r"^results_(?P<date>\d{4}-\d\d-\d\dT[\d.\-]+)\.json$")
NEEDED = ("doc_id", "doc", "filter", "doc_hash", "prompt_hash", "target", "filtered_resps")


@dataclass
class SampleLog:
    """One lm-eval run's log: its results file (settings, versions) and each task's records with their line numbers."""

    folder: Path
    results_file: Path
    results: dict
    files: dict[str, Path] = field(default_factory=dict)  # task -> its samples file
    records: dict[str, list[tuple[int, dict]]] = field(default_factory=dict)  # task -> [(line, record)]

    def describe(self) -> dict:
        """What the report and the manifest say of where the evidence came from."""
        config = self.results.get("config") or {}
        return {"source": SOURCE, "backend": config.get("model"), "model_args": _redacted(config.get("model_args")),
                "model_name": self.results.get("model_name"), "lm_eval_version": self.results.get("lm_eval_version"),
                "batch_size": config.get("batch_size"), "tasks": sorted(self.files)}


SECRET = re.compile(r"(?i)(key|token|secret|password|auth|header)")


def _redacted(args):
    """lm-eval's model_args as the report and MLflow may show them: an API backend's key or headers never copied."""
    if isinstance(args, dict):
        return {k: "<redacted>" if SECRET.search(str(k)) else v for k, v in args.items()}
    if isinstance(args, str):  # "pretrained=x,api_key=..." as older lm-eval writes it
        return ",".join(f"{part.split('=', 1)[0]}=<redacted>" if SECRET.search(part.split("=", 1)[0]) else part
                        for part in args.split(","))
    return args


def read_log(folder: str | Path, engine_fields: dict | None = None) -> SampleLog:
    """The one lm-eval run under `folder` (searched below it, as --output_path nests a folder per model), read whole.
    `engine_fields`: the --gen_kwargs an endpoint's evaluation passed on purpose (endpoint.request_fields).

    Raises QuantgateError naming the file (and line) for: no log, several runs, a line that is not a record (a
    truncated file), a record without what pairing needs, a (filter, doc_id) twice."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QuantgateError(f"{folder}: no such folder (candidates.<name>.path of an lm-eval sample log)")
    results = sorted(p for p in folder.rglob("results_*.json") if RESULTS_FILE.match(p.name))
    samples = sorted(p for p in folder.rglob("samples_*.jsonl") if SAMPLES_FILE.match(p.name))
    if not results or not samples:
        raise QuantgateError(f"{folder}: no lm-eval sample log (results_<date>.json and samples_<task>_<date>.jsonl): "
                             f"{REMEDY}")
    if len(results) > 1:  # several runs, or several models' folders under one --output_path
        raise QuantgateError(f"{folder}: {len(results)} lm-eval runs ({', '.join(str(p.relative_to(folder)) for p in results[:4])}"
                             f"{', ...' if len(results) > 4 else ''}): point `path` at the folder of the one run that "
                             "answered (lm-eval writes <output_path>/<model name>/), one run per folder")
    date = RESULTS_FILE.match(results[0].name)["date"]
    try:
        settings = json.loads(results[0].read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise QuantgateError(f"{results[0]}: not JSON ({err}): {REMEDY}") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("config", {}), dict):
        raise QuantgateError(f"{results[0]}: not an lm-eval results file (no `config` object): {REMEDY}")
    log = SampleLog(folder, results[0], settings)
    config = settings.get("config") or {}
    if config.get("gen_kwargs") and _as_text(config["gen_kwargs"]) != _as_text(engine_fields or {}):
        # fp16's answers came from each task's own generation settings: others do not pair (an endpoint's declared
        # engine knobs, endpoint.request_fields, are the one exception: pipelines/evaluation/endpoints.py)
        raise QuantgateError(f"{results[0]}: config.gen_kwargs is {config['gen_kwargs']!r}: the log was generated with "
                             "settings other than the tasks' own (drop --gen_kwargs)")
    if config.get("use_cache"):  # lm-eval's cache is keyed by request, not by model: it can answer with another's
        raise QuantgateError(f"{results[0]}: config.use_cache is {config['use_cache']!r}: cached answers may be another "
                             "model's (lm-eval keys its cache by request only); run again without --use_cache")
    for path in samples:
        match = SAMPLES_FILE.match(path.name)
        if match["date"] != date or path.parent != results[0].parent:
            raise QuantgateError(f"{path}: from another run than {results[0]}: keep one run per folder")
        log.files[match["task"]] = path
        log.records[match["task"]] = _read_records(path)
    return log


def _as_text(fields) -> dict[str, str] | str:
    """--gen_kwargs as lm-eval recorded it (a dict, or "k=v,..." from older versions), for comparison by value."""
    if isinstance(fields, dict):
        return {str(k): str(v) for k, v in fields.items()}
    if isinstance(fields, str):
        return _as_text(dict(part.split("=", 1) for part in fields.split(",") if "=" in part)) if fields else {}
    return str(fields)


def _read_records(path: Path) -> list[tuple[int, dict]]:
    out, seen = [], {}
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise QuantgateError(f"{path}:{number}: not UTF-8 (byte {err.start}): an edited or corrupted file? "
                                     f"{REMEDY}") from None
            except json.JSONDecodeError as err:
                raise QuantgateError(f"{path}:{number}: not a JSON record ({err.msg}; a truncated or edited file?): "
                                     f"{REMEDY}") from None
            if not isinstance(record, dict):
                raise QuantgateError(f"{path}:{number}: not a JSON object")
            missing = [k for k in NEEDED if k not in record]
            if missing:
                raise QuantgateError(f"{path}:{number}: no {', '.join(missing)} (lm-eval 0.4.3 or later writes "
                                     "doc and prompt hashes with --log_samples)")
            wrong = [k for k, kind in (("doc_id", int), ("filter", str), ("doc_hash", str), ("prompt_hash", str),
                                       ("filtered_resps", list)) if not isinstance(record[k], kind)
                     or (kind is int and isinstance(record[k], bool))]
            if wrong:
                raise QuantgateError(f"{path}:{number}: {wrong[0]} is {record[wrong[0]]!r}, not what lm-eval writes")
            key = (record["filter"], record["doc_id"])
            if key in seen:
                raise QuantgateError(f"{path}:{number}: doc {record['doc_id']} (filter {record['filter']!r}) again, "
                                     f"first on line {seen[key]}: two runs in one file?")
            seen[key] = number
            out.append((number, record))
    if not out:
        raise QuantgateError(f"{path}: no records (an empty samples file): {REMEDY}")
    return out


def copy_log(log: SampleLog, dest: Path) -> dict[str, str]:
    """The run's files copied into `dest` (flat, names kept); {name: sha256} of each."""
    dest.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for path in [log.results_file, *log.files.values()]:
        shutil.copyfile(path, dest / path.name)
        hashes[path.name] = sha256_file(dest / path.name)
    return hashes


def admit(name: str, path: str, out_root: Path) -> dict:
    """Stage admit of a log candidate: the log read whole and copied into out_root/<name>/samples/ with a manifest
    (sha256 of every file, the backend and settings lm-eval recorded); a log that does not read is refused, its
    reason naming file and line, and the stage goes on."""
    from pipelines.core.io import atomic_dir, write_json
    from pipelines.core.paths import MANIFEST

    manifest = {"variant": name, "candidate": True, "source": SOURCE, "source_path": str(path), "method": SOURCE}
    try:
        log = read_log(path)
        with atomic_dir(out_root / name) as tmp:
            files = copy_log(log, tmp / LOG_DIR)
            manifest.update({"status": "ok", "dtype": None, "evidence": log.describe(), "files": files,
                             "validation": {"admitted": True, "reasons": []}})
            write_json(tmp / MANIFEST, manifest)
    except Exception as err:  # noqa: BLE001 - nothing a log holds stops the stage: it is the candidate's refusal
        reason = str(err) if isinstance(err, QuantgateError) else \
            f"{err.filename or path}: {err.strerror or err}" if isinstance(err, OSError) else \
            f"{path}: could not be read: {type(err).__name__}: {err}"[:2000]
        manifest.update({"status": "failed", "reasons": [reason], "validation": {"admitted": False, "reasons": [reason]},
                         "error": f"sample log refused: {reason}"})
        with atomic_dir(out_root / name) as tmp:
            write_json(tmp / MANIFEST, manifest)
    return manifest


def records(log: SampleLog, plans: dict[str, dict], base_items: list[dict], base_eval: dict, policy_for,
            compare) -> tuple[dict, list[dict]]:
    """(evaluation summary, per-item records) of a candidate from its log, paired with fp16's records.

    Per row: the records of the row's task and filter, checked against fp16's (task version, doc and prompt hash per
    item), cut where the look plan decides (sequential.run_looks against fp16's answers), exactly what an evaluation
    here would have scored, and each kept answer scored again here from its response. A row whose records do not pair
    is that row's refusal, its reason naming file and line; the other rows are judged."""
    summary, items = {}, []
    for row, plan in plans.items():
        task, wanted_filter, metric = row_task(row, plan)
        base_probe = (base_eval.get("probes") or {}).get(row) or {}
        if base_probe.get("status") != "ok":  # fp16 could not be measured on it here (no sandbox, say): nothing to pair
            summary[row] = {"task": task, "status": "refused", "score": None, "stderr": None, "items": 0,
                            "cause": base_probe.get("cause"), "reason": f"fp16 was not measured on row {row} here: "
                            f"{base_probe.get('reason') or base_probe.get('status') or 'no baseline row'}",
                            "remedy": base_probe.get("remedy") or ""}
            continue
        try:
            summary[row], kept = _row(log, row, plan, task, wanted_filter, metric, base_probe,
                                      by_id(base_items, row), policy_for, compare)
        except QuantgateError as err:  # this row's records do not pair: its refusal (compare fails the domain)
            summary[row] = {"task": task, "status": "refused", "score": None, "stderr": None, "items": 0,
                            "reason": f"the sample log does not pair: {err}"}
            continue
        items += kept
    return summary, items


def _row(log: SampleLog, row: str, plan: dict, task: str, wanted_filter: str | None, metric: str, base_probe: dict,
         base: dict[str, dict], policy_for, compare) -> tuple[dict, list[dict]]:
    """One row's summary and kept records (see `records`); raises QuantgateError naming file and line."""
    here = task_here(task, plan)
    path, wanted_filter, filters, version = task_samples(log, plan, task, wanted_filter, here,
                                                         base_probe.get("task_version"), "fp16 was evaluated on version")
    mine, lines = {}, {}
    for number, sample in log.records[task]:
        if sample["filter"] != wanted_filter:
            continue
        where = f"{path}:{number}"
        record = to_record(row, plan, task, metric, sample, where, log.results)
        theirs = base.get(record["item_id"])
        if theirs is not None:
            for key, why in (("doc_hash", "another item text (another pool file or version)"),
                             ("prompt_hash", "another prompt (chat template, system instruction, num_fewshot or "
                                             "few-shot seed)")):
                if record[key] != theirs.get(key):
                    raise QuantgateError(f"{where}: item {record['item_id']} ({task} doc {sample['doc_id']}): "
                                         f"{key} differs from fp16's: {why}")
        mine[record["item_id"]], lines[record["item_id"]] = (record, sample), number
    if not mine:
        raise QuantgateError(f"{path}: no record scored through filter {wanted_filter!r} (filters there: {filters})")
    kept = _looks(row, plan, correctness(base), {i: r for i, (r, _) in mine.items()}, path, policy_for, compare)
    score_again(task, plan, metric, [(f"{path}:{lines[i]}", *mine[i]) for i in kept], here)
    score = sum(mine[i][0]["correct"] for i in kept) / len(kept) if kept else None
    summary = {"task": task, "status": "ok", "task_version": version, "metric": metric, "score": score,
               "stderr": None, "items": len(kept), "source": str(path.name)}
    if "spec" in plan:
        summary["filter"] = wanted_filter
    return summary, [mine[i][0] for i in kept]


def evaluate(name: str, folder: Path, plans: dict[str, dict], base_items: list[dict], base_eval: dict,
             compare, allow_unisolated_code: bool = False) -> tuple[dict, list[dict]]:
    """Stage evaluate of a log candidate: its records from the admitted copy of the log; a log that does not read is
    the candidate's recorded failure (file and line in the error), a row that does not pair that row's, never a stop.
    `allow_unisolated_code`: evaluate.allow_unisolated_code, for scoring code answers again as fp16's were."""
    import os

    os.environ["QUANTGATE_ALLOW_UNISOLATED_CODE"] = "1" if allow_unisolated_code else "0"
    result: dict = {"variant": name, "device": None, "batch_size": None, "fidelity": None,
                    "not_measured": {"fidelity": "an lm-eval sample log holds no token distributions to compare with "
                                                 "fp16's (KL, top-1 agreement)"}}
    try:
        log = read_log(folder / LOG_DIR)
        result.update({"evidence": log.describe(), "batch_size": log.describe()["batch_size"]})
        result["probes"], items = records(log, plans, base_items, base_eval, compare.policy_for, compare)
    except QuantgateError as err:
        return {**result, "status": "failed", "error": str(err)}, []
    except Exception as err:  # noqa: BLE001 - whatever a log holds, it is this candidate's failure, never a stop
        return {**result, "status": "failed", "error": f"the sample log could not be read: {type(err).__name__}: "
                                                       f"{err}"[:2000]}, []
    result["status"] = "ok"
    return result, items


def _looks(row: str, plan: dict, base: dict[str, bool], mine: dict[str, dict], path: Path, policy_for,
           compare) -> list[str]:
    """The item ids the look plan needs of this row, in evaluation order: look by look until the rule decides."""
    order, looks = plan["order"], plan["looks"]
    margin = policy_for(plan.get("domain", row)).max_accuracy_drop
    answers = {i: r["correct"] for i, r in mine.items()}
    for look, size in enumerate(looks):
        missing = [i for i in order[:size] if i not in answers]
        if missing:
            raise QuantgateError(f"{path}: look {look + 1} of row {row} needs the pool's first {size} items in "
                                 f"evaluation order; the log lacks {len(missing)} of them (e.g. {missing[0]}): evaluate "
                                 "the whole pool (no --limit)")
        so_far = {i: answers[i] for i in order[:size]}  # what an evaluation here would have scored by this look
        run = sequential.run_looks(base, so_far, order, looks, plan["families"], margin, compare.alpha,
                                   compare.spending)
        if sequential.more_items(run) is None:
            return order[:size]
    return order[: looks[-1]] if looks else []
