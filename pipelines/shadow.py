"""Stage `shadow`: replay a traffic log through fp16 and every variant compare passed, and measure how often they agree.

The probes say a variant is as accurate as fp16 on the probe pools; production traffic is not the probe pools. This
stage replays the log (greedy, the same batches for every model) and writes each variant's agreement with fp16 per
request type and context bucket to results/shadow.json, which route reads before it lets a variant serve a type.
Each model runs in its own process (pipelines/core/isolation.py): one that fails to load, crashes or runs past
shadow.timeout_s is recorded as failed and the others still replay. Requests are tokenized once, here, with fp16's
tokenizer, and every model gets the same token ids. Latency and memory are volatile and go to
results/shadow_metrics.json, which nothing depends on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipelines.core import logs
from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, sha256_file, sha256_text, write_json, write_jsonl
from pipelines.core.isolation import run_isolated
from pipelines.core.params import Params, load_params
from pipelines.core.paths import (BASELINE, COMPARE_REPORT, PLOTS_DIR, SHADOW_DIR, SHADOW_METRICS, SHADOW_REPORT,
                                  VARIANTS_DIR)
from pipelines.replay import agreement, plots, traffic
from pipelines.replay.engine import replay
from pipelines.models.loading import NOT_MEASURED, endpoint_of, log_only
from pipelines.text.classify import Classifier
from pipelines.text.pii import mask

log = logging.getLogger(__name__)

MEMORY_TOLERANCE_PCT = 10.0  # replayed vs claimed saving: the replay's KV cache and activations are the same bytes
# for every model, so its saving sits below the footprint's; a gap beyond this many points is worth a look


def passing(report: dict) -> list[str]:
    """Variants and candidates compare passed for at least one request type, in report order."""
    return [name for name, v in report.get("variants", {}).items()
            if any(d.get("verdict") == "pass" for d in (v.get("domains") or {}).values())]


def _context(model_dir: Path) -> int:
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(model_dir).max_position_embeddings)
    except (OSError, ValueError, AttributeError) as err:
        raise QuantgateError(f"{model_dir}: cannot read the model's context length ({str(err).splitlines()[0]})") from None


def run(params: Params, report: dict, variants_dir: Path, device: str, out_report: Path, out_metrics: Path,
        answers_dir: Path, plots_dir: Path) -> dict:
    """Replay the log through fp16 and every passing variant; write the report, metrics, answers and charts."""
    from transformers import AutoTokenizer

    p = params.shadow
    path = Path(p.traffic or params.coverage.traffic)
    requests = traffic.read_traffic(path, p.kind, p.text_field, p.id_field, p.label_field, p.reference_field,
                                    p.timestamp_field if p.time_compression else None)
    base_dir = variants_dir / BASELINE
    if not (base_dir / "tokenizer_config.json").is_file() and not (base_dir / "tokenizer.json").is_file():
        raise QuantgateError(f"{base_dir}: no tokenizer; run `dvc repro quantize@fp16` first")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    classifier = Classifier({name: rule.model_dump() for name, rule in params.coverage.classify.items()})
    traffic.prepare(requests, tokenizer, classifier, params.route.context_buckets, _context(base_dir), p.max_new_tokens)
    groups = traffic.batches(requests, p.max_batch)
    if not groups:
        raise QuantgateError(f"{path}: every request is longer than the largest context bucket or the model's context "
                             f"minus shadow.max_new_tokens: nothing to replay")
    kept = [i for g in groups for i in g]
    arrive = traffic.arrivals(requests, p.time_compression)
    waits = [arrive[g[-1]] for g in groups] if arrive else None
    ids = [[requests[i].ids for i in g] for g in groups]
    models = [BASELINE, *[n for n in passing(report) if n != BASELINE]]
    elsewhere = [n for n in models if log_only(variants_dir / n)]  # an lm-eval sample log: nothing to replay through
    models = [n for n in models if n not in elsewhere]
    log.info("shadow: %d requests from %s, %d replayed (%d too long) in %d batches through %s", len(requests), path,
             len(kept), len(requests) - len(kept), len(groups), ", ".join(models))
    _warn_if_too_few([requests[i].type for i in kept], report, p.min_requests)

    runs: dict[str, dict] = {}
    for name in models:
        if name != BASELINE and runs[BASELINE].get("error"):
            runs[name] = {"error": "not replayed: the fp16 replay it is compared with failed"}
            continue
        started = time.perf_counter()
        endpoint = endpoint_of(variants_dir / name)
        if endpoint:  # served elsewhere (pipelines/evaluation/endpoints.py): the same requests, as text, over HTTP
            result, error = run_isolated("pipelines.evaluation.endpoints:replay",
                                         (endpoint, [requests[i].text for i in kept], p.max_new_tokens), p.timeout_s,
                                         f"the shadow replay of {name} at {endpoint['base_url']}", logs.current_log_file)
            result = result and {"answers": [tokenizer(t, add_special_tokens=False)["input_ids"]
                                             for t in result["texts"]],
                                 "client_ms": [1000 * s for s in result["latency_s"]], "endpoint": endpoint["base_url"]}
        else:
            result, error = run_isolated(replay, (str(variants_dir / name), ids, p.max_new_tokens, device, p.threads,
                                                  waits), p.timeout_s, f"the shadow replay of {name}",
                                         logs.current_log_file)
        runs[name] = {"error": error} if error else result
        runs[name]["wall"] = time.perf_counter() - started
        log.info("shadow %s: %s in %.1f s", name, "FAILED (" + error + ")" if error else "replayed",
                 runs[name]["wall"])

    texts = {n: [tokenizer.decode(a, skip_special_tokens=True) for a in r["answers"]]
             for n, r in runs.items() if not r.get("error")}
    types = [requests[i].type for i in kept]
    buckets = [requests[i].bucket for i in kept]
    refs = [requests[i].reference for i in kept]
    shadow = {"baseline": BASELINE,
              "traffic": {"path": str(path), "sha256": sha256_file(path), "requests": len(requests),
                          "replayed": len(kept), "skipped": {"too_long": len(requests) - len(kept)},
                          "by_type": {t: types.count(t) for t in sorted(set(types))}},
              "settings": {"max_new_tokens": p.max_new_tokens, "max_batch": p.max_batch,
                           "time_compression": p.time_compression, "store": p.store},
              "models": {}}
    for name, r in runs.items():
        entry: dict = {"status": "failed" if r.get("error") else "ok", "error": r.get("error")}
        if name != BASELINE and not r.get("error"):
            entry["agreement"] = agreement.agreement(types, buckets, runs[BASELINE]["answers"], r["answers"],
                                                     texts[BASELINE], texts[name], refs)
        shadow["models"][name] = entry
    for name in elsewhere:
        shadow["models"][name] = {"status": NOT_MEASURED, "error": None,
                                  "reason": "not replayed: its evidence is an lm-eval sample log, no model here"}
        log.info("shadow %s: not replayed (an lm-eval sample log: no model here)", name)
    write_json(out_report, shadow)
    write_json(out_metrics, _metrics(runs, report))
    _answers(answers_dir / "answers.jsonl", requests, kept, texts, p.store)
    plots.agreement_chart(plots_dir / "shadow_agreement.png", shadow)
    plots.latency_chart(plots_dir / "shadow_latency.png", {n: r for n, r in runs.items() if not r.get("error")})
    return shadow


def _metrics(runs: dict[str, dict], report: dict) -> dict:
    """Latency percentiles and memory per model; the replayed memory saving against the one compare claims."""
    q = agreement.percentile
    out: dict = {"models": {}, "memory_saving": {}}
    for name, r in runs.items():
        if r.get("error"):
            out["models"][name] = {"status": "failed", "error": r["error"], "seconds": r.get("wall")}
            continue
        if r.get("endpoint"):  # seen from the client: the server's queue, network and generation together
            out["models"][name] = {"latency": {"client_ms": {"p50": q(r["client_ms"], 50), "p99": q(r["client_ms"], 99)}},
                                   "endpoint": r["endpoint"], "memory": None, "seconds": r["wall"]}
            continue
        out["models"][name] = {
            "latency": {"ttft_ms": {"p50": q(r["ttft_ms"], 50), "p99": q(r["ttft_ms"], 99)},
                        "tpot_ms": {"p50": q(r["tpot_ms"], 50), "p99": q(r["tpot_ms"], 99)},
                        "tokens_per_s": r["tokens"] / r["busy_seconds"] if r["busy_seconds"] else None},
            "memory": r["memory"], "seconds": r["wall"]}
    base = runs.get(BASELINE, {})
    base_peak = (base.get("memory") or {}).get("peak_bytes")
    for name, r in runs.items():
        if name == BASELINE or r.get("error") or not base_peak or not r.get("memory"):
            continue
        replay_pct = 100 * (1 - r["memory"]["peak_bytes"] / base_peak)
        claimed = ((report.get("variants", {}).get(name) or {}).get("memory") or {}).get("footprint_saving_pct")
        out["memory_saving"][name] = {
            "replay_pct": replay_pct, "claimed_pct": claimed, "tolerance_pct": MEMORY_TOLERANCE_PCT,
            "agrees": claimed is not None and abs(replay_pct - claimed) <= MEMORY_TOLERANCE_PCT}
    return out


def _warn_if_too_few(types: list[str], report: dict, min_requests: int) -> None:
    """A WARNING when no request type a passing variant could serve has shadow.min_requests replayed requests: the
    routing table then serves every type with fp16, whatever compare found."""
    servable = sorted({t for name, v in report.get("variants", {}).items() if name != BASELINE
                       for t, d in (v.get("domains") or {}).items() if d.get("verdict") == "pass"})
    if servable and all(types.count(t) < min_requests for t in servable):
        counts = ", ".join(f"{t} {types.count(t)}" for t in servable)
        log.warning("shadow: no request type a passing variant could serve has shadow.min_requests (%d) replayed "
                    "requests (%s): the routing table will serve those types with fp16", min_requests, counts)


def _answers(path: Path, requests: list, kept: list[int], texts: dict[str, list[str]], store: str) -> None:
    """Per request and model: the request's id and answer, PII-masked, or (store: hashes) only their sha256 (and the
    answer's length)."""
    rows = []
    for name, answers in texts.items():
        for i, text in zip(kept, answers):
            r = requests[i]
            ident = sha256_text(r.id) if store == "hashes" else mask(r.id)  # production ids are personal data too
            row = {"id": ident, "model": name, "type": r.type, "bucket": r.bucket, "prompt_tokens": len(r.ids)}
            if store == "hashes":
                row.update({"sha256": sha256_text(text), "length": len(text)})
            else:
                row["answer"] = mask(text)
            rows.append(row)
    write_jsonl(path, rows)


def main() -> int:
    """Stage `shadow`: results/shadow.json, results/shadow_metrics.json, results/shadow/answers.jsonl, two charts."""
    from pipelines.models.loading import resolve_device

    params = load_params()
    device = resolve_device(params.device)
    if not COMPARE_REPORT.is_file():
        raise QuantgateError(f"{COMPARE_REPORT}: not found; run `dvc repro compare` first")
    started = time.perf_counter()
    shadow = run(params, read_json(COMPARE_REPORT), VARIANTS_DIR, device, SHADOW_REPORT, SHADOW_METRICS, SHADOW_DIR,
                 PLOTS_DIR)
    for name, m in shadow["models"].items():
        for type_, cells in (m.get("agreement") or {}).items():
            cell = cells["all"]
            log.info("shadow %s %s: exact %.2f [%.2f, %.2f] on %d requests, similarity %.2f", name, type_,
                     cell["exact"]["share"], cell["exact"]["low"], cell["exact"]["high"], cell["requests"],
                     cell["similarity"]["mean"])
    log.info("shadow: done in %.1f s -> %s", time.perf_counter() - started, SHADOW_REPORT)
    return 0
