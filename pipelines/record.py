"""Stage `record`: one pipeline run into MLflow, and every passing variant into the model registry.

One parent run per pipeline result (keyed by the digest of every dvc.lock entry but record's own, so a
changed policy or any changed result is a new parent run), one
child run per variant and candidate with settings as params, every number as a metric under readable
names (`math/accuracy`, `memory/footprint_bytes`), verdicts as tags, manifests and per-item records as
artifacts. Recording the same digest twice finds the first run and writes nothing: DVC may restore
stages from its run-cache without running them, so idempotence is by content, not by execution.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pandas as pd
from mlflow import MlflowClient

from pipelines.compare import BASELINE, flat_rows, usable
from pipelines.io import read_json, read_jsonl
from pipelines.params import Params
from pipelines.route import weights_sha256

KIND_TAG = "quantgate.kind"
DIGEST_TAG = "quantgate.results_digest"  # sha256 of every dvc.lock entry but record's (lineage.results_digest)
CANDIDATE_ALIAS = "candidate"
COMPLETE_TAG = "quantgate.complete"  # set on the parent run once every child is logged and every version registered
PRODUCTION_ALIAS = "production"


@contextlib.contextmanager
def using_store(uri: str) -> Iterator[MlflowClient]:
    """MLflow's fluent API pointed at `uri` for the block only.

    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI to every later subprocess (a `dvc repro`
    started by the same process would record into this store): put back what was there before.
    """
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield MlflowClient(uri)
    finally:
        mlflow.set_tracking_uri(before)  # None unsets the variable again


def experiment_id(client: MlflowClient, name: str, artifact_root: Path) -> str:
    """The experiment, created once up front with artifacts beside the store (not in the cwd's ./mlruns)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    # the kind tag opens the experiment on MLflow 3's "Training runs" page instead of its GenAI overview
    return client.create_experiment(name, artifact_location=artifact_root.resolve().as_uri(),
                                    tags={"mlflow.experimentKind": "custom_model_development"})


def find_recorded(client: MlflowClient, exp_id: str, digest: str) -> list:
    """Parent runs already recorded for this digest."""
    return client.search_runs([exp_id], f"tags.`{KIND_TAG}` = 'pipeline' and tags.`{DIGEST_TAG}` = '{digest}'")


def flatten(prefix: str, value, out: dict) -> dict:
    """Nested settings as dotted MLflow params (`variants.awq4.bits`)."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


def numeric_leaves(prefix: str, value, out: dict[str, float] | None = None) -> dict[str, float]:
    """Every usable number under `value` as `prefix/key/subkey`; flags as 0/1; missing or NaN left out, never 0."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for key, item in value.items():
            numeric_leaves(f"{prefix}/{key}", item, out)
    elif isinstance(value, bool):
        out[prefix] = float(value)
    elif usable(value):
        out[prefix] = float(value)
    return out


def child_metrics(name: str, report: dict, evaluation: dict | None, manifest: dict | None,
                  memory: dict | None, timing: dict | None = None) -> dict[str, float]:
    """Every number from the memory, evaluation and comparison stages, named for the MLflow UI."""
    row = report["variants"].get(name) or {}
    metrics = numeric_leaves("memory", {k: v for k, v in (memory or {}).items() if k not in ("status", "device")})
    compared = row.get("memory") or {}
    numeric_leaves("memory/vs_fp16", {"footprint_delta_bytes": compared.get("footprint_delta_bytes"),
                                      "peak_delta_by_tokens": compared.get("peak_delta_by_tokens")}, metrics)
    for domain in report["domains"]:
        probe = ((evaluation or {}).get("probes") or {}).get(domain) or {}
        numeric_leaves(domain, {"accuracy": probe.get("score"), "stderr": probe.get("stderr")}, metrics)
        numeric_leaves(domain, ((evaluation or {}).get("fidelity") or {}).get(domain), metrics)
        numeric_leaves(domain, ((row.get("domains") or {}).get(domain) or {}).get("paired"), metrics)
    numeric_leaves("quantize", {"seconds": (timing or {}).get("quantize_seconds"),
                                "weight_bytes_on_disk": ((manifest or {}).get("disk_bytes") or {}).get("weights")}, metrics)
    return metrics


def child_params(manifest: dict | None, settings: dict | None) -> dict[str, str]:
    """The variant's settings and the library versions that made it."""
    manifest = manifest or {}
    params = flatten("", {"settings": settings or manifest.get("settings") or {}}, {})
    params.update({f"library.{k}": str(v) for k, v in (manifest.get("libraries") or {}).items()})
    params["calibration_sha256"] = str((manifest.get("calibration") or {}).get("sha256"))
    params["device"] = str(manifest.get("device"))
    params["status"] = str(manifest.get("status"))
    return params


def checkpoint_sha256(manifest: dict | None) -> str:
    """The weight files' sha256 as one tag value (`model.safetensors:<sha>`)."""
    return ",".join(f"{k}:{v}" for k, v in sorted(weights_sha256(manifest).items())) or "none"


def _dataset_inputs(paths: list[tuple[str, Path]], context: str) -> None:
    """JSONL files as MLflow dataset inputs of the active run, named and tagged with their sha256."""
    from pipelines.io import sha256_file

    for name, path in paths:
        if not path.is_file():
            continue
        digest = sha256_file(path)
        frame = pd.DataFrame(read_jsonl(path))
        with warnings.catch_warnings():  # a local path matches two equivalent MLflow source types; it says so
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            dataset = mlflow.data.from_pandas(frame, source=str(path), name=name, digest=digest[:36])
        mlflow.log_input(dataset, context=context, tags={"sha256": digest, "rows": str(len(frame))})


def _log_files(files: list[Path], artifact_path: str | None = None) -> None:
    for path in files:
        if path.is_file():
            mlflow.log_artifact(str(path), artifact_path)


def record_pipeline(params: Params, tracking_uri: str, digest: str, commit: dict, root: Path = Path("."),
                    artifact_root: Path | None = None) -> dict:
    """Record compare/route/memory/eval results under one parent run; register passing variants."""
    with using_store(tracking_uri) as client:
        return _record(client, params, digest, commit, root, artifact_root)


def _record(client: MlflowClient, params: Params, digest: str, commit: dict, root: Path,
            artifact_root: Path | None) -> dict:
    results = root / "results"
    report = read_json(results / "compare.json")
    table = read_json(results / "routing_table.json")
    exp_id = experiment_id(client, params.mlflow.experiment, artifact_root or root / "mlartifacts")
    recorded = find_recorded(client, exp_id, digest)
    # complete = finished and its passing variants registered (the tag is set last)
    finished = [r for r in recorded if r.info.status == "FINISHED" and r.data.tags.get(COMPLETE_TAG) == "true"]
    if finished:  # the runs are there; the aliases must still say what these results say
        reconcile_candidate(client, params.registered_model_name(), digest)
        return {"status": "already recorded", "parent_run_id": finished[0].info.run_id, "experiment_id": exp_id,
                "registered": []}
    for run in recorded:  # a recording that crashed half-way: replace it, never keep a partial copy
        for child in client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"):
            client.delete_run(child.info.run_id)
        client.delete_run(run.info.run_id)
    _delete_versions(client, params.registered_model_name(), digest)  # registered by a recording that crashed

    names = [BASELINE, *report["variants"]]
    children = {}
    with mlflow.start_run(experiment_id=exp_id, run_name=f"pipeline {digest[:8]}",
                          tags={KIND_TAG: "pipeline", DIGEST_TAG: digest, "git.commit": str(commit.get("commit")),
                                "git.dirty": str(commit.get("dirty")), "model": params.model}) as parent:
        mlflow.log_params(flatten("", params.model_dump(mode="json"), {}))
        mlflow.log_table(pd.DataFrame(flat_rows(report)), "tables/compare.json")
        mlflow.log_table(pd.DataFrame(routing_rows(table)), "tables/routing_table.json")
        built = root / "calibration_sets/built"
        _dataset_inputs([(f"calibration-{d}", built / f"{d}.jsonl") for d in params.calibration.domains], "calibration")
        _dataset_inputs([(f"probes-{d}", root / "eval" / d / "items.jsonl") for d in report["domains"]], "evaluation")
        _log_files([results / "compare.json", results / "compare.csv", results / "routing_table.json",
                    results / "routing_table.yaml", results / "memory_summary.json",
                    results / "calibration/coverage.json", root / "dvc.lock", root / "params.yaml"], "results")
        _log_files(sorted((results / "plots").glob("*.png")), "plots")
        for name in names:
            children[name] = _record_child(name, report, params, root, digest, exp_id)
    registered = register_passing(client, params.registered_model_name(), report, children, root, digest)
    client.set_tag(parent.info.run_id, COMPLETE_TAG, "true")
    return {"status": "recorded", "parent_run_id": parent.info.run_id, "experiment_id": exp_id,
            "children": children, "registered": registered}


def _record_child(name: str, report: dict, params: Params, root: Path, digest: str, exp_id: str) -> str:
    """One child run: params, metrics, verdict tags and artifacts of one variant (or of fp16)."""
    memory_path = root / "results/memory_summary.json"
    memory = (read_json(memory_path).get("variants") or {}).get(name) if memory_path.is_file() else None
    manifest_path = root / "models/variants" / name / "quantgate.json"
    eval_path = root / "results/eval" / f"{name}.json"
    timing_path = root / "results/quantize" / f"{name}.json"
    manifest = read_json(manifest_path) if manifest_path.is_file() else None
    evaluation = read_json(eval_path) if eval_path.is_file() else None
    timing = read_json(timing_path) if timing_path.is_file() else None
    row = report["variants"].get(name)
    kind = "baseline" if name == BASELINE else row.get("kind", "variant")
    tags = {KIND_TAG: kind, DIGEST_TAG: digest, "quantgate.variant": name,
            "verdict": "baseline" if name == BASELINE else row["verdict"],
            "checkpoint_sha256": checkpoint_sha256(manifest)}
    for domain, d in ((row or {}).get("domains") or {}).items():
        tags[f"verdict.{domain}"] = d["verdict"]
        if d["verdict"] != "pass":
            tags[f"reasons.{domain}"] = "; ".join(d["reasons"])[:4000]
    settings = params.variants[name].model_dump(mode="json") if name in params.variants else \
        params.candidates[name].model_dump(mode="json") if name in params.candidates else None
    with mlflow.start_run(experiment_id=exp_id, run_name=name, nested=True, tags=tags) as child:
        mlflow.log_params(child_params(manifest, settings))
        mlflow.log_metrics(child_metrics(name, report, evaluation, manifest, memory, timing))
        _log_files([manifest_path, eval_path, root / "results/memory" / f"{name}.json"], "results")
        _log_files([root / "results/eval" / name / "items.jsonl"], "eval")
        _log_files(sorted((root / "results/plots").glob("*.png")), "plots")  # where this variant stands among the rest
        if (manifest or {}).get("calibration"):
            _dataset_inputs([("calibration-mixed", root / "calibration_sets/built/mixed.jsonl")], "calibration")
        return child.info.run_id


def routing_rows(table: dict) -> list[dict]:
    """The routing table as flat rows for an MLflow table."""
    return [{"domain": r["domain"], "max_context_tokens": r["max_context_tokens"], "serve": r["serve"],
             "fallback_under_memory_pressure": r["fallback_under_memory_pressure"], "reason": r["reason"],
             "serve_cost_bytes": r["cost_bytes"]["serve"], "fp16_cost_bytes": r["cost_bytes"]["fp16"],
             "checkpoint_sha256": json.dumps(r["provenance"]["checkpoint_sha256"]),
             "calibration_sha256": r["provenance"]["calibration_sha256"],
             "dvc_lock_sha256": r["provenance"]["dvc_lock_sha256"]} for r in table["rows"]]


def _delete_versions(client: MlflowClient, model_name: str, digest: str) -> None:
    """Model versions a half-finished recording of these results registered: they name deleted runs."""
    if not client.search_registered_models(f"name = '{model_name}'"):
        return
    for version in client.search_model_versions(f"name = '{model_name}'"):
        if version.tags.get(DIGEST_TAG) == digest and set(version.aliases or []) <= {CANDIDATE_ALIAS}:
            client.delete_model_version(model_name, version.version)  # a promoted version is never deleted


def reconcile_candidate(client: MlflowClient, model_name: str, digest: str) -> None:
    """Point `candidate` at the newest version registered from these results, or remove it when none passed.

    Results recorded before (a run restored from DVC's run-cache, or params set back to an earlier state)
    write no new versions, but the alias must not keep naming another result's variant.
    """
    if not client.search_registered_models(f"name = '{model_name}'"):
        return
    versions = [v for v in client.search_model_versions(f"name = '{model_name}'") if v.tags.get(DIGEST_TAG) == digest]
    if versions:
        client.set_registered_model_alias(model_name, CANDIDATE_ALIAS, max(versions, key=lambda v: int(v.version)).version)
    elif CANDIDATE_ALIAS in client.get_registered_model(model_name).aliases:
        client.delete_registered_model_alias(model_name, CANDIDATE_ALIAS)


def register_passing(client: MlflowClient, model_name: str, report: dict, children: dict[str, str], root: Path,
                     digest: str) -> list[dict]:
    """A model version per passing variant (its checkpoint folder by reference), `candidate` -> the newest.

    The most expensive passing variant is registered first, so the newest, which `candidate` names, is
    the cheapest variant that passed every domain.
    """
    passing = [n for n, v in report["variants"].items() if v["verdict"] == "pass"]
    if not passing:  # an older result's candidate must not stay promotable once these verdicts say otherwise
        if client.search_registered_models(f"name = '{model_name}'") and \
                CANDIDATE_ALIAS in client.get_registered_model(model_name).aliases:
            client.delete_registered_model_alias(model_name, CANDIDATE_ALIAS)
        return []
    if not client.search_registered_models(f"name = '{model_name}'"):
        client.create_registered_model(model_name, description="quantgate: quantized variants that passed the gate")
    footprint = {n: (report["variants"][n].get("memory") or {}).get("footprint_bytes") or 0 for n in passing}
    out = []
    for name in sorted(passing, key=lambda n: -footprint[n]):
        row = report["variants"][name]
        manifest = read_json(root / "models/variants" / name / "quantgate.json")
        tags = {"variant": name, "verdict": row["verdict"], DIGEST_TAG: digest,
                "checkpoint_sha256": checkpoint_sha256(manifest),
                **{f"verdict.{d}": x["verdict"] for d, x in row["domains"].items()}}
        version = client.create_model_version(model_name, source=str((root / "models/variants" / name).resolve()),
                                              run_id=children[name], tags=tags,
                                              description=f"{name}: passed every domain against fp16")
        out.append({"variant": name, "version": str(version.version)})
    client.set_registered_model_alias(model_name, CANDIDATE_ALIAS, out[-1]["version"])
    return out
