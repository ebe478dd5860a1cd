"""Has the model behind an endpoint changed since it was evaluated? DVC hashes a served model's deployment spec (its
`path`), not the server: a redeploy of other weights behind the same URL and model name leaves every stage up to date
while the evidence no longer describes what is served. Each served model's fingerprint (`fingerprint`) is recorded
when it is evaluated (a candidate's admit manifest, fp16's baseline result), and the gate asks its server again
(`stale_endpoints`): another answer, or no answer, is "could not decide" until it is evaluated again.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.evaluation.endpoints import LOGPROB_TOLERANCE, PROBES, SOURCE, call

CARD_FIELDS = ("id", "root", "parent", "owned_by", "max_model_len", "meta")  # /models fields that stay put (vLLM's
# `created` and `permission` ids change with every request); llama.cpp's `meta` holds the weights' size and parameters
FINGERPRINT_TOKENS = 16
# nats: a generated token's logprob read again from the same weights (measured 0.0 on llama.cpp, asked twice); the same
# test model re-quantized to llama.cpp's Q8_0 moves them by 0.003-0.004, and to F16 by 0.00015 (docs/evaluate.md)
DRIFT_TOLERANCE = LOGPROB_TOLERANCE
ASKS = 2  # a mismatch is asked once more before it is called a redeploy: a transient tie on a busy server


def fingerprint(endpoint: dict) -> dict:
    """What identifies the model behind an endpoint from outside: its /models entry (the fields that stay put), the
    engine's /version where it has one (vLLM), and its greedy continuation of each probe prompt with each generated
    token's logprob (None from a server that gives none). Recorded when it is evaluated and asked again after, and by
    the gate (`redeployed`)."""
    listing = call(endpoint, "GET", "models")
    entry = next((m for m in (listing.get("data") if isinstance(listing, dict) else None) or []
                  if isinstance(m, dict) and m.get("id") == endpoint["model"]), None)
    if entry is None:
        raise QuantgateError(f"{endpoint['base_url']}/models no longer lists {endpoint['model']!r}")
    try:
        version = call({**endpoint, "base_url": endpoint["base_url"].removesuffix("/v1")}, "GET", "version")
    except QuantgateError:  # llama.cpp's and llama-cpp-python's servers have none
        version = None
    greedy = []
    for prompt in PROBES:
        body = {**endpoint.get("request_fields", {}), "model": endpoint["model"], "prompt": prompt, "temperature": 0,
                "max_tokens": FINGERPRINT_TOKENS, "seed": 0, "logprobs": 1}
        try:
            choice = call(endpoint, "POST", "completions", body)["choices"][0]
            greedy.append({"text": str(choice["text"]),
                           "logprobs": (choice.get("logprobs") or {}).get("token_logprobs")})
        except (KeyError, IndexError, TypeError, AttributeError):
            raise QuantgateError(f"{endpoint['base_url']}/completions: no choices[0].text") from None
    return {"card": {k: entry[k] for k in CARD_FIELDS if k in entry}, "version": version, "greedy": greedy}


def differences(recorded: dict, now: dict) -> list[str]:
    """What differs between two fingerprints of one endpoint: the /models entry, the engine version, a greedy answer,
    or a generated token's logprob by more than DRIFT_TOLERANCE (where both have them)."""
    what = [f"{key} {recorded.get(key)} -> {now.get(key)}" for key in ("card", "version")
            if recorded.get(key) != now.get(key)]
    for prompt, before, after in zip(PROBES, recorded.get("greedy") or [], now["greedy"]):
        if not isinstance(before, dict) or before.get("text") != after["text"]:
            what.append(f"greedy answer to {prompt!r}: {(before or {}).get('text')!r} -> {after['text']!r}")
        elif before.get("logprobs") and after["logprobs"]:
            drift = max((abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"])
                         if a is not None and b is not None), default=0.0)
            if drift > DRIFT_TOLERANCE or len(before["logprobs"]) != len(after["logprobs"]):
                what.append(f"the logprobs of its greedy answer to {prompt!r} moved by {drift:.4f} nats (tolerance "
                            f"{DRIFT_TOLERANCE:g})")
    return what


def redeployed(label: str, endpoint: dict, recorded: dict | None, remedy: str) -> str | None:
    """Why the evidence recorded for `label` no longer stands for what its endpoint serves now (None: it stands): the
    server answers otherwise than when evaluated (asked ASKS times), cannot be asked, or nothing was recorded."""
    if not recorded:
        return f"{label}: no fingerprint of {endpoint['base_url']} was recorded when it was evaluated: {remedy}"
    for _ in range(ASKS):
        try:
            what = differences(recorded, fingerprint(endpoint))
        except QuantgateError as err:
            return f"{label}: cannot check that {endpoint['base_url']} still serves what was evaluated ({err}): ask " \
                   f"from where the server answers (and its key's variable is set); or {remedy}"
        if not what:
            return None
    return (f"{label}: {endpoint['base_url']} ({endpoint['model']}) now serves another model than was evaluated (a "
            f"redeploy behind the same address: {'; '.join(what)[:600]}): {remedy}")


def stale_endpoints(params, names: list[str], root: Path = Path(".")) -> list[str]:
    """The gate's lines for every served model among `names` (the gated candidates) and fp16's baseline when it is
    served (baseline.source: endpoint) whose server no longer answers as it did when evaluated, or cannot be asked."""
    from pipelines.core.io import read_json
    from pipelines.core.paths import BASELINE_RESULTS, MANIFEST, VARIANTS_DIR

    served = []
    if params.baseline.source == SOURCE:
        result = root / BASELINE_RESULTS / "eval.json"
        recorded = (read_json(result).get("evidence") or {}).get("fingerprint") if result.is_file() else None
        served.append(("baseline fp16", params.baseline.endpoint.model_dump(), recorded,
                       "evaluate it again: dvc repro -f -s baseline, then dvc repro"))
    for name in names:
        candidate = params.candidates.get(name)
        manifest = root / VARIANTS_DIR / name / MANIFEST
        if candidate is None or candidate.source != SOURCE or not manifest.is_file():
            continue
        admitted = read_json(manifest)
        if admitted.get("status") != "ok":  # refused at admit: its rows fail already, nothing it served is evidence
            continue
        served.append((f"candidate {name}", admitted["endpoint"], (admitted.get("evidence") or {}).get("fingerprint"),
                       f"evaluate it again: dvc repro -f -s admit@{name}, then dvc repro"))
    return [line for label, endpoint, recorded, remedy in served
            if (line := redeployed(label, endpoint, recorded, remedy))]
