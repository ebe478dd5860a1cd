"""Stage `compare`: every variant against fp16, per domain, turned into a verdict that fails closed.

A verdict is `pass` only when every limit of the domain's policy was checked on a real number:
a missing, NaN or placeholder value, too few items, items that do not pair with fp16's, a missing
baseline or a failed upstream stage all give `fail` (../shared/notes/references.md, gate rules).
`inconclusive` means the evidence cannot tell: the accuracy interval straddles the margin, or the
item count cannot detect a drop as small as the margin. It never routes and never releases.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipelines import stats
from pipelines.evaluate import EVAL_DIR, PLACEHOLDERS
from pipelines.io import read_json, read_jsonl
from pipelines.params import CompareParams, PolicyParams

BASELINE = "fp16"
VERDICTS = ("pass", "inconclusive", "fail")
MIN_FIDELITY_TOKENS = 100  # llama.cpp prints no KL summary below 100 scored tokens


def usable(value) -> bool:
    """A real, finite number: not None, NaN, inf, a bool, a string or an lm-eval placeholder."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value not in PLACEHOLDERS


def expected_items(domains: list[str], limit: int | None, eval_dir: Path = EVAL_DIR) -> dict[str, int]:
    """How many items each probe must have scored: its items file, cut to `evaluate.limit`."""
    counts = {}
    for domain in domains:
        path = eval_dir / domain / "items.jsonl"
        n = len(read_jsonl(path)) if path.is_file() else 0
        counts[domain] = min(n, limit) if limit else n
    return counts


def load_inputs(names: list[str], results: Path, variants_dir: Path) -> dict[str, dict]:
    """Each model's manifest, evaluation summary and per-item records; what is missing stays None."""
    def maybe(path: Path):
        return read_json(path) if path.is_file() else None

    out = {}
    for name in names:
        items_path = results / "eval" / name / "items.jsonl"
        out[name] = {"manifest": maybe(variants_dir / name / "quantgate.json"),
                     "eval": maybe(results / "eval" / f"{name}.json"),
                     "items": read_jsonl(items_path) if items_path.is_file() else None}
    return out


def _upstream_failure(inputs: dict | None) -> str | None:
    """Why a model has no usable results at all, or None."""
    if inputs is None:
        return "no results"
    manifest, evaluation = inputs["manifest"], inputs["eval"]
    if manifest is None:
        return "no manifest (quantize/admit did not run)"
    if manifest.get("status") != "ok":
        return f"quantize/admit failed: {manifest.get('error') or '; '.join(manifest.get('validation', {}).get('reasons', [])) or 'unknown'}"
    if evaluation is None:
        return "no evaluation results"
    if evaluation.get("status") != "ok":
        return f"evaluation failed: {evaluation.get('error', 'unknown')}"
    if inputs["items"] is None:
        return "no per-item records"
    return None


def by_id(items: list[dict], domain: str) -> dict[str, dict]:
    """One domain's per-item records keyed by their stable item id."""
    return {row["item_id"]: row for row in items if row.get("domain") == domain}


def pair_items(base: dict[str, dict], variant: dict[str, dict], expected: int,
               base_name: str = BASELINE) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Correctness of both models on the same items, and the reasons the pairing cannot be trusted."""
    problems = []
    if len(base) != expected:
        problems.append(f"{base_name} scored {len(base)} items, expected {expected}")
    if len(variant) != expected:
        problems.append(f"scored {len(variant)} items, expected {expected}")
    if set(base) != set(variant):
        problems.append(f"{len(set(base) ^ set(variant))} item ids do not pair with {base_name}'s")
    ids = sorted(set(base) & set(variant))
    differ = [i for i in ids if (base[i].get("doc_hash"), base[i].get("prompt_hash"))
              != (variant[i].get("doc_hash"), variant[i].get("prompt_hash"))]
    if differ:
        problems.append(f"{len(differ)} items have other prompts than {base_name}'s (e.g. {differ[0]})")
    if any(not isinstance(base[i].get("correct"), bool) or not isinstance(variant[i].get("correct"), bool) for i in ids):
        problems.append("an item has no true/false correctness")
    b = np.array([bool(base[i].get("correct")) for i in ids])
    v = np.array([bool(variant[i].get("correct")) for i in ids])
    return b, v, problems


def judge(paired: dict, fidelity: dict | None, memory: dict | None, policy: PolicyParams,
          identical: bool) -> tuple[str, list[str], dict]:
    """Verdict, reasons and the value/limit of each check, for one variant and domain."""
    fails, unsure, checks = [], [], {}
    margin = policy.max_accuracy_drop
    kl = (fidelity or {}).get("kl", {}).get(policy.kl_percentile)
    tokens = (fidelity or {}).get("tokens")
    growth = (memory or {}).get("growth_excess_pct")
    required = {"accuracy difference": paired.get("difference"), "interval low end": paired.get("ci_low"),
                "interval high end": paired.get("ci_high"), "flip rate": paired.get("flip_rate"),
                f"KL {policy.kl_percentile}": kl, "fidelity tokens": tokens, "memory growth excess": growth,
                "detectable difference": paired.get("detectable_difference")}
    for name, value in required.items():
        if not usable(value):
            fails.append(f"{name} is missing or not a number ({value!r})")
    if fails:
        return "fail", fails, checks
    if tokens < MIN_FIDELITY_TOKENS:
        fails.append(f"KL over {tokens} tokens only (at least {MIN_FIDELITY_TOKENS})")
    if identical:
        fails.append("every response and every token distribution equals fp16's: the variant was not really evaluated")

    checks["accuracy_drop"] = {"value": -paired["difference"], "ci_low": paired["ci_low"], "limit": margin}
    if paired["difference"] < -margin:
        fails.append(f"accuracy drops {-paired['difference']:.3f} > margin {margin:.3f}")
    elif paired["ci_low"] < -margin:
        unsure.append(f"accuracy interval [{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}] reaches below -{margin:.3f}")
    checks["detectable_difference"] = {"value": paired["detectable_difference"], "limit": margin}
    if paired["detectable_difference"] > margin:
        unsure.append(f"too few items: {paired['items']} items detect differences of {paired['detectable_difference']:.3f} "
                      f"or more, the margin is {margin:.3f}")
    checks["flip_rate"] = {"value": paired["flip_rate"], "limit": policy.max_flip_rate}
    if paired["flip_rate"] > policy.max_flip_rate:
        fails.append(f"flip rate {paired['flip_rate']:.3f} > {policy.max_flip_rate:.3f}")
    checks["kl"] = {"value": kl, "limit": policy.max_kl, "percentile": policy.kl_percentile}
    if kl > policy.max_kl:
        fails.append(f"KL {policy.kl_percentile} {kl:.4f} > {policy.max_kl}")
    checks["growth_excess_pct"] = {"value": growth, "limit": policy.max_growth_excess_pct}
    if growth > policy.max_growth_excess_pct:
        fails.append(f"memory grows {growth:.2f} % of fp16's footprint more than fp16 (limit {policy.max_growth_excess_pct} %)")
    if memory.get("leak"):
        fails.append("memory leak under repeated traffic")
    if fails:
        return "fail", fails + unsure, checks
    if unsure:
        return "inconclusive", unsure, checks
    return "pass", [f"accuracy interval low end {paired['ci_low']:+.3f} >= -{margin:.3f}; every limit met"], checks


def _fidelity_summary(fid: dict | None) -> dict | None:
    if not fid:
        return None
    return {"tokens": fid.get("tokens"), "kl": fid.get("kl"), "same_top1": fid.get("same_top1"),
            "rms_delta_p": fid.get("rms_delta_p"), "ppl_ratio": fid.get("ppl_ratio")}


def _memory_summary(row: dict | None, base: dict | None) -> dict | None:
    """Footprint, saving, growth excess and per-length peak deltas against fp16."""
    if not row or row.get("status") != "ok":
        return None
    out = {k: row.get(k) for k in ("footprint_bytes", "footprint_saving_pct", "growth_excess_pct", "leak",
                                   "fitted_bytes_per_token", "theoretical_kv_bytes_per_token", "fragmentation")}
    if base and base.get("status") == "ok":
        out["footprint_delta_bytes"] = row["footprint_bytes"] - base["footprint_bytes"]
        out["peak_delta_by_tokens"] = {t: (p - base["peak_by_tokens"].get(t)) if usable(p) and usable(base["peak_by_tokens"].get(t)) else None
                                       for t, p in row.get("peak_by_tokens", {}).items()}
    return out


def compare_one(name: str, inputs: dict, base_inputs: dict, base_failure: str | None, memory: dict,
                domains: list[str], expected: dict[str, int], p: CompareParams) -> dict:
    """One variant's rows: per domain the paired statistics, the checks and the verdict."""
    failure = _upstream_failure(inputs)
    mem_rows = memory.get("variants", {})
    mem = _memory_summary(mem_rows.get(name), mem_rows.get(BASELINE))
    row = {"kind": inputs.get("kind", "variant"), "memory": mem, "domains": {}}
    for domain in domains:
        policy = p.policy_for(domain)
        reasons = []
        if base_failure:
            reasons.append(f"baseline fp16 unusable: {base_failure}")
        if failure:
            reasons.append(failure)
        if mem is None:
            reasons.append("no memory results")
        probe = (inputs["eval"] or {}).get("probes", {}).get(domain) if not failure else None
        if not failure and (probe is None or probe.get("status") != "ok"):
            reasons.append(f"probe not run: {(probe or {}).get('reason', 'missing')}")
        if reasons:
            row["domains"][domain] = {"verdict": "fail", "reasons": reasons, "policy": policy.model_dump()}
            continue
        base_items = by_id(base_inputs["items"], domain)
        var_items = by_id(inputs["items"], domain)
        b, v, problems = pair_items(base_items, var_items, expected[domain])
        paired = stats.paired_comparison(b, v, resamples=p.resamples, seed=p.seed, confidence=p.confidence, power=p.power)
        if usable(probe.get("score")) and abs(probe["score"] - paired["accuracy"]) > 1e-9 and not problems:
            problems.append(f"lm-eval score {probe['score']} disagrees with the per-item accuracy {paired['accuracy']}")
        fid = (inputs["eval"].get("fidelity") or {}).get(domain)
        identical = all(base_items[i].get("response") == var_items[i].get("response") for i in base_items if i in var_items) \
            and bool(fid) and fid.get("kl", {}).get("max") == 0
        verdict, why, checks = judge(paired, fid, mem, policy, identical)
        if problems:
            verdict, why = "fail", problems + why
        row["domains"][domain] = {"verdict": verdict, "reasons": why, "paired": paired,
                                  "fidelity": _fidelity_summary(fid), "checks": checks, "policy": policy.model_dump(),
                                  "task_version": probe.get("task_version"), "metric": probe.get("metric")}
    verdicts = [d["verdict"] for d in row["domains"].values()]
    row["verdict"] = next((v for v in ("fail", "inconclusive") if v in verdicts), "pass") if verdicts else "fail"
    return row


def compare_all(variants: list[str], candidates: list[str], domains: list[str], expected: dict[str, int],
                p: CompareParams, results: Path, variants_dir: Path) -> dict:
    """compare.json: the baseline's own numbers, then every variant and candidate against it."""
    names = [BASELINE, *[n for n in variants if n != BASELINE], *candidates]
    inputs = load_inputs(names, results, variants_dir)
    for name in candidates:
        inputs[name]["kind"] = "candidate"
    memory_path = results / "memory_summary.json"
    memory = read_json(memory_path) if memory_path.is_file() else {}
    base_failure = _upstream_failure(inputs[BASELINE])
    base_mem = memory.get("variants", {}).get(BASELINE)
    if base_failure is None and (base_mem is None or base_mem.get("status") != "ok"):
        base_failure = "no memory results"
    baseline = {"status": "failed" if base_failure else "ok", "error": base_failure,
                "memory": _memory_summary(base_mem, base_mem), "accuracy": {}}
    if not base_failure:
        for domain in domains:
            rows = by_id(inputs[BASELINE]["items"], domain)
            baseline["accuracy"][domain] = float(np.mean([r["correct"] for r in rows.values()])) if rows else None
    out = {"baseline": BASELINE, "fp16": baseline, "domains": domains, "expected_items": expected,
           "settings": {"resamples": p.resamples, "seed": p.seed, "confidence": p.confidence, "power": p.power},
           "variants": {}}
    for name in names[1:]:
        out["variants"][name] = compare_one(name, inputs[name], inputs[BASELINE], base_failure, memory, domains, expected, p)
    return out


def flat_rows(report: dict) -> list[dict]:
    """One row per variant and domain: the comparison as a table (MLflow, pandas, the docs)."""
    rows = []
    for name, v in report["variants"].items():
        for domain, d in v["domains"].items():
            paired = d.get("paired") or {}
            fid = d.get("fidelity") or {}
            rows.append({"variant": name, "domain": domain, "verdict": d["verdict"],
                         "accuracy_fp16": paired.get("accuracy_fp16"), "accuracy": paired.get("accuracy"),
                         "difference": paired.get("difference"), "ci_low": paired.get("ci_low"),
                         "ci_high": paired.get("ci_high"), "correct_to_wrong": paired.get("correct_to_wrong"),
                         "wrong_to_correct": paired.get("wrong_to_correct"), "flip_rate": paired.get("flip_rate"),
                         "mcnemar_p": paired.get("mcnemar_p"), "detectable_difference": paired.get("detectable_difference"),
                         "kl_mean": (fid.get("kl") or {}).get("mean"), "kl_p99": (fid.get("kl") or {}).get("p99"),
                         "same_top1": fid.get("same_top1"),
                         "growth_excess_pct": (v.get("memory") or {}).get("growth_excess_pct"),
                         "footprint_saving_pct": (v.get("memory") or {}).get("footprint_saving_pct"),
                         "reasons": "; ".join(d["reasons"])})
    return rows


VERDICT_COLOURS = {"pass": "tab:green", "inconclusive": "tab:orange", "fail": "tab:red", "baseline": "tab:blue"}


def plot_all(report: dict, out_dir: Path) -> list[Path]:
    """Accuracy against memory per domain (Pareto front), flips per variant, KL percentiles."""
    import matplotlib.pyplot as plt

    from pipelines.plots import save

    domains = report["domains"]
    base = report["fp16"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        points = []
        if base.get("memory") and usable(base["accuracy"].get(domain)):
            points.append((BASELINE, base["memory"]["footprint_bytes"], base["accuracy"][domain], "baseline"))
        for name, v in report["variants"].items():
            d = v["domains"][domain]
            if v.get("memory") and d.get("paired") and usable(d["paired"]["accuracy"]):
                points.append((name, v["memory"]["footprint_bytes"], d["paired"]["accuracy"], d["verdict"]))
        front, best = [], -1.0
        for name, mem, acc, _ in sorted(points, key=lambda p: (p[1], -p[2])):
            if acc > best:
                front.append((mem, acc))
                best = acc
        if front:
            ax.step([m / 2**20 for m, _ in front], [a for _, a in front], where="post", color="grey", alpha=0.5)
        for name, mem, acc, verdict in points:
            ax.scatter(mem / 2**20, acc, color=VERDICT_COLOURS[verdict], zorder=3)
            ax.annotate(name, (mem / 2**20, acc), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(domain, fontsize=9)
        ax.set_xlabel("load footprint (MiB)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("probe accuracy")
    fig.suptitle("Accuracy against memory (green pass, orange inconclusive, red fail, blue fp16)", fontsize=9)
    paths = [save(fig, out_dir / "pareto.png")]

    names = list(report["variants"])
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(names) * len(domains) / 2, 3.6))
    labels, lost, gained = [], [], []
    for name in names:
        for domain in domains:
            paired = report["variants"][name]["domains"][domain].get("paired") or {}
            labels.append(f"{name}\n{domain}")
            lost.append(-(paired.get("correct_to_wrong") or 0))
            gained.append(paired.get("wrong_to_correct") or 0)
    xs = range(len(labels))
    ax.bar(xs, lost, color="tab:red", label="correct -> wrong")
    ax.bar(xs, gained, color="tab:green", label="wrong -> correct")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("items")
    ax.set_title("Flips against fp16 per variant and domain")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    paths.append(save(fig, out_dir / "flips.png"))

    percentiles = ["median", "p90", "p95", "p99", "p99_9", "max"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.4), squeeze=False, sharey=True)
    for ax, domain in zip(axes[0], domains):
        for name in names:
            kl = ((report["variants"][name]["domains"][domain].get("fidelity") or {}).get("kl") or {})
            values = [kl.get(p) for p in percentiles]
            if all(usable(x) and x > 0 for x in values):
                ax.plot(percentiles, values, marker="o", label=name)
        ax.set_yscale("log")
        ax.set_title(domain, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KL divergence vs fp16 (nats)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Token-level KL percentiles", fontsize=9)
    paths.append(save(fig, out_dir / "kl_percentiles.png"))
    return paths
