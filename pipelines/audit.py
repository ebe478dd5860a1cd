"""`quantgate audit`: re-measure a fresh random sample of the recorded evidence through each checkpoint.

Exit 0: every recorded summary is what its records give and every sampled record is what its checkpoint gives
again, within the tolerance (params `audit:`). Exit 2: something disagrees (named: variant, request type, items),
the workspace is not what dvc.lock records (so the checkpoint is not the one DVC recorded), or the audit could not
finish. The seed comes from os.urandom unless `--seed` repeats a run; it is printed and kept in results/audit.json.
The work is in pipelines/evaluation/remeasure.py, which `quantgate gate --audit` runs too.
"""

from __future__ import annotations


def main(variant: list[str] | None = None, seed: int | None = None) -> int:
    """`quantgate audit [--variant NAME] [--seed N]`: exit 0 when the records hold, 2 naming what does not."""
    import logging
    import os

    from pipelines.core.errors import QuantgateError
    from pipelines.core.io import write_json
    from pipelines.core.lineage import workspace_changes
    from pipelines.core.params import load_params
    from pipelines.core.paths import AUDIT_RESULT, BASELINE
    from pipelines.evaluation.remeasure import audit, describe
    from pipelines.models.gguf import stale_model
    from pipelines.models.loading import resolve_device

    params = load_params()
    names = [BASELINE, *[n for n in params.variants if n != BASELINE], *params.candidates]
    unknown = [n for n in variant or [] if n not in names]
    if unknown:
        raise QuantgateError(f"--variant {unknown[0]!r} is neither a variant nor a candidate in params.yaml")
    names = [n for n in names if not variant or n in variant or n == BASELINE]  # fp16's records are evidence too
    seed = int.from_bytes(os.urandom(8), "big") if seed is None else seed
    print(f"quantgate audit: seed {seed} (repeat this sample with --seed {seed})", flush=True)
    if changes := workspace_changes() + stale_model():  # the checkpoints and records must be the ones dvc.lock records
        result = {"seed": seed, "verdict": "refused", "problems": [], "changes": changes}
        write_json(AUDIT_RESULT, result)
        print("quantgate audit: REFUSED (exit 2): the workspace differs from dvc.lock, so what would be audited is not "
              "what DVC recorded; run dvc repro:\n" + "\n".join(f"  {c}" for c in changes[:12]))
        return 2
    try:
        result = audit(params, names, seed, resolve_device(params.device))  # its child shows the progress
    except Exception as err:  # noqa: BLE001 - fail closed: an audit that could not finish vouches for nothing
        logging.getLogger("pipelines").debug("audit error", exc_info=True)
        result = {"seed": seed, "verdict": "refused", "problems": [],
                  "error": f"the audit could not finish: {type(err).__name__}: {err}"}
    write_json(AUDIT_RESULT, result)
    lines = [f"quantgate audit: {'OK (exit 0)' if result['verdict'] == 'ok' else 'REFUSED (exit 2)'}, seed {seed}"]
    if result.get("error"):
        lines.append(f"  - {result['error']}")
    lines += [f"  - {describe(problem)}" for problem in result["problems"][:12]]
    lines += [f"  - {name}: not audited: {why}" for name, why in (result.get("skipped") or {}).items()]
    if len(result["problems"]) > 12:
        lines.append(f"  ... {len(result['problems']) - 12} more in {AUDIT_RESULT}")
    if "largest_difference" in result:
        n = result["largest_difference"]
        lines.append(f"  re-measured {n['items']} items and {n['texts']} texts in {sum(result['seconds'].values()):.1f} s;"
                     f" largest log-prob difference {n['logprob']:.3g}, KL {n['kl']:.3g}")
    lines.append(f"  {AUDIT_RESULT}")
    print("\n".join(lines), flush=True)
    return 0 if result["verdict"] == "ok" else 2
