"""Stage `record`: one pipeline run into MLflow, and every passing variant into the model registry.

One parent run per pipeline result (keyed by the digest of every dvc.lock entry but record's own, so a
changed policy or any changed result is a new parent run), one
child run per variant and candidate with settings as params, every number as a metric under readable
names (`math/accuracy`, `memory/footprint_bytes`), verdicts as tags, manifests and per-item records as
artifacts, and a child run `shadow` with the shadow replay (agreement with fp16 per request type, latency, the
rollout plan) where the results have one. Recording the same digest twice finds the first run and writes nothing: DVC may restore
stages from its run-cache without running them, so idempotence is by content, not by execution.

What each run shows is store/layout.py; how a passing variant's checkpoint becomes a registered version that
names the gated bytes is store/registry.py; the store, its experiment and the recording lock are store/client.py.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import mlflow
import pandas as pd
from mlflow import MlflowClient

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, read_jsonl, sha256_file
from pipelines.core.params import DERIVED_FROM_REQUESTS, Params
from pipelines.core.paths import (BASELINE, BUILT_DIR, COMPARE_REPORT, COMPARE_TABLE, COVERAGE_DIR, DVC_LOCK, EVAL_DIR,
                                  EVAL_RESULTS, KSERVE_DIR, MANIFEST, MEMORY_RESULTS, MEMORY_SUMMARY, MEMORY_TRACES, MLARTIFACTS,
                                  PARAMS_FILE, PLOTS_DIR, QUANTIZE_RESULTS, REFERENCE_REPORT, RESULTS, ROLLOUT_PLAN,
                                  ROUTER_CONFIG, ROUTING_TABLE, SHADOW_METRICS, SHADOW_REPORT, VARIANTS_DIR)
from pipelines.judging.comparison import flat_rows
from pipelines.judging.verdict import shadow_failures
from pipelines.models.loading import ELSEWHERE
from pipelines.store.client import experiment_id, recording_lock, served, using_store
from pipelines.store.layout import (FORMAT_TAG, KIND_TAG, RECORD_FORMAT, RUN_TYPE_EVALUATION, RUN_TYPE_TAG,
                                    SHADOW_RUN_NAME, checkpoint_sha256, child_description, child_metrics, child_params,
                                    child_run_name, classifier_metrics, fleet_metrics, fleet_rows, flatten,
                                    parent_metrics, parent_verdict_tags, routing_rows, shadow_agreement_rows,
                                    shadow_description, shadow_latency_rows, shadow_metrics, shadow_params,
                                    write_verdict_view)
from pipelines.store.registry import DIGEST_TAG, delete_versions, log_checkpoint, reconcile_candidate, register_passing

COMPLETE_TAG = "quantgate.complete"  # set on the parent run once every child is logged and every version registered


def find_recorded(client: MlflowClient, exp_id: str, digest: str) -> list:
    """Parent runs already recorded for this digest."""
    return client.search_runs([exp_id], f"tags.`{KIND_TAG}` = 'pipeline' and tags.`{DIGEST_TAG}` = '{digest}'")


def model_source_tags(root: Path) -> dict[str, str]:
    """A model built from a file (a GGUF) names it: its sha256, and what the unquantized baseline is."""
    report = read_json(root / REFERENCE_REPORT) if (root / REFERENCE_REPORT).is_file() else {}
    source = report.get("gguf") if isinstance(report, dict) else None
    if not isinstance(source, dict):
        return {}
    return {"model.sha256": str(source.get("sha256")), "model.file": str(source.get("file")),
            "model.baseline": str(report.get("baseline_note"))}


def _dataset_inputs(paths: list[tuple[str, Path]], context: str) -> None:
    """JSONL files as MLflow dataset inputs of the active run, named and tagged with their sha256."""
    for name, path in paths:
        if not path.is_file():
            continue
        digest = sha256_file(path)
        frame = pd.DataFrame(read_jsonl(path))
        with warnings.catch_warnings():  # a local path matches two equivalent MLflow source types; it says so
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            dataset = mlflow.data.from_pandas(frame, source=str(path), name=name, digest=digest[:36])
        _log_input(dataset, context, {"sha256": digest, "rows": str(len(frame))})


DATASET_RACE = ("duplicate key value violates unique constraint", "UNIQUE constraint failed: datasets")


def _log_input(dataset, context: str, tags: dict, attempts: int = 3) -> None:
    """`mlflow.log_input`, again if it lost a race: two pipelines logging the same dataset at once (the same
    calibration set) both find it missing and both insert it, and the second insert breaks the store's unique key
    (seen on PostgreSQL in CI). The store rolls the losing call back whole, and by then the dataset exists, so
    the next call only links it to this run."""
    from mlflow.exceptions import MlflowException

    for attempt in range(1, attempts + 1):
        try:
            mlflow.log_input(dataset, context=context, tags=tags)
            return
        except MlflowException as err:
            if attempt == attempts or not any(text in str(err) for text in DATASET_RACE):
                raise
            time.sleep(0.5 * attempt)


def _log_files(files: list[Path], artifact_path: str | None = None) -> None:
    for path in files:
        if path.is_file():
            mlflow.log_artifact(str(path), artifact_path)


def _trace_files(folder: Path) -> list[Path]:
    """The files a person opens from the memory stage's trace folder, as its index.json lists them
    (pipelines/memory.py write_trace_index): a flame graph, a CUDA snapshot, or none."""
    index = folder / "index.json"
    return [folder / name for name in (read_json(index).get("artifacts") or [])] if index.is_file() else []


def record_pipeline(params: Params, tracking_uri: str, digest: str, commit: dict, root: Path = Path("."),
                    artifact_root: Path | None = None) -> dict:
    """Record compare/route/memory/eval results under one parent run; register passing variants."""
    with using_store(tracking_uri) as client:
        return _record(client, params, digest, commit, root,
                       None if served(tracking_uri) else artifact_root or root / MLARTIFACTS)


def _record(client: MlflowClient, params: Params, digest: str, commit: dict, root: Path,
            artifact_root: Path | None) -> dict:
    report = read_json(root / COMPARE_REPORT)
    table = read_json(root / ROUTING_TABLE)
    exp_id = experiment_id(client, params.mlflow.experiment, artifact_root)
    with recording_lock(client, digest):
        summary = _record_locked(client, params, digest, commit, root, exp_id, report, table)
    return {**summary, "view": write_verdict_view(client, exp_id, report)}


def _record_locked(client: MlflowClient, params: Params, digest: str, commit: dict, root: Path, exp_id: str,
                   report: dict, table: dict) -> dict:
    recorded = find_recorded(client, exp_id, digest)
    # complete = finished and its passing variants registered (the tag is set last)
    # (a recording in an older format is replaced like a crashed one: its versions name no stored checkpoint)
    finished = [r for r in recorded if r.info.status == "FINISHED" and r.data.tags.get(COMPLETE_TAG) == "true"
                and r.data.tags.get(FORMAT_TAG) == RECORD_FORMAT]
    if finished:  # the runs are there; the aliases must still say what these results say
        reconcile_candidate(client, params.registered_model_name(), digest)
        return {"status": "already recorded", "parent_run_id": finished[0].info.run_id, "experiment_id": exp_id,
                "registered": []}
    for run in recorded:  # a recording that crashed half-way: replace it, never keep a partial copy
        for child in client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"):
            client.delete_run(child.info.run_id)
        client.delete_run(run.info.run_id)
    delete_versions(client, params.registered_model_name(), digest)  # registered by a recording that crashed

    names = [BASELINE, *report["variants"]]
    children = {}
    # another model's runs (a profile's: bash scripts/run.sh --model NAME) sit in the same experiment, named by it
    label = "" if params.model == "reference" else " · " + Path(params.model.rstrip("/")).name.removesuffix(".gguf")
    with mlflow.start_run(experiment_id=exp_id, run_name=f"pipeline {digest[:8]}{label}",
                          tags={KIND_TAG: "pipeline", DIGEST_TAG: digest, FORMAT_TAG: RECORD_FORMAT,
                                "git.commit": str(commit.get("commit")),
                                "git.dirty": str(commit.get("dirty")), "model": params.model,
                                **({"profile": commit["profile"], "workspace.commit": str(commit.get("workspace_commit"))}
                                   if commit.get("profile") else {}),
                                **model_source_tags(root), **parent_verdict_tags(report)}) as parent:
        mlflow.log_params(flatten("", params.model_dump(mode="json", exclude=DERIVED_FROM_REQUESTS), {}))
        mlflow.log_metrics(parent_metrics(report))
        mlflow.log_table(pd.DataFrame(flat_rows(report)), "tables/compare.json")
        mlflow.log_table(pd.DataFrame(routing_rows(table)), "tables/routing_table.json")
        if table.get("fleet"):  # the fleet plan beside fp16 alone, row by row and the best single variant
            mlflow.log_metrics(fleet_metrics(table))
            mlflow.log_table(pd.DataFrame(fleet_rows(table)), "tables/fleet_plans.json")
        built, coverage, classifier = root / BUILT_DIR, root / COVERAGE_DIR, root / COVERAGE_DIR / "classifier.json"
        _dataset_inputs([(f"calibration-{d}", built / f"{d}.jsonl") for d in params.calibration.domains], "calibration")
        _dataset_inputs([(f"probes-{d}", root / EVAL_DIR / d / params.evaluate.probes[d].items)
                         for d in report["domains"]], "evaluation")
        _log_files([root / COMPARE_REPORT, root / COMPARE_TABLE, root / ROUTING_TABLE,
                    root / RESULTS / "routing_table.yaml", root / MEMORY_SUMMARY,
                    coverage / "coverage.json", classifier, root / DVC_LOCK, root / PARAMS_FILE], "results")
        _log_files(sorted((root / PLOTS_DIR).glob("*.png")), "plots")
        _log_files([coverage / "coverage.png", coverage / "classifier_confusion.png"], "plots")
        if classifier.is_file():
            mlflow.log_metrics(classifier_metrics(read_json(classifier)))
        checkpoints = {}
        for name in names:
            children[name], checkpoints[name] = _record_child(name, report, params, root, digest, exp_id)
        shadow_run = _record_shadow(root, digest, exp_id) if (root / SHADOW_REPORT).is_file() else None
    # a variant the shadow replay failed (its replay crashed, or it agreed with fp16 on no request type) is not a
    # release candidate, whatever compare says: the gate fails it too (verdict.shadow_failures)
    shadow = read_json(root / SHADOW_REPORT) if (root / SHADOW_REPORT).is_file() else None
    releasable = {**report, "variants": {n: (v if not shadow_failures(n, shadow, table) else {**v, "verdict": "fail"})
                                         for n, v in report["variants"].items()}}
    registered = register_passing(client, params.registered_model_name(), releasable, children, checkpoints, digest)
    client.set_tag(parent.info.run_id, COMPLETE_TAG, "true")
    return {"status": "recorded", "parent_run_id": parent.info.run_id, "experiment_id": exp_id,
            "children": children, "shadow_run_id": shadow_run, "registered": registered,
            "unregistered": [{"variant": n, "reason": c["refused"]} for n, c in checkpoints.items() if c and "refused" in c]}


def _record_child(name: str, report: dict, params: Params, root: Path, digest: str,
                  exp_id: str) -> tuple[str, dict | None]:
    """One child run: params, metrics, verdict tags and artifacts of one variant (or of fp16); a variant that
    passed every domain also gets its checkpoint stored (returned: its digest, or why it was refused)."""
    memory_path = root / MEMORY_SUMMARY
    memory = (read_json(memory_path).get("variants") or {}).get(name) if memory_path.is_file() else None
    manifest_path = root / VARIANTS_DIR / name / MANIFEST
    eval_path = root / EVAL_RESULTS / f"{name}.json"
    timing_path = root / QUANTIZE_RESULTS / f"{name}.json"
    manifest = read_json(manifest_path) if manifest_path.is_file() else None
    evaluation = read_json(eval_path) if eval_path.is_file() else None
    timing = read_json(timing_path) if timing_path.is_file() else None
    row = report["variants"].get(name)
    kind = "baseline" if name == BASELINE else row.get("kind", "variant")
    tags = {KIND_TAG: kind, DIGEST_TAG: digest, "quantgate.variant": name,
            "verdict": "baseline" if name == BASELINE else row["verdict"],
            "checkpoint_sha256": checkpoint_sha256(manifest), RUN_TYPE_TAG: RUN_TYPE_EVALUATION,
            "mlflow.note.content": child_description(name, row)}
    if (memory or {}).get("growth_class"):  # why its memory grows (pipelines/measure/attribution.py)
        tags["memory.growth"] = memory["growth_class"]
        tags["memory.growth_cause"] = (memory.get("growth_cause") or "")[:4000]
    for domain, d in ((row or {}).get("domains") or {}).items():
        tags[f"verdict.{domain}"] = d["verdict"]
        if d["verdict"] != "pass" or d.get("not_checked_here"):  # a pass on evidence judged partly elsewhere says so
            tags[f"reasons.{domain}"] = "; ".join(d["reasons"])[:4000]
    settings = params.variants[name].model_dump(mode="json") if name in params.variants else \
        params.candidates[name].model_dump(mode="json") if name in params.candidates else None
    with mlflow.start_run(experiment_id=exp_id, run_name=child_run_name(name, row), nested=True, tags=tags) as child:
        mlflow.log_params(child_params(manifest, settings))
        mlflow.log_metrics(child_metrics(name, report, evaluation, manifest, memory, timing))
        _log_files([manifest_path, eval_path, root / MEMORY_RESULTS / f"{name}.json"], "results")
        # why its memory grew, for a person: memray's flame graph (CPU) or the snapshot memory_viz reads (CUDA)
        _log_files(_trace_files(root / MEMORY_TRACES / name), "memory")
        _log_files([root / EVAL_RESULTS / name / "items.jsonl"], "eval")
        _log_files(sorted((root / PLOTS_DIR).glob("*.png")), "plots")  # where this variant stands among the rest
        if (manifest or {}).get("calibration"):
            _dataset_inputs([("calibration-mixed", root / BUILT_DIR / "mixed.jsonl")], "calibration")
        checkpoint = None
        if name != BASELINE and row["verdict"] == "pass" and (manifest or {}).get("source") in ELSEWHERE:
            checkpoint = {"refused": "it was evaluated elsewhere (an lm-eval sample log or an endpoint): no checkpoint "
                                     "here to register"}
            mlflow.set_tag("registry", f"not registered: {checkpoint['refused']}")
        elif name != BASELINE and row["verdict"] == "pass":
            try:
                checkpoint = log_checkpoint(root / VARIANTS_DIR / name)
            except QuantgateError as err:  # not registered: a version must name the bytes that were gated
                checkpoint = {"refused": str(err)}
                mlflow.set_tag("registry", f"not registered: {err}"[:4000])
        return child.info.run_id, checkpoint


def _record_shadow(root: Path, digest: str, exp_id: str) -> str:
    """The `shadow` child run: the replay's settings as params, agreement and latency as metrics and tables, its
    plots, and the rollout plan and KServe manifests that route wrote from it (older results have no shadow.json:
    no such child)."""
    shadow = read_json(root / SHADOW_REPORT)
    measured = read_json(root / SHADOW_METRICS) if (root / SHADOW_METRICS).is_file() else None
    tags = {KIND_TAG: SHADOW_RUN_NAME, DIGEST_TAG: digest, RUN_TYPE_TAG: RUN_TYPE_EVALUATION,
            "mlflow.note.content": shadow_description(shadow),
            **{f"shadow.{m}.status": str((e or {}).get("status")) for m, e in (shadow.get("models") or {}).items()}}
    with mlflow.start_run(experiment_id=exp_id, run_name=SHADOW_RUN_NAME, nested=True, tags=tags) as child:
        mlflow.log_params(shadow_params(shadow))
        mlflow.log_metrics(shadow_metrics(shadow, measured))
        mlflow.log_table(pd.DataFrame(shadow_agreement_rows(shadow)), "tables/shadow_agreement.json")
        mlflow.log_table(pd.DataFrame(shadow_latency_rows(shadow, measured)), "tables/shadow_latency.json")
        _log_files([root / SHADOW_REPORT, root / SHADOW_METRICS], "results")
        _log_files([root / PLOTS_DIR / "shadow_agreement.png", root / PLOTS_DIR / "shadow_latency.png"], "plots")
        _log_files([root / ROLLOUT_PLAN, root / ROUTER_CONFIG], "rollout")
        _log_files(sorted((root / KSERVE_DIR).glob("*.yaml")), "rollout/kserve")
        return child.info.run_id


def main() -> int:
    """Stage `record`: everything into MLflow (parent + child runs, tables, datasets), passing variants into the registry."""
    import logging

    from pipelines.core import logs
    from pipelines.core.io import write_json
    from pipelines.core.lineage import foreign_code, recorded_commit, results_digest
    from pipelines.core.params import load_params
    from pipelines.core.paths import MLFLOW_RUN
    from pipelines.core.timing import library_call
    from pipelines.models.gguf import stale_model
    from pipelines.store.tracking import artifact_root, tracking_uri

    log = logging.getLogger(__name__)
    params = load_params()
    digest = results_digest()
    if digest is None:
        raise QuantgateError("dvc.lock not found: record runs inside `dvc repro`, after the stages it records")
    if stale := stale_model():  # never register versions of a model whose file is no longer the one judged
        raise QuantgateError(f"not recorded: {stale[0]}")
    if foreign := foreign_code(Path(".")):  # dvc.lock hashed the workspace's code; another checkout's ran
        raise QuantgateError(f"not recorded: {foreign[0]}")
    uri = tracking_uri()
    commit = recorded_commit()
    with logs.library_output("mlflow"), library_call("mlflow"):
        summary = record_pipeline(params, uri, digest, commit, artifact_root=artifact_root())
    write_json(MLFLOW_RUN, {**summary, "tracking_uri": uri, "results_digest": digest,
                            "registered_model": params.registered_model_name()})
    if summary["status"] == "already recorded":
        log.info("record: results %s already recorded as run %s: nothing written", digest[:12], summary["parent_run_id"])
    else:
        log.info("record: parent run %s with %d child runs in experiment %r (%s)", summary["parent_run_id"],
                 len(summary["children"]) + bool(summary.get("shadow_run_id")), params.mlflow.experiment, uri)
        for row in summary["registered"]:
            log.info("record: registered %s as %s version %s", row["variant"], params.registered_model_name(), row["version"])
        if summary["registered"]:
            log.info("record: alias 'candidate' -> version %s (%s)", summary["registered"][-1]["version"],
                     summary["registered"][-1]["variant"])
        elif not summary.get("unregistered"):
            log.info("record: no variant passed every domain: nothing registered, alias 'candidate' removed")
        for row in summary.get("unregistered") or []:
            log.warning("record: %s passed but is NOT registered: %s", row["variant"], row["reason"])
    log.info("record: `quantgate ui` opens the MLflow UI")
    return 0
