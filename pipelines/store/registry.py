"""The model registry: a version names the bytes that were gated, not a workspace folder the next `dvc repro`
overwrites.

A passing variant's checkpoint files (exactly those its manifest lists, plus the manifest) are logged to its
child run under `checkpoint/`, the version's source is `runs:/<run>/checkpoint`, and the version is tagged with
one sha256 over the per-file hashes (kept beside it in `checkpoint.json`). `fetch_checkpoint` and the promotion
re-check those hashes against the stored bytes; `candidate` names the newest version of the current results.
"""

from __future__ import annotations

import hashlib
import posixpath
import shutil
import tempfile
from pathlib import Path

import mlflow
from mlflow import MlflowClient

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, sha256_file
from pipelines.core.paths import FETCHED_DIR, MANIFEST, MODELS_DIR
from pipelines.store.client import ensure_registered_model, using_store

DIGEST_TAG = "quantgate.results_digest"  # sha256 of every dvc.lock entry but record's (lineage.results_digest)
CANDIDATE_ALIAS = "candidate"
PRODUCTION_ALIAS = "production"
CHECKPOINT_PATH = "checkpoint"  # artifact folder of a passing variant's child run: the gated files
CHECKPOINT_HASHES = "checkpoint.json"  # beside it: {"sha256": digest, "files": {name: sha256}}
CHECKPOINT_TAG = "checkpoint.sha256"  # on the child run and the model version: checkpoint_digest(files)


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


def delete_versions(client: MlflowClient, model_name: str, digest: str) -> None:
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
    from mlflow.utils.file_utils import local_file_uri_to_path
    from mlflow.utils.uri import is_local_uri

    files = _stored_hashes(client, version)
    label = f"{version.name} version {version.version}: checkpoint {version.source}"
    underlying = RunsArtifactRepository.get_underlying_uri(version.source)
    if is_local_uri(underlying):
        _check_folder(Path(local_file_uri_to_path(underlying)), files, label)
    else:  # beside the checkpoints (the disk sized for them), not the system's /tmp: a 70B model is 35-140 GB
        MODELS_DIR.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=MODELS_DIR, prefix=".verify-") as tmp:
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
        dest = Path(dest or FETCHED_DIR / f"{model_name}-v{version.version}")
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

