"""Stage `admit@<candidate>`: a third-party quantized checkpoint, the lm-eval sample log of a model evaluated
elsewhere (pipelines/evaluation/sample_logs.py), or a model behind an OpenAI-compatible endpoint
(pipelines/evaluation/endpoints.py) enters only after validation.

The checks live in pipelines/checkpoints/ (one file per concern); a rejection is recorded as that
candidate's failure in its manifest, and the stage still succeeds so the other variants go on.
"""

from __future__ import annotations

import logging

from pipelines.checkpoints.admission import admit
from pipelines.checkpoints.manifest import record_failure
from pipelines.core.errors import QuantgateError
from pipelines.core.params import load_params
from pipelines.core.paths import REFERENCE_DIR, VARIANTS_DIR
from pipelines.evaluation import endpoints, sample_logs
from pipelines.models.loading import resolve_model

log = logging.getLogger(__name__)


def main(candidate: str, failed_because: str | None = None) -> int:
    params = load_params()
    if candidate not in params.candidates:
        params.model_under_test(candidate)
        raise QuantgateError(f"{candidate!r} is a variant: use `quantgate quantize {candidate}`")
    source = resolve_model(params.model)
    path = params.candidates[candidate].path
    if failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        record_failure(candidate, path, source.location, failed_because)
        log.warning("admit %s: recorded as FAILED (%s)", candidate, failed_because)
        return 0
    if params.candidates[candidate].source == endpoints.SOURCE:  # served elsewhere: checked, then evaluated there
        manifest = endpoints.admit(candidate, path, params.candidates[candidate].endpoint.model_dump(), VARIANTS_DIR,
                                   REFERENCE_DIR)
        if manifest["status"] == "ok":
            log.info("admit %s: endpoint %s serves %s (prompt logprobs: %s)", candidate, manifest["endpoint"]["base_url"],
                     manifest["endpoint"]["model"], "yes" if manifest["evidence"]["logprobs"] else "no")
        else:
            log.warning("admit %s: REJECTED: %s", candidate, manifest["reasons"][0])
        return 0
    if params.candidates[candidate].source == sample_logs.SOURCE:  # evaluated elsewhere: its lm-eval sample log
        manifest = sample_logs.admit(candidate, path, VARIANTS_DIR)
        if manifest["status"] == "ok":
            log.info("admit %s: lm-eval sample log of %s (%s) validated -> models/variants/%s/%s", candidate,
                     manifest["evidence"]["backend"], ", ".join(manifest["evidence"]["tasks"]), candidate,
                     sample_logs.LOG_DIR)
        else:
            log.warning("admit %s: REJECTED: %s", candidate, manifest["reasons"][0])
        return 0
    manifest = admit(candidate, path, source.location)
    if manifest["status"] == "ok":
        log.info("admit %s: %s checkpoint validated (%d tensors) -> models/variants/%s", candidate,
                 manifest["method"], manifest["validation"]["tensors"], candidate)
    else:
        log.warning("admit %s: REJECTED:\n  %s", candidate, "\n  ".join(manifest["validation"]["reasons"]))
    return 0
