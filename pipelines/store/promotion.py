"""`quantgate gate --promote`: move the registry alias `production` to the gated `candidate` version, or say why not.

Only a version registered from the current results, whose stored bytes still hash to what was gated, and
which regresses against the current production version on no row (judging.verdict.regression_against).
"""

from __future__ import annotations

from pipelines.core.params import Params
from pipelines.judging.verdict import regression_against


def promote_candidate(tracking_uri: str, model_name: str, result: dict, params: Params, digest: str) -> dict:
    """Move `production` to the `candidate` version when it was gated here, its stored checkpoint still has
    the registered hashes, and it regresses against nothing."""
    from pipelines.store.client import using_store

    with using_store(tracking_uri) as client:
        return _promote(client, model_name, result, params, digest)


def _promote(client, model_name: str, result: dict, params: Params, digest: str) -> dict:
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipelines.core.errors import QuantgateError
    from pipelines.core.io import read_jsonl
    from pipelines.core.paths import MANIFEST, VARIANTS_DIR
    from pipelines.store.registry import (CANDIDATE_ALIAS, CHECKPOINT_TAG, DIGEST_TAG, PRODUCTION_ALIAS, listed_digest,
                                          verify_version)

    def by_alias(alias):
        try:
            return client.get_model_version_by_alias(model_name, alias)
        except MlflowException:
            return None

    def items_of(version) -> list[dict]:
        return read_jsonl(mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path="eval/items.jsonl"))

    candidate = by_alias(CANDIDATE_ALIAS)
    if candidate is None:
        return {"status": "refused", "detail": f"no version of {model_name!r} carries the alias {CANDIDATE_ALIAS!r}: run dvc repro"}
    variant = candidate.tags.get("variant")
    label = f"{model_name} version {candidate.version} ({variant})"
    if candidate.tags.get(DIGEST_TAG) != digest:
        return {"status": "refused", "detail": f"{label} was registered from other results than the current dvc.lock"}
    if variant not in result["gated"]:
        return {"status": "refused", "detail": f"{label} was not among the gated variants ({', '.join(result['gated'])})"}
    gated = listed_digest(VARIANTS_DIR / variant)  # the workspace DVC vouched for just now
    if candidate.tags.get(CHECKPOINT_TAG) != gated:
        return {"status": "refused", "version": str(candidate.version),
                "detail": f"{label}: its {CHECKPOINT_TAG} tag {candidate.tags.get(CHECKPOINT_TAG)} is not the gated "
                          f"checkpoint's {gated} (models/variants/{variant}/{MANIFEST}): the registry was changed"}
    try:  # production must name the bytes that were gated: every stored file against the version's hashes
        verify_version(client, candidate)
    except QuantgateError as err:
        return {"status": "refused", "version": str(candidate.version),
                "detail": f"{label}: its stored checkpoint is not the one gated: {err}"}
    production = by_alias(PRODUCTION_ALIAS)
    if production is not None and production.version == candidate.version:
        return {"status": "unchanged", "detail": f"{label} is already {PRODUCTION_ALIAS}", "version": str(candidate.version)}
    if production is not None:
        reasons = regression_against(items_of(candidate), items_of(production), params)
        if reasons:
            return {"status": "refused", "version": str(candidate.version),
                    "detail": f"{label} regresses against {PRODUCTION_ALIAS} version {production.version} "
                              f"({production.tags.get('variant')}): " + "; ".join(reasons)}
    client.set_registered_model_alias(model_name, PRODUCTION_ALIAS, candidate.version)
    before = f"replaces version {production.version}" if production is not None else "first production version"
    return {"status": "promoted", "version": str(candidate.version), "detail": f"{label} is now {PRODUCTION_ALIAS} ({before})"}
