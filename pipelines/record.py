"""Stage `record`: one pipeline run into MLflow, and every passing variant into the model registry.

One parent run per pipeline result (keyed by the digest of every dvc.lock entry but record's own, so a
changed policy or any changed result is a new parent run), one
child run per variant and candidate with settings as params, every number as a metric under readable
names (`math/accuracy`, `memory/footprint_bytes`), verdicts as tags, manifests and per-item records as
artifacts. Recording the same digest twice finds the first run and writes nothing: DVC may restore
stages from its run-cache without running them, so idempotence is by content, not by execution.

A registered version names the bytes that were gated, not a workspace folder the next `dvc repro`
overwrites: the passing variant's checkpoint files (exactly those its manifest lists, plus the manifest)
are logged to its child run under `checkpoint/`, the version's source is `runs:/<run>/checkpoint`, and
the version is tagged with one sha256 over the per-file hashes (kept beside it in `checkpoint.json`).
`fetch_checkpoint` and the promotion re-check those hashes against the stored bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pandas as pd
from mlflow import MlflowClient

from pipelines.judging.comparison import flat_rows
from pipelines.judging.verdict import usable
from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, read_jsonl, sha256_file
from pipelines.core.params import DERIVED_FROM_REQUESTS, Params
from pipelines.models.loading import weights_sha256
from pipelines.core.paths import BASELINE, MANIFEST

KIND_TAG = "quantgate.kind"
DIGEST_TAG = "quantgate.results_digest"  # sha256 of every dvc.lock entry but record's (lineage.results_digest)
CANDIDATE_ALIAS = "candidate"
COMPLETE_TAG = "quantgate.complete"  # set on the parent run once every child is logged and every version registered
PRODUCTION_ALIAS = "production"
FORMAT_TAG = "quantgate.record_format"  # on the parent run; a finished recording in an older format is recorded again
RECORD_FORMAT = "3"  # 3: child runs named by their verdicts, per-type numbers on the parent, the saved view;
                    # 2: passing checkpoints stored as artifacts (1 registered the workspace folder by path)
CHECKPOINT_PATH = "checkpoint"  # artifact folder of a passing variant's child run: the gated files
CHECKPOINT_HASHES = "checkpoint.json"  # beside it: {"sha256": digest, "files": {name: sha256}}
CHECKPOINT_TAG = "checkpoint.sha256"  # on the child run and the model version: checkpoint_digest(files)
RECORDING_LOCK = "quantgate-recording-"  # + the digest's first 16 hex: a registered model that exists while one `record` runs
LOCK_BEAT_S, LOCK_STALE_S, LOCK_POLL_S = 30.0, 300.0, 2.0  # holder's heartbeat; a lock not beaten that long is a dead holder's
# MLflow 3.17's runs table shows a first-time visitor Run Name, Created, Dataset, Duration, Source and Models, never a
# metric, param or tag column, and reads no column setting from the server (docs/record-gate.md, "What the MLflow UI
# shows"). So a child run's name carries its verdict per request type, its children are tagged as evaluation runs
# (the one thing MLflow's first visit acts on: it expands the parents of evaluation runs), and the experiment gets a
# saved view (MLflow's own "Views" menu) whose columns are each request type's verdict and the numbers deciding it.
RUN_TYPE_TAG, RUN_TYPE_EVALUATION = "mlflow.runType", "evaluation"
VIEW_ID = "quantgate-verdicts"
VIEW_TAG = "mlflow.sharedViewState." + VIEW_ID  # MLflow 3.17's saved views: experiment tags with this prefix
VIEW_NAME = "quantgate: verdicts per request type"
VIEW_MARK = "quantgate"  # in the view's envelope: {"domains": {domain: KL percentile}, "sha256": of the state we wrote}
VIEW_STATISTICS = ("ci_low", "difference", "flip_rate")  # + kl/<policy percentile>: each domain's deciding numbers
PARENT_STATISTICS = ("accuracy", "accuracy_fp16", "difference", "ci_low", "ci_high", "flip_rate", "items")
VERDICT_ORDER = ("fail", "inconclusive", "pass")  # in a run's name: what blocks a release first


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


def experiment_id(client: MlflowClient, name: str, artifact_root: Path | None) -> str:
    """The experiment, created once up front with artifacts beside the store (not in the cwd's ./mlruns);
    artifact_root None: where the tracking server puts them (its --artifacts-destination)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:  # the kind tag opens the experiment on MLflow 3's "Training runs" page instead of its GenAI overview
        return client.create_experiment(name, artifact_location=artifact_root.resolve().as_uri() if artifact_root else None,
                                        tags={"mlflow.experimentKind": "custom_model_development"})
    except Exception:
        # another pipeline recording into the same server made it between the lookup and here: use theirs
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def ensure_registered_model(client: MlflowClient, model_name: str) -> None:
    """The registered model, made once; a concurrent recording that made it first is no error."""
    if client.search_registered_models(f"name = '{model_name}'"):
        return
    try:
        client.create_registered_model(model_name, description="quantgate: quantized variants that passed the gate")
    except Exception:
        if not client.search_registered_models(f"name = '{model_name}'"):
            raise


@contextlib.contextmanager
def recording_lock(client: MlflowClient, digest: str) -> Iterator[str]:
    """One `record` of these results at a time, across every machine that shares the store.

    Two recordings of the same results at once would each find no finished run and both write one (or the
    second would take the first's unfinished run for a crashed one and delete it). The store's unique
    registered-model names make the lock: whoever creates `quantgate-recording-<digest>` holds it, the
    others wait; the holder beats a heartbeat tag and deletes it at the end. A lock whose heartbeat is older
    than LOCK_STALE_S belongs to a process that died (killed mid-upload) and is taken over; so, at once, does
    one whose holder ran on this machine and is gone.
    """
    from mlflow.exceptions import MlflowException

    name = RECORDING_LOCK + digest[:16]
    holder = f"{socket.gethostname()}:{os.getpid()}"
    while True:
        try:
            client.create_registered_model(name, tags={"heartbeat": str(time.time()), "holder": holder},
                                           description="quantgate: a `record` of these results is running (removed when it ends)")
            break
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            held = client.get_registered_model(name)
        except MlflowException:
            continue  # released in between: try again
        try:
            beat = float(held.tags.get("heartbeat", "0"))
        except ValueError:
            beat = 0.0
        if time.time() - beat > LOCK_STALE_S or _dead_here(held.tags.get("holder", "")):
            with contextlib.suppress(MlflowException):
                client.delete_registered_model(name)  # its holder stopped beating: it died
            continue
        time.sleep(LOCK_POLL_S)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(LOCK_BEAT_S):
            with contextlib.suppress(Exception):
                client.set_registered_model_tag(name, "heartbeat", str(time.time()))

    beating = threading.Thread(target=heartbeat, name="quantgate-record-lock", daemon=True)
    beating.start()
    try:
        yield name
    finally:
        stop.set()
        beating.join()
        with contextlib.suppress(Exception):  # a store gone away: the lock goes stale and is taken over
            client.delete_registered_model(name)


def _dead_here(holder: str) -> bool:
    """The lock's holder ran on this machine and its process is gone (killed): no need to wait for staleness."""
    import psutil

    host, _, pid = holder.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid))


def served(tracking_uri: str) -> bool:
    """A tracking server: it, not this machine's folders, decides where artifacts go, so that a registered
    checkpoint is reachable from every machine that reaches the server."""
    return tracking_uri.split(":", 1)[0] in ("http", "https", "databricks")


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


def child_run_name(name: str, row: dict | None) -> str:
    """A child run's name: the variant, then its request types grouped by verdict, failing ones first
    (`gptq3 · fail: code_comment · pass: math, code, chat`). The run name is the only text of a run that MLflow's
    runs table shows without the user choosing columns; the tag `quantgate.variant` keeps the bare name."""
    if name == BASELINE or not row:
        return f"{name} · baseline"
    groups: dict[str, list[str]] = {}
    for domain, d in (row.get("domains") or {}).items():
        groups.setdefault(str(d.get("verdict")), []).append(domain)
    order = [v for v in VERDICT_ORDER if v in groups] + sorted(set(groups) - set(VERDICT_ORDER))
    parts = [f"{verdict}: {', '.join(groups[verdict])}" for verdict in order] or [str(row.get("verdict"))]
    return " · ".join([name, *parts])[:250]


def _points(value) -> str:
    return f"{100 * value:+.1f}" if usable(value) else "n/a"


def child_description(name: str, row: dict | None) -> str:
    """The child run's description (Markdown, shown at the top of its run page): per request type the verdict
    and the numbers that decided it, and the reasons for anything but pass."""
    if name == BASELINE or not row:
        return f"**{name}**: the baseline every variant is compared with, item by item."
    lines = [f"**{name}: {row.get('verdict')}** against fp16, per request type (accuracy points):", "",
             "| request type | verdict | difference | interval | flip rate | KL |", "|---|---|---|---|---|---|"]
    reasons = []
    for domain, d in (row.get("domains") or {}).items():
        paired, checks = d.get("paired") or {}, d.get("checks") or {}
        kl, flips = checks.get("kl") or {}, paired.get("flip_rate")
        kl_text = f"{kl.get('percentile', '')} {kl['value']:.3g}".strip() if usable(kl.get("value")) else "n/a"
        lines.append(f"| {domain} | {d.get('verdict')} | {_points(paired.get('difference'))} | "
                     f"[{_points(paired.get('ci_low'))}, {_points(paired.get('ci_high'))}] | "
                     f"{f'{flips:.3f}' if usable(flips) else 'n/a'} | {kl_text} |")
        if d.get("verdict") != "pass" and d.get("reasons"):
            reasons.append(f"- {domain}: " + "; ".join(d["reasons"]))
    return "\n".join(lines + ([""] + reasons if reasons else []))[:4000]


def parent_metrics(report: dict) -> dict[str, float]:
    """Per request type and variant the paired numbers as `<domain>/<variant>/<statistic>` on the parent run (and
    fp16's accuracy as `<domain>/fp16/accuracy`), so MLflow's comparison of two pipeline runs (two experiments: the
    default calibration set and one without code comments) shows `code_comment/gptq3/difference` side by side."""
    out: dict[str, float] = {}
    fp16 = (report.get("fp16") or {}).get("accuracy") or {}
    for domain in report["domains"]:
        numeric_leaves(f"{domain}/{BASELINE}", {"accuracy": fp16.get(domain)}, out)
    for name, v in report["variants"].items():
        for domain, d in (v.get("domains") or {}).items():
            paired = d.get("paired") or {}
            numeric_leaves(f"{domain}/{name}", {k: paired.get(k) for k in PARENT_STATISTICS}, out)
    return out


def parent_verdict_tags(report: dict) -> dict[str, str]:
    """`verdict.<variant>` and `verdict.<variant>.<domain>` on the parent run."""
    tags = {}
    for name, v in report["variants"].items():
        tags[f"verdict.{name}"] = str(v.get("verdict"))
        tags.update({f"verdict.{name}.{domain}": str(d.get("verdict")) for domain, d in (v.get("domains") or {}).items()})
    return tags


def kl_percentiles(report: dict) -> dict[str, str]:
    """Each domain's policy KL percentile (`p99`), as compare.json's checks name it."""
    found = {}
    for domain in report["domains"]:
        for v in report["variants"].values():
            pct = ((((v.get("domains") or {}).get(domain) or {}).get("checks") or {}).get("kl") or {}).get("percentile")
            if pct:
                found[domain] = str(pct)
                break
        found.setdefault(domain, "p99")
    return found


def _column(kind: str, key: str) -> str:
    """MLflow's runs-table column id (makeCanonicalSortKey): metrics.`code/ci_low`, tags.`verdict.code`."""
    return f"{kind}.`{key}`"


RUN_NAME_COLUMN = _column("attributes", "Run Name")


def verdict_view_state(domains: dict[str, str]) -> dict:
    """The saved view's state: first every request type's verdict (tag `verdict.<type>`), then the numbers that
    decide it, one statistic at a time across the types: the interval's low end (pass needs it at or above
    -margin), the difference, the flip rate, the policy's KL percentile; then the memory growth excess. At 1600
    pixels the verdicts and the low ends are on screen together. No Dataset, Source or Models column."""
    columns = [_column("tags", f"verdict.{domain}") for domain in domains]
    for statistic in VIEW_STATISTICS:
        columns += [_column("metrics", f"{domain}/{statistic}") for domain in domains]
    columns += [_column("metrics", f"{domain}/kl/{pct}") for domain, pct in domains.items()]
    columns.append(_column("metrics", "memory/growth_excess_pct"))
    widths = {c: 90 if c.startswith("tags.") else 100 for c in columns}
    return {"selectedColumns": columns, "columnOrder": [RUN_NAME_COLUMN, *columns],
            "columnWidths": {RUN_NAME_COLUMN: 300, **widths}}


def write_verdict_view(client: MlflowClient, exp_id: str, report: dict) -> str:
    """Create or update the experiment's saved view `quantgate-verdicts`; returns the UI path that opens it.

    Request types recorded earlier stay in it (two pipelines with different request types share the experiment).
    A view someone changed in the UI ("Override saved view") is theirs: its state no longer hashes to our mark, and
    it is left alone.
    """
    path = f"#/experiments/{exp_id}/runs?viewStateShareKey={VIEW_ID}"
    before = client.get_experiment(exp_id).tags.get(VIEW_TAG)
    domains: dict[str, str] = {}
    envelope: dict = {}
    if before:
        try:
            envelope = json.loads(before)
            mark = envelope[VIEW_MARK]
            if mark["sha256"] != hashlib.sha256(envelope["state"].encode()).hexdigest():
                return path  # changed in the UI since we wrote it
            domains = dict(mark["domains"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return path  # not ours
    domains.update(kl_percentiles(report))  # today's policy percentile; new request types at the end
    state = json.dumps(verdict_view_state(domains), separators=(",", ":"))
    if envelope.get("state") == state:
        return path
    now = int(time.time() * 1000)
    envelope = {"name": VIEW_NAME, "createdAt": envelope.get("createdAt") or now, "updatedAt": now, "state": state,
                VIEW_MARK: {"domains": domains, "sha256": hashlib.sha256(state.encode()).hexdigest()}}
    client.set_experiment_tag(exp_id, VIEW_TAG, json.dumps(envelope, separators=(",", ":")))
    return path


def checkpoint_sha256(manifest: dict | None) -> str:
    """The weight files' sha256 as one tag value (`model.safetensors:<sha>`)."""
    return ",".join(f"{k}:{v}" for k, v in sorted(weights_sha256(manifest).items())) or "none"


def checkpoint_digest(files: dict[str, str]) -> str:
    """One sha256 for a checkpoint: that of its `sha256sum` listing (`<sha256>  <name>` lines sorted by name),
    so `(cd DIR && LC_ALL=C sha256sum $(find . -type f -printf '%P\\n' | LC_ALL=C sort)) | sha256sum` gives it too."""
    return hashlib.sha256("".join(f"{sha}  {name}\n" for name, sha in sorted(files.items())).encode()).hexdigest()


def _checked_name(name: str, where: str) -> str:
    """A file name from a manifest or the store that stays inside the checkpoint folder."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise QuantgateError(f"{where}: file name {name!r} does not stay inside the checkpoint folder")
    return name


def checkpoint_files(folder: Path) -> dict[str, str]:
    """The files a passing variant is registered with and their sha256: those its manifest lists (what the
    gated stages loaded), each checked against the workspace, plus the manifest itself."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise QuantgateError(f"{manifest_path}: no manifest")
    listed = read_json(manifest_path).get("files") or {}
    if not listed:
        raise QuantgateError(f"{manifest_path}: lists no checkpoint files")
    files = {}
    for name, expected in sorted(listed.items()):
        path = folder / _checked_name(name, str(manifest_path))
        if not path.is_file():
            raise QuantgateError(f"{path}: listed in {manifest_path} but missing")
        files[name] = sha256_file(path)
        if files[name] != expected:
            raise QuantgateError(f"{path}: sha256 {files[name]} differs from {expected} in {manifest_path}: "
                                 "the workspace is not what was gated (dvc repro)")
    files[MANIFEST] = sha256_file(manifest_path)
    return files


def listed_digest(folder: Path) -> str | None:
    """The checkpoint digest the manifest in `folder` implies (its listed hashes plus the manifest's own), with
    no re-hash of the weights: where DVC vouches for the folder (the gate), this is what was gated."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None
    listed = read_json(manifest_path).get("files") or {}
    return checkpoint_digest({**listed, MANIFEST: sha256_file(manifest_path)}) if listed else None


def log_checkpoint(folder: Path) -> dict:
    """Upload a passing variant's checkpoint files to the active run (`checkpoint/`) with their hashes."""
    files = checkpoint_files(folder)
    for name in files:
        mlflow.log_artifact(str(folder / name), posixpath.join(CHECKPOINT_PATH, posixpath.dirname(name)).rstrip("/"))
    digest = checkpoint_digest(files)
    mlflow.log_dict({"sha256": digest, "files": files}, CHECKPOINT_HASHES)
    mlflow.set_tag(CHECKPOINT_TAG, digest)
    return {"sha256": digest, "files": len(files), "bytes": sum((folder / n).stat().st_size for n in files)}


def _dataset_inputs(paths: list[tuple[str, Path]], context: str) -> None:
    """JSONL files as MLflow dataset inputs of the active run, named and tagged with their sha256."""
    from pipelines.core.io import sha256_file

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


def classifier_metrics(measured: dict) -> dict[str, float]:
    """The request classifier's accuracy on the labelled production sample (results/calibration/classifier.json)
    as parent-run metrics: `classifier_accuracy` and `classifier_accuracy.<type>` (none where nothing is labelled)."""
    metrics = {f"classifier_accuracy.{t}": v["accuracy"] for t, v in (measured.get("types") or {}).items()
               if v.get("accuracy") is not None}
    if measured.get("accuracy") is not None:
        metrics["classifier_accuracy"] = measured["accuracy"]
    return metrics


def record_pipeline(params: Params, tracking_uri: str, digest: str, commit: dict, root: Path = Path("."),
                    artifact_root: Path | None = None) -> dict:
    """Record compare/route/memory/eval results under one parent run; register passing variants."""
    with using_store(tracking_uri) as client:
        return _record(client, params, digest, commit, root,
                       None if served(tracking_uri) else artifact_root or root / "mlartifacts")


def _record(client: MlflowClient, params: Params, digest: str, commit: dict, root: Path,
            artifact_root: Path | None) -> dict:
    results = root / "results"
    report = read_json(results / "compare.json")
    table = read_json(results / "routing_table.json")
    exp_id = experiment_id(client, params.mlflow.experiment, artifact_root)
    with recording_lock(client, digest):
        summary = _record_locked(client, params, digest, commit, root, exp_id, report, table)
    return {**summary, "view": write_verdict_view(client, exp_id, report)}


def _record_locked(client: MlflowClient, params: Params, digest: str, commit: dict, root: Path, exp_id: str,
                   report: dict, table: dict) -> dict:
    results = root / "results"
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
    _delete_versions(client, params.registered_model_name(), digest)  # registered by a recording that crashed

    names = [BASELINE, *report["variants"]]
    children = {}
    with mlflow.start_run(experiment_id=exp_id, run_name=f"pipeline {digest[:8]}",
                          tags={KIND_TAG: "pipeline", DIGEST_TAG: digest, FORMAT_TAG: RECORD_FORMAT,
                                "git.commit": str(commit.get("commit")),
                                "git.dirty": str(commit.get("dirty")), "model": params.model,
                                **parent_verdict_tags(report)}) as parent:
        mlflow.log_params(flatten("", params.model_dump(mode="json", exclude=DERIVED_FROM_REQUESTS), {}))
        mlflow.log_metrics(parent_metrics(report))
        mlflow.log_table(pd.DataFrame(flat_rows(report)), "tables/compare.json")
        mlflow.log_table(pd.DataFrame(routing_rows(table)), "tables/routing_table.json")
        built = root / "calibration_sets/built"
        _dataset_inputs([(f"calibration-{d}", built / f"{d}.jsonl") for d in params.calibration.domains], "calibration")
        _dataset_inputs([(f"probes-{d}", root / "eval" / d / "items.jsonl") for d in report["domains"]], "evaluation")
        _log_files([results / "compare.json", results / "compare.csv", results / "routing_table.json",
                    results / "routing_table.yaml", results / "memory_summary.json",
                    results / "calibration/coverage.json", results / "calibration/classifier.json",
                    root / "dvc.lock", root / "params.yaml"], "results")
        _log_files(sorted((results / "plots").glob("*.png")), "plots")
        _log_files([results / "calibration/coverage.png", results / "calibration/classifier_confusion.png"], "plots")
        if (results / "calibration/classifier.json").is_file():
            mlflow.log_metrics(classifier_metrics(read_json(results / "calibration/classifier.json")))
        checkpoints = {}
        for name in names:
            children[name], checkpoints[name] = _record_child(name, report, params, root, digest, exp_id)
    registered = register_passing(client, params.registered_model_name(), report, children, checkpoints, digest)
    client.set_tag(parent.info.run_id, COMPLETE_TAG, "true")
    return {"status": "recorded", "parent_run_id": parent.info.run_id, "experiment_id": exp_id,
            "children": children, "registered": registered,
            "unregistered": [{"variant": n, "reason": c["refused"]} for n, c in checkpoints.items() if c and "refused" in c]}


def _record_child(name: str, report: dict, params: Params, root: Path, digest: str,
                  exp_id: str) -> tuple[str, dict | None]:
    """One child run: params, metrics, verdict tags and artifacts of one variant (or of fp16); a variant that
    passed every domain also gets its checkpoint stored (returned: its digest, or why it was refused)."""
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
            "checkpoint_sha256": checkpoint_sha256(manifest), RUN_TYPE_TAG: RUN_TYPE_EVALUATION,
            "mlflow.note.content": child_description(name, row)}
    for domain, d in ((row or {}).get("domains") or {}).items():
        tags[f"verdict.{domain}"] = d["verdict"]
        if d["verdict"] != "pass":
            tags[f"reasons.{domain}"] = "; ".join(d["reasons"])[:4000]
    settings = params.variants[name].model_dump(mode="json") if name in params.variants else \
        params.candidates[name].model_dump(mode="json") if name in params.candidates else None
    with mlflow.start_run(experiment_id=exp_id, run_name=child_run_name(name, row), nested=True, tags=tags) as child:
        mlflow.log_params(child_params(manifest, settings))
        mlflow.log_metrics(child_metrics(name, report, evaluation, manifest, memory, timing))
        _log_files([manifest_path, eval_path, root / "results/memory" / f"{name}.json"], "results")
        _log_files([root / "results/eval" / name / "items.jsonl"], "eval")
        _log_files(sorted((root / "results/plots").glob("*.png")), "plots")  # where this variant stands among the rest
        if (manifest or {}).get("calibration"):
            _dataset_inputs([("calibration-mixed", root / "calibration_sets/built/mixed.jsonl")], "calibration")
        checkpoint = None
        if name != BASELINE and row["verdict"] == "pass":
            try:
                checkpoint = log_checkpoint(root / "models/variants" / name)
            except QuantgateError as err:  # not registered: a version must name the bytes that were gated
                checkpoint = {"refused": str(err)}
                mlflow.set_tag("registry", f"not registered: {err}"[:4000])
        return child.info.run_id, checkpoint


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
    # search_model_versions leaves `aliases` empty: read them from the registered model
    kept = {str(v) for a, v in client.get_registered_model(model_name).aliases.items() if a != CANDIDATE_ALIAS}
    for version in client.search_model_versions(f"name = '{model_name}'"):
        if version.tags.get(DIGEST_TAG) == digest and str(version.version) not in kept:
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


def register_passing(client: MlflowClient, model_name: str, report: dict, children: dict[str, str],
                     checkpoints: dict[str, dict | None], digest: str) -> list[dict]:
    """A model version per passing variant whose checkpoint was stored (source `runs:/<child run>/checkpoint`),
    `candidate` -> the newest.

    The most expensive passing variant is registered first, so the newest, which `candidate` names, is
    the cheapest variant that passed every domain.
    """
    passing = [n for n, v in report["variants"].items()
               if v["verdict"] == "pass" and "sha256" in (checkpoints.get(n) or {})]
    if not passing:  # an older result's candidate must not stay promotable once these verdicts say otherwise
        if client.search_registered_models(f"name = '{model_name}'") and \
                CANDIDATE_ALIAS in client.get_registered_model(model_name).aliases:
            client.delete_registered_model_alias(model_name, CANDIDATE_ALIAS)
        return []
    ensure_registered_model(client, model_name)
    footprint = {n: (report["variants"][n].get("memory") or {}).get("footprint_bytes") or 0 for n in passing}
    out = []
    for name in sorted(passing, key=lambda n: -footprint[n]):
        row, stored = report["variants"][name], checkpoints[name]
        tags = {"variant": name, "verdict": row["verdict"], DIGEST_TAG: digest, CHECKPOINT_TAG: stored["sha256"],
                "checkpoint.files": str(stored["files"]), "checkpoint.bytes": str(stored["bytes"]),
                **{f"verdict.{d}": x["verdict"] for d, x in row["domains"].items()}}
        version = client.create_model_version(model_name, source=f"runs:/{children[name]}/{CHECKPOINT_PATH}",
                                              run_id=children[name], tags=tags,
                                              description=f"{name}: passed every domain against fp16")
        out.append({"variant": name, "version": str(version.version)})
    client.set_registered_model_alias(model_name, CANDIDATE_ALIAS, out[-1]["version"])
    return out


def resolve_version(client: MlflowClient, model_name: str, ref: str):
    """A version of `model_name` by number (`3`, `v3`) or alias (`production`, `candidate`)."""
    from mlflow.exceptions import MlflowException

    number = ref[1:] if ref[:1] == "v" and ref[1:].isdigit() else ref
    try:
        if number.isdigit():
            return client.get_model_version(model_name, number)
        return client.get_model_version_by_alias(model_name, ref)
    except MlflowException as err:
        raise QuantgateError(f"{model_name}: no version or alias {ref!r} in the registry "
                             f"({err.message.splitlines()[0] if err.message else type(err).__name__})") from None


def _stored_hashes(client: MlflowClient, version) -> dict[str, str]:
    """The version's per-file hashes, checked against the digest its tag holds (the registry is the anchor:
    a store whose files and checkpoint.json were both rewritten still fails here)."""
    label = f"{version.name} version {version.version}"
    digest = version.tags.get(CHECKPOINT_TAG)
    if not digest or version.source != f"runs:/{version.run_id}/{CHECKPOINT_PATH}":
        raise QuantgateError(f"{label}: registered from {version.source!r} with no stored checkpoint (no "
                             f"{CHECKPOINT_TAG} tag); record it again (`dvc repro -f -s record`)")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path=CHECKPOINT_HASHES, dst_path=tmp)
        except Exception as err:  # noqa: BLE001 - whatever the store raises, the artifact is not there
            raise QuantgateError(f"{label}: {CHECKPOINT_HASHES} is missing from run {version.run_id}'s artifacts "
                                 f"({type(err).__name__})") from None
        stored = read_json(path)
    files = stored.get("files") if isinstance(stored, dict) else None
    if not isinstance(files, dict) or not files or checkpoint_digest(files) != digest:
        raise QuantgateError(f"{label}: {CHECKPOINT_HASHES} in run {version.run_id} does not hash to the version's "
                             f"{CHECKPOINT_TAG} tag {digest}: the stored hashes were changed")
    return {_checked_name(n, f"{label}: {CHECKPOINT_HASHES}"): h for n, h in files.items()}


def _check_folder(folder: Path, files: dict[str, str], label: str) -> None:
    """Every registered file present in `folder` with its registered sha256, and nothing else."""
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()
    problems = [f"{n}: missing" for n in sorted(set(files) - found)]
    problems += [f"{n}: not a registered file" for n in sorted(found - set(files))]
    for name in sorted(set(files) & found):
        actual = sha256_file(folder / name)
        if actual != files[name]:
            problems.append(f"{name}: sha256 {actual} differs from the registered {files[name]}")
    if problems:
        raise QuantgateError(f"{label}: " + "; ".join(problems))


def verify_version(client: MlflowClient, version) -> dict:
    """Check the stored checkpoint behind a model version against its registered hashes (raises, naming the
    file). A local artifact store is read in place; any other is downloaded to a temporary folder."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository
    from mlflow.utils.uri import is_local_uri
    from mlflow.utils.file_utils import local_file_uri_to_path

    files = _stored_hashes(client, version)
    label = f"{version.name} version {version.version}: checkpoint {version.source}"
    underlying = RunsArtifactRepository.get_underlying_uri(version.source)
    if is_local_uri(underlying):
        _check_folder(Path(local_file_uri_to_path(underlying)), files, label)
    else:  # beside the checkpoints (the disk sized for them), not the system's /tmp: a 70B model is 35-140 GB
        Path("models").mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir="models", prefix=".verify-") as tmp:
            _check_folder(_download(version, Path(tmp), label), files, label)
    return {"version": str(version.version), "sha256": version.tags[CHECKPOINT_TAG], "files": len(files)}


def _download(version, into: Path, label: str) -> Path:
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(into)))
    except Exception as err:  # noqa: BLE001
        raise QuantgateError(f"{label}: could not be downloaded ({type(err).__name__}: {err})") from None


def fetch_checkpoint(tracking_uri: str, model_name: str, ref: str, dest: Path | None = None) -> dict:
    """Download the checkpoint behind `models:/<model_name>@<ref>` (or version `ref`) into `dest`, verified
    file by file against the version's hashes; on any mismatch nothing is left at `dest`."""
    with using_store(tracking_uri) as client:
        version = resolve_version(client, model_name, ref)
        files = _stored_hashes(client, version)
        label = f"{model_name} version {version.version}: checkpoint {version.source}"
        dest = Path(dest or Path("models/fetched") / f"{model_name}-v{version.version}")
        summary = {"version": str(version.version), "variant": version.tags.get("variant"), "dest": str(dest),
                   "sha256": version.tags[CHECKPOINT_TAG], "files": len(files), "aliases": list(version.aliases or [])}
        if dest.exists() and not dest.is_dir():
            raise QuantgateError(f"{dest}: exists and is not a folder")
        if dest.exists() and any(dest.iterdir()):  # never overwrite: accept it only when it is those bytes
            _check_folder(dest, files, f"{dest} already exists and is not {model_name} version {version.version}")
            return {**summary, "status": "already there"}
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
        try:
            got = _download(version, staging, label)
            _check_folder(got, files, label)
            if dest.exists():
                dest.rmdir()  # empty (checked above)
            got.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {**summary, "status": "fetched", "bytes": sum((dest / n).stat().st_size for n in files)}


def main() -> int:
    """Stage `record`: everything into MLflow (parent + child runs, tables, datasets), passing variants into the registry."""
    import logging

    from pipelines.core import logs
    from pipelines.core.io import write_json
    from pipelines.core.lineage import git_commit, results_digest
    from pipelines.core.params import load_params
    from pipelines.core.paths import MLFLOW_RUN
    from pipelines.store.tracking import artifact_root, tracking_uri

    log = logging.getLogger(__name__)
    params = load_params()
    digest = results_digest()
    if digest is None:
        raise QuantgateError("dvc.lock not found: record runs inside `dvc repro`, after the stages it records")
    uri = tracking_uri()
    with logs.library_output("mlflow"):
        summary = record_pipeline(params, uri, digest, git_commit(), artifact_root=artifact_root())
    write_json(MLFLOW_RUN, {**summary, "tracking_uri": uri, "results_digest": digest,
                            "registered_model": params.registered_model_name()})
    if summary["status"] == "already recorded":
        log.info("record: results %s already recorded as run %s: nothing written", digest[:12], summary["parent_run_id"])
    else:
        log.info("record: parent run %s with %d child runs in experiment %r (%s)", summary["parent_run_id"],
                 len(summary["children"]), params.mlflow.experiment, uri)
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
