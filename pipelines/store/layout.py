"""What a recorded pipeline looks like in MLflow: the child runs' names, descriptions, params and metrics, the
parent run's per-type numbers and verdict tags, the tables, and the experiment's saved verdict view.

Functions of the results alone (the view excepted: it reads and writes one experiment tag), so `record` only logs
what they return. Change what a run shows and RECORD_FORMAT with it: finished older recordings are then redone.
"""

from __future__ import annotations

import hashlib
import json
import time

from mlflow import MlflowClient

from pipelines.core.paths import BASELINE
from pipelines.judging.verdict import usable
from pipelines.models.loading import weights_sha256

KIND_TAG = "quantgate.kind"  # pipeline (the parent run), baseline, variant or candidate
FORMAT_TAG = "quantgate.record_format"  # on the parent run; a finished recording in an older format is recorded again
RECORD_FORMAT = "4"  # 4: a `shadow` child run (the replay's agreement, latency, rollout plan);
                    # 3: child runs named by their verdicts, per-type numbers on the parent, the saved view;
                    # 2: passing checkpoints stored as artifacts (1 registered the workspace folder by path)
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
    if (manifest.get("settings") or {}).get("forward"):  # a compressed-tensors candidate: the forward it was judged in
        params["settings.forward"] = str(manifest["settings"]["forward"])[:500]
    params.update({f"library.{k}": str(v) for k, v in (manifest.get("libraries") or {}).items()})
    params["calibration_sha256"] = str((manifest.get("calibration") or {}).get("sha256"))
    params["device"] = str(manifest.get("device"))
    params["status"] = str(manifest.get("status"))
    # a candidate judged from its lm-eval sample log: the backend and model arguments lm-eval recorded
    params.update({f"evidence.{k}": str(v)[:500] for k, v in (manifest.get("evidence") or {}).items()})
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


def routing_rows(table: dict) -> list[dict]:
    """The routing table as flat rows for an MLflow table."""
    return [{"domain": r["domain"], "max_context_tokens": r["max_context_tokens"], "serve": r["serve"],
             "fallback_under_memory_pressure": r["fallback_under_memory_pressure"], "reason": r["reason"],
             "serve_cost_bytes": r["cost_bytes"]["serve"], "fp16_cost_bytes": r["cost_bytes"]["fp16"],
             "checkpoint_sha256": json.dumps(r["provenance"]["checkpoint_sha256"]),
             "calibration_sha256": r["provenance"]["calibration_sha256"],
             "dvc_lock_sha256": r["provenance"]["dvc_lock_sha256"],
             "shadow_exact_share": ((r.get("shadow") or {}).get("exact") or {}).get("share")} for r in table["rows"]]


def fleet_rows(table: dict) -> list[dict]:
    """The fleet plan beside its alternatives (fp16 only, row by row, the best single variant) and the best plan at
    each deployment count, as flat rows for an MLflow table (pipelines/routing/fleet.py)."""
    fleet = table.get("fleet") or {}
    return [{"plan": a["plan"], "deployments": a["deployments"], "deployed": " + ".join(a["deployed"]),
             "fleet_bytes": a["fleet_bytes"], "saving_pct": a["saving_pct"]}
            for a in (fleet.get("alternatives") or []) + (fleet.get("by_deployments") or [])]


def fleet_metrics(table: dict) -> dict[str, float]:
    """`fleet/<plan>/saving_pct` and `fleet/<plan>/deployments` per alternative (plan names with `_` for spaces),
    and the plan's stability under memory noise, on the parent run."""
    fleet = table.get("fleet") or {}
    out: dict[str, float] = {}
    for a in fleet.get("alternatives") or []:
        numeric_leaves(f"fleet/{a['plan'].replace(' ', '_')}", {"saving_pct": a["saving_pct"],
                                                               "deployments": a["deployments"]}, out)
    numeric_leaves("fleet/stability", {k: (fleet.get("stability") or {}).get(k)
                                       for k in ("mean_changed_rows", "max_changed_rows")}, out)
    return out


def classifier_metrics(measured: dict) -> dict[str, float]:
    """The request classifier's accuracy on the labelled production sample (results/calibration/classifier.json)
    as parent-run metrics: `classifier_accuracy` and `classifier_accuracy.<type>` (none where nothing is labelled)."""
    metrics = {f"classifier_accuracy.{t}": v["accuracy"] for t, v in (measured.get("types") or {}).items()
               if v.get("accuracy") is not None}
    if measured.get("accuracy") is not None:
        metrics["classifier_accuracy"] = measured["accuracy"]
    return metrics



# The `shadow` child run (stage shadow: results/shadow.json, results/shadow_metrics.json). Agreement numbers are
# each type's "all" bucket (the per-bucket ones are in the agreement table), named `agreement/<model>/<type>/...`
# so MLflow's chart of one metric across runs follows one variant on one request type.
SHADOW_RUN_NAME = "shadow"


def shadow_params(shadow: dict) -> dict[str, str]:
    """What was replayed and how: the traffic log (path, sha256, counts) and the replay's settings."""
    traffic = shadow.get("traffic") or {}
    return flatten("", {"traffic": {k: traffic.get(k) for k in ("path", "sha256", "requests", "replayed")},
                        "skipped_too_long": (traffic.get("skipped") or {}).get("too_long"),
                        **{k: v for k, v in (shadow.get("settings") or {}).items()}}, {})


def _agreement_cells(shadow: dict):
    """(model, type, bucket key, numbers) for every agreement cell of shadow.json."""
    for model, entry in (shadow.get("models") or {}).items():
        for domain, buckets in ((entry or {}).get("agreement") or {}).items():
            for key, cell in (buckets or {}).items():
                yield model, domain, str(key), cell or {}


def shadow_metrics(shadow: dict, measured: dict | None) -> dict[str, float]:
    """Per model and type: exact share and its low end, similarity mean, outcome share; per model: latency
    percentiles (a model behind an endpoint: each request's latency seen from the client), tokens/s, peak bytes,
    growth, the replay's memory saving against fp16 (and what compare claimed)."""
    out: dict[str, float] = {}
    for model, domain, key, cell in _agreement_cells(shadow):
        if key != "all":
            continue
        exact, outcome = cell.get("exact") or {}, cell.get("outcome") or {}
        numeric_leaves(f"agreement/{model}/{domain}", {
            "exact_share": exact.get("share"), "exact_low": exact.get("low"), "requests": cell.get("requests"),
            "similarity_mean": (cell.get("similarity") or {}).get("mean"), "outcome_share": outcome.get("share")}, out)
    for model, m in ((measured or {}).get("models") or {}).items():
        latency, memory = (m or {}).get("latency") or {}, (m or {}).get("memory") or {}
        numeric_leaves(f"latency/{model}", {
            "ttft_ms_p50": (latency.get("ttft_ms") or {}).get("p50"), "ttft_ms_p99": (latency.get("ttft_ms") or {}).get("p99"),
            "tpot_ms_p50": (latency.get("tpot_ms") or {}).get("p50"), "tpot_ms_p99": (latency.get("tpot_ms") or {}).get("p99"),
            "tokens_per_s": latency.get("tokens_per_s"),
            "client_ms_p50": (latency.get("client_ms") or {}).get("p50"),
            "client_ms_p99": (latency.get("client_ms") or {}).get("p99")}, out)
        numeric_leaves(f"memory/{model}", {"peak_bytes": memory.get("peak_bytes"), "growth_pct": memory.get("growth_pct")}, out)
    for model, s in ((measured or {}).get("memory_saving") or {}).items():
        numeric_leaves(f"memory/{model}", {"replay_saving_pct": (s or {}).get("replay_pct"),
                                           "claimed_saving_pct": (s or {}).get("claimed_pct"),
                                           "saving_agrees": (s or {}).get("agrees")}, out)
    return out


def shadow_agreement_rows(shadow: dict) -> list[dict]:
    """shadow.json's agreement as flat rows (model, type, bucket): the child run's agreement table."""
    rows = []
    for model, domain, key, cell in _agreement_cells(shadow):
        exact, sim, outcome = cell.get("exact") or {}, cell.get("similarity") or {}, cell.get("outcome") or {}
        rows.append({"model": model, "type": domain, "bucket": key, "requests": cell.get("requests"),
                     "exact_share": exact.get("share"), "exact_low": exact.get("low"), "exact_high": exact.get("high"),
                     "first_difference_median": (cell.get("first_difference") or {}).get("median"),
                     "similarity_mean": sim.get("mean"), "similarity_low": sim.get("low"), "similarity_high": sim.get("high"),
                     "outcome_kind": outcome.get("kind"), "outcome_share": outcome.get("share"),
                     "outcome_low": outcome.get("low"), "outcome_high": outcome.get("high"),
                     "fp16_correct": outcome.get("fp16_correct"), "variant_correct": outcome.get("variant_correct")})
    return rows


def shadow_latency_rows(shadow: dict, measured: dict | None) -> list[dict]:
    """One row per replayed model: status, latency percentiles, throughput, memory and the replay's saving."""
    measured = measured or {}
    rows = []
    for model, entry in (shadow.get("models") or {}).items():
        m = (measured.get("models") or {}).get(model) or {}
        latency, memory = m.get("latency") or {}, m.get("memory") or {}
        saving = (measured.get("memory_saving") or {}).get(model) or {}
        rows.append({"model": model, "status": (entry or {}).get("status"), "error": (entry or {}).get("error"),
                     "ttft_ms_p50": (latency.get("ttft_ms") or {}).get("p50"), "ttft_ms_p99": (latency.get("ttft_ms") or {}).get("p99"),
                     "tpot_ms_p50": (latency.get("tpot_ms") or {}).get("p50"), "tpot_ms_p99": (latency.get("tpot_ms") or {}).get("p99"),
                     "tokens_per_s": latency.get("tokens_per_s"),
                     "client_ms_p50": (latency.get("client_ms") or {}).get("p50"),
                     "client_ms_p99": (latency.get("client_ms") or {}).get("p99"), "endpoint": m.get("endpoint"),
                     "memory_measure": memory.get("measure"),
                     "peak_bytes": memory.get("peak_bytes"), "growth_pct": memory.get("growth_pct"),
                     "replay_saving_pct": saving.get("replay_pct"), "claimed_saving_pct": saving.get("claimed_pct"),
                     "saving_agrees": saving.get("agrees"), "seconds": m.get("seconds")})
    return rows


def shadow_description(shadow: dict) -> str:
    """The shadow child's description: per model and type the exact agreement with fp16 over all replayed requests."""
    traffic = shadow.get("traffic") or {}
    lines = [f"**shadow replay** of `{traffic.get('path')}`: {traffic.get('replayed')} of {traffic.get('requests')} "
             "requests through fp16 and each variant that passed compare; exact agreement with fp16 (Wilson 95 %):", "",
             "| model | request type | requests | exact agreement [interval] |", "|---|---|---|---|"]
    for model, domain, key, cell in _agreement_cells(shadow):
        exact = cell.get("exact") or {}
        if key == "all" and usable(exact.get("share")):
            lines.append(f"| {model} | {domain} | {cell.get('requests')} | {exact['share']:.3f} "
                         f"[{exact.get('low', float('nan')):.3f}, {exact.get('high', float('nan')):.3f}] |")
    failed = [f"- {m}: {(e or {}).get('reason')}" if (e or {}).get("status") == "not_measured" else
              f"- {m}: replay failed ({(e or {}).get('error')})" for m, e in (shadow.get("models") or {}).items()
              if (e or {}).get("status") != "ok"]
    return "\n".join(lines + ([""] + failed if failed else []))[:4000]
