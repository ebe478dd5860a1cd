"""The comparison of every variant against fp16 from the per-item records: what compare writes to compare.json
and what the gate recomputes to check it (the same function, so the two cannot drift apart).

A verdict is `pass` only when every limit of the domain's policy was checked on a real number:
a missing, NaN or placeholder value, items that do not pair with fp16's or do not follow the look
plan, a missing baseline or a failed upstream stage all give `fail` (the gate then tells a missing
baseline apart as "could not decide"). A standard lm-eval task (`requests.<name>.tasks`) is its own row
`<domain>:<task>` beside the domain's row, judged the same way under the domain's policy; the domain's row
is the worst of its own and its task rows'.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipelines.core.errors import ENVIRONMENT
from pipelines.core.io import read_json, read_jsonl
from pipelines.core.params_requests import PolicyParams
from pipelines.core.params_sections import CompareParams
from pipelines.core.paths import BASELINE, EVAL_RESULTS, MANIFEST, MEMORY_SUMMARY, RESULTS
from pipelines.evaluation import standard_tasks
from pipelines.evaluation.plans import by_id, correctness, plan_summary
from pipelines.judging import sequential, stats
from pipelines.judging.verdict import pairing_problems, rederive, task_verdicts, usable, worst
from pipelines.models.loading import ELSEWHERE, NOT_MEASURED


def load_inputs(names: list[str], results: Path, variants_dir: Path) -> dict[str, dict]:
    """Each model's manifest, evaluation summary and per-item records; what is missing stays None."""
    def maybe(path: Path):
        return read_json(path) if path.is_file() else None

    out = {}
    for name in names:
        evaluated = results / EVAL_RESULTS.relative_to(RESULTS)  # `results` is RESULTS in a run, a copy in tests
        items_path = evaluated / name / "items.jsonl"
        out[name] = {"manifest": maybe(variants_dir / name / MANIFEST),
                     "eval": maybe(evaluated / f"{name}.json"),
                     "items": read_jsonl(items_path) if items_path.is_file() else None}
    return out


def _upstream_failure(inputs: dict | None) -> tuple[str | None, dict | None]:
    """Why a model has no usable results at all (or None), and, when that is this machine's doing (a library,
    kernel or device missing: errors.environment_cause), {"reason", "remedy"}."""
    if inputs is None:
        return "no results", None
    manifest, evaluation = inputs["manifest"], inputs["eval"]
    if manifest is None:
        return "no manifest (quantize/admit did not run)", None
    if manifest.get("status") != "ok":
        return (f"quantize/admit failed: {manifest.get('error') or '; '.join(manifest.get('validation', {}).get('reasons', [])) or 'unknown'}",
                _unmeasured(manifest))
    if evaluation is None:
        return "no evaluation results", None
    if evaluation.get("status") != "ok":
        return f"evaluation failed: {evaluation.get('error', 'unknown')}", _unmeasured(evaluation)
    if inputs["items"] is None:
        return "no per-item records", None
    return None, None


def _unmeasured(record: dict | None) -> dict | None:
    """{"reason", "remedy"} of a record that says this machine could not measure (not that the model failed)."""
    if not record or record.get("cause") != ENVIRONMENT:
        return None
    return {"reason": str(record.get("reason") or record.get("error") or "unknown"), "remedy": str(record.get("remedy") or "")}


def _fidelity_summary(fid: dict | None) -> dict | None:
    if not fid:
        return None
    return {"tokens": fid.get("tokens"), "kl": fid.get("kl"), "same_top1": fid.get("same_top1"),
            "rms_delta_p": fid.get("rms_delta_p"), "ppl_ratio": fid.get("ppl_ratio")}


def _memory_summary(row: dict | None, base: dict | None) -> dict | None:
    """Footprint, saving, growth excess, OOM and per-length peak deltas against fp16."""
    if not row or row.get("status") != "ok":
        return None
    out = {k: row.get(k) for k in ("footprint_bytes", "footprint_saving_pct", "growth_excess_pct",
                                   "growth_bytes_per_request", "leak", "oom", "fitted_bytes_per_token",
                                   "theoretical_kv_bytes_per_token", "fragmentation", "growth_class",
                                   "growth_cause")}
    if "serving_tensor_bytes" in row:  # the forward unpacked weights (memory.py): what serving holds
        out["serving_tensor_bytes"] = row["serving_tensor_bytes"]
    if base and base.get("status") == "ok":
        out["footprint_delta_bytes"] = row["footprint_bytes"] - base["footprint_bytes"]
        out["peak_delta_by_tokens"] = {t: (p - base["peak_by_tokens"].get(t)) if usable(p) and usable(base["peak_by_tokens"].get(t)) else None
                                       for t, p in row.get("peak_by_tokens", {}).items()}
    return out


def compare_domain(base_rows: dict[str, dict], var_rows: dict[str, dict], probe: dict, fid: dict | None,
                   mem: dict | None, plan: dict, policy: PolicyParams, p: CompareParams,
                   task_rows: dict[str, dict] | None = None, not_here: dict[str, dict] | None = None) -> dict:
    """One variant and row: run the looks, check the records follow the look plan, then judge.

    `task_rows`: the domain's standard-task rows, already judged; `judge` weighs their verdicts (kept in the
    row under `tasks`, so the gate re-derives the same verdict).
    """
    order, looks = plan["order"], plan["looks"]
    problems = [] if looks else ["the probe pool is empty"]
    cap = looks[-1] if looks else 0
    if set(base_rows) != set(order[:cap]):
        problems.append(f"{BASELINE} scored {len(base_rows)} items; the look plan needs exactly the pool's first {cap} "
                        "(in evaluation order)")
    run = sequential.run_looks(correctness(base_rows), correctness(var_rows), order, looks, plan["families"],
                               policy.max_accuracy_drop, p.alpha, p.spending)
    needed = order[: sequential.needed_items(run)]
    problems += pairing_problems(base_rows, var_rows, needed)
    if set(var_rows) != set(needed):
        problems.append(f"scored {len(var_rows)} items; the look plan {looks} needed exactly the pool's first "
                        f"{len(needed)} (in evaluation order)")
    if sequential.more_items(run) is not None:
        problems.append(f"evaluation stopped at look {run['look']} of {len(looks)} although the interval straddled the margin")
    paired = run["paired"]
    if paired:
        paired["chance"] = chance_level([base_rows.get(i) or {} for i in order[: paired["items"]]])
    if paired and usable(probe.get("score")) and abs(probe["score"] - paired["accuracy"]) > 1e-9 and not problems:
        problems.append(f"lm-eval score {probe['score']} disagrees with the per-item accuracy {paired['accuracy']}")
    tasks = {key: {"verdict": row.get("verdict"), "reasons": list(row.get("reasons") or [])}
             for key, row in (task_rows or {}).items()}
    same_answers = bool(needed) and all(base_rows[i].get("response") == var_rows[i].get("response")
                                        for i in needed if i in base_rows and i in var_rows)
    if fid or not not_here:
        identical = same_answers and bool(fid) and fid.get("kl", {}).get("max") == 0
    else:  # a sample log has no distributions: multiple-choice log-likelihoods equal to the last digit are fp16's run
        identical = same_answers and any((base_rows.get(i) or {}).get("chance") or 0 for i in needed)
    if paired is None:
        verdict, why, checks = "fail", (problems or [run["reason"]]) + task_verdicts(tasks)[0], {}
    else:
        verdict, why, checks = rederive(paired, fid, mem, policy, identical, problems, tasks, not_here)
    row = {"verdict": verdict, "reasons": why, "paired": paired, "record_problems": problems,
           "identical_to_fp16": identical,
           "looks": {k: run.get(k) for k in ("look", "looks", "alpha", "alpha_total", "spending", "history")},
           "fidelity": _fidelity_summary(fid), "checks": checks, "policy": policy.model_dump(),
           "task_version": probe.get("task_version"), "metric": probe.get("metric")}
    if tasks:
        row["tasks"] = tasks
    if not_here:
        row["not_checked_here"] = not_here
    if verdict == "inconclusive" and paired and checks["signal"]["decision"] == "no":
        row["items_to_decide"] = None
    elif verdict == "inconclusive" and paired and checks["accuracy_drop"]["decision"] == sequential.UNDECIDED:
        need = stats.items_to_decide(paired["difference"], paired["flip_rate"], policy.max_accuracy_drop,
                                     run["alpha"], p.power, paired["design_effect"], paired["degrees_of_freedom"],
                                     paired["items"])
        row["items_to_decide"] = None if need is None else math.ceil(need)
        row["reasons"].append(_more_items_advice(need, paired, p.power, plan["pool"], plan.get("task")))
    return row


def chance_level(records: list[dict]) -> float | None:
    """The mean chance of the items fp16 was judged on, as evaluate recorded it per item (1/choices for multiple
    choice, 0 for generation); None when a record has none (the records predate it, or were edited)."""
    chances = [r.get("chance") for r in records]
    if not chances or not all(usable(c) and 0 <= c <= 1 for c in chances):
        return None
    return round(float(np.mean(chances)), 12)


def _more_items_advice(need: float | None, paired: dict, power: float, pool: int, task: str | None = None) -> str:
    """What an inconclusive row tells the user to do."""
    if paired.get("degrees_of_freedom") == 0:
        return ("more items of the same family decide nothing: add items from other families (a `family` per item in "
                "the domain's eval/<domain>/items.jsonl; with 2-5 families the interval stays wide, docs/compare.md)")
    if need is None:
        return "no number of items would decide at the observed difference"
    more = max(1, math.ceil(need) - paired["items"])
    crowding = _crowding(paired)
    if paired["items"] + more <= pool:
        return (f"about {more} more items would decide (at the observed discordance, power {power}): "
                f"raise evaluate.max_items{crowding}")
    if task:
        return (f"about {more} more items would decide (at the observed discordance, power {power}), more than "
                f"task {task}'s {pool} evaluation docs hold{crowding}")
    return (f"about {more} more items would decide (at the observed discordance, power {power}), more than the "
            f"{pool}-item pool holds: add items to the domain's eval/<domain>/items.jsonl, from more families "
            f"if the flips cluster (design effect {paired['design_effect']:.1f}){crowding}")


def _crowding(paired: dict) -> str:
    """The advice's last words when the flips crowd into few families (stats.flip_spread_df cut the degrees of
    freedom): the estimate above takes that cut as the pool's, and a few flips that happened to share a family
    make it large, so the user learns why and what decides sooner."""
    df, sizes_df = paired.get("degrees_of_freedom"), paired.get("degrees_of_freedom_sizes")
    if df is None or sizes_df is None or df >= sizes_df:
        return ""
    return (f"; the {paired['wrong_to_correct'] + paired['correct_to_wrong']} flips crowd into some of the "
            f"{paired['families']} families (t on {df:.1f} degrees of freedom, not the {sizes_df:.1f} their sizes "
            f"allow), so items from more families, or more items that spread the flips, decide sooner")


def not_checked_here(inputs: dict, memory_row: dict | None, judged_elsewhere: list[str],
                     base_eval: dict | None = None) -> dict[str, dict]:
    """What a candidate judged from its lm-eval sample log cannot have measured here (token distributions; memory,
    when the memory stage says so), each with whether the team declared it judged elsewhere; and KL for every model
    when fp16's own baseline is a sample log (`base_eval`'s not_measured). Otherwise a checkpoint's missing KL or
    memory stays a failure."""
    base_missing = ((base_eval or {}).get("not_measured") or {}).get("fidelity")
    elsewhere = (inputs.get("manifest") or {}).get("source") in ELSEWHERE
    if not elsewhere and not base_missing:
        return {}
    out = {"fidelity": base_missing or "an lm-eval sample log (a team's, or the one evaluate wrote against an "
                                       "endpoint) holds no token distributions to compare with fp16's"}
    if elsewhere and (memory_row or {}).get("status") == NOT_MEASURED:
        out["memory"] = memory_row.get("reason") or "no model here"
    rows = {check: {"reason": reason, "judged_elsewhere": check in judged_elsewhere} for check, reason in out.items()}
    if not elsewhere:  # a model evaluated here: nothing the team measured elsewhere stands in for it
        rows["fidelity"]["remedy"] = "a model evaluated here can be measured only against fp16 evaluated here " \
                                     "(baseline.source: here)"
    return rows


def compare_one(name: str, inputs: dict, base_inputs: dict, base_failure: str | None, memory: dict,
                plans: dict[str, dict], p: CompareParams, judged_elsewhere: list[str] | None = None) -> dict:
    """One variant's rows: per domain the looks, the paired statistics, the checks and the verdict.
    `judged_elsewhere`: a log candidate's declaration (candidates.<name>.judged_elsewhere)."""
    failure, unmeasured = _upstream_failure(inputs)
    mem_rows = memory.get("variants", {})
    unmeasured = unmeasured or _unmeasured(mem_rows.get(name))  # memory this machine could not run: no evidence
    mem = _memory_summary(mem_rows.get(name), mem_rows.get(BASELINE))
    not_here = not_checked_here(inputs, mem_rows.get(name), judged_elsewhere or [], (base_inputs or {}).get("eval"))
    row = {"kind": inputs.get("kind", "variant"), "memory": mem, "domains": {}}
    if (inputs.get("eval") or {}).get("forward"):  # which forward was evaluated (compressed-tensors: as served)
        row["forward"] = inputs["eval"]["forward"]
    if not_here:  # where its evidence came from (the backend and arguments lm-eval recorded), for the report
        row["evidence"] = (inputs.get("manifest") or {}).get("evidence")
    judged: dict[str, dict] = {}
    # the memory stage measured this checkpoint and it failed there (OOM, a crash): the variant's own evidence,
    # which an evaluation this machine could not run does not excuse
    checkpoint_made = (inputs.get("manifest") or {}).get("status") == "ok"
    memory_failed = checkpoint_made and mem is None and "memory" not in not_here \
        and (mem_rows.get(name) or {}).get("cause") != ENVIRONMENT  # this machine could not run it: no evidence
    # task rows first: the domain's row needs their verdicts
    for domain, plan in sorted(plans.items(), key=lambda kv: not standard_tasks.is_task_row(kv[0])):
        policy = p.policy_for(plan.get("domain", domain))
        if unmeasured and not base_failure and not memory_failed:  # nothing measured: no evidence against the variant
            judged[domain] = _unmeasured_row(unmeasured, policy)
            continue
        reasons = []
        if base_failure:
            reasons.append(f"baseline fp16 unusable: {base_failure}")
        if failure:
            reasons.append(failure)
        if mem is None and "memory" not in not_here:
            memory_error = (mem_rows.get(name) or {}).get("error")
            reasons.append(f"memory stage failed: {memory_error}" if memory_error else "no memory results")
        probe = (inputs["eval"] or {}).get("probes", {}).get(domain) if not failure else None
        probe_unmeasured = _unmeasured(probe) if not failure and (probe or {}).get("status") != "ok" else None
        base_probe = ((base_inputs or {}).get("eval") or {}).get("probes", {}).get(domain)
        if not failure and not probe_unmeasured and (base_probe or {}).get("status") != "ok":
            # fp16 could not be measured here, or its sample log cannot give the row: nothing to pair with
            probe_unmeasured = _unmeasured(base_probe) or ({
                "reason": (base_probe or {}).get("reason") or "fp16's sample log has no answers on this row",
                "remedy": "give fp16's log this row's task and items (docs/evaluate.md, \"The baseline from a sample "
                          "log\")"} if ((base_inputs or {}).get("eval") or {}).get("baseline") else None)
        if not failure and (probe is None or probe.get("status") != "ok") and not probe_unmeasured:
            reasons.append(f"probe not run: {(probe or {}).get('reason', 'missing')}")
        if reasons:
            judged[domain] = {"verdict": "fail", "reasons": reasons, "policy": policy.model_dump()}
            continue
        if probe_unmeasured:
            judged[domain] = _unmeasured_row(probe_unmeasured, policy)
            continue
        fid = (inputs["eval"].get("fidelity") or {}).get(plan.get("domain", domain))
        tasks = {k: judged[k] for k, other in plans.items() if other.get("domain") == domain and k in judged}
        judged[domain] = compare_domain(by_id(base_inputs["items"], domain), by_id(inputs["items"], domain),
                                        probe, fid, mem, plan, policy, p, tasks, not_here)
    row["domains"] = {key: judged[key] for key in plans}
    verdicts = [d["verdict"] for d in row["domains"].values()]
    row["verdict"] = next((v for v in ("fail", "inconclusive") if v in verdicts), "pass") if verdicts else "fail"
    return row


def _unmeasured_row(unmeasured: dict, policy: PolicyParams) -> dict:
    """A row this machine could not measure: `inconclusive` with the remedy (never routed, never released)."""
    return {"verdict": "inconclusive", "unmeasured": unmeasured, "policy": policy.model_dump(),
            "reasons": [f"not measured on this machine: {unmeasured['reason']}"
                        + (f"; remedy: {unmeasured['remedy']}" if unmeasured["remedy"] else "")]}


def compare_all(variants: list[str], candidates: list[str], plans: dict[str, dict], p: CompareParams,
                results: Path, variants_dir: Path, judged_elsewhere: dict[str, list[str]] | None = None) -> dict:
    """compare.json: the baseline's own numbers, then every variant and candidate against it.
    `judged_elsewhere`: per log candidate, what its team measured elsewhere (params.yaml)."""
    names = [BASELINE, *[n for n in variants if n != BASELINE], *candidates]
    inputs = load_inputs(names, results, variants_dir)
    for name in candidates:
        inputs[name]["kind"] = "candidate"
    memory_path = results / MEMORY_SUMMARY.relative_to(RESULTS)
    memory = read_json(memory_path) if memory_path.is_file() else {}
    base_failure = _upstream_failure(inputs[BASELINE])[0]
    base_mem = memory.get("variants", {}).get(BASELINE)
    if base_failure is None and (base_mem is None or base_mem.get("status") != "ok"):
        base_failure = "no memory results"
    elif base_failure is None and not usable(base_mem.get("growth_bytes_per_round")):
        # fp16's soak stopped too early (an out-of-memory error, say): no growth for the variants to be held to
        base_failure = f"fp16's memory soak gave no growth rate ({base_mem.get('oom') or 'too few rounds'})"
    baseline = {"status": "failed" if base_failure else "ok", "error": base_failure,
                "memory": _memory_summary(base_mem, base_mem), "accuracy": {}}
    if (inputs[BASELINE]["eval"] or {}).get("evidence"):  # fp16's answers from its sample log (baseline_log.py)
        baseline["evidence"] = inputs[BASELINE]["eval"]["evidence"]
    if not base_failure:
        for domain in plans:
            rows = by_id(inputs[BASELINE]["items"], domain)
            baseline["accuracy"][domain] = float(np.mean([r.get("correct") is True for r in rows.values()])) if rows else None
    out = {"baseline": BASELINE, "fp16": baseline, "domains": [d for d in plans if not standard_tasks.is_task_row(d)],
           "plans": plan_summary(plans),
           "settings": {"confidence": p.confidence, "alpha": p.alpha, "spending": p.spending, "power": p.power},
           "variants": {}}
    for name in names[1:]:
        out["variants"][name] = compare_one(name, inputs[name], inputs[BASELINE], base_failure, memory, plans, p,
                                            (judged_elsewhere or {}).get(name))
    return out


def flat_rows(report: dict) -> list[dict]:
    """One row per variant and domain: the comparison as a table (MLflow, pandas, the docs)."""
    rows = []
    for name, v in report["variants"].items():
        for domain, d in v["domains"].items():
            paired = d.get("paired") or {}
            fid = d.get("fidelity") or {}
            rows.append({"variant": name, "domain": domain, "verdict": d["verdict"], "items": paired.get("items"),
                         "look": (d.get("looks") or {}).get("look"),
                         "accuracy_fp16": paired.get("accuracy_fp16"), "accuracy": paired.get("accuracy"),
                         "difference": paired.get("difference"), "ci_low": paired.get("ci_low"),
                         "ci_high": paired.get("ci_high"), "confidence": paired.get("confidence"),
                         "design_effect": paired.get("design_effect"), "correct_to_wrong": paired.get("correct_to_wrong"),
                         "wrong_to_correct": paired.get("wrong_to_correct"), "flip_rate": paired.get("flip_rate"),
                         "mcnemar_p": paired.get("mcnemar_p"), "items_to_decide": d.get("items_to_decide"),
                         "kl_mean": (fid.get("kl") or {}).get("mean"), "kl_p99": (fid.get("kl") or {}).get("p99"),
                         "same_top1": fid.get("same_top1"),
                         "growth_excess_pct": (v.get("memory") or {}).get("growth_excess_pct"),
                         "footprint_saving_pct": (v.get("memory") or {}).get("footprint_saving_pct"),
                         "reasons": "; ".join(d["reasons"])})
    return rows


def summary(report: dict) -> dict:
    """results/summary.json, the pipeline's only DVC metrics: per variant and request type the verdict, the
    difference, the interval's low end and the items; per variant the memory saving and growth excess; and the
    gate's verdict on these rows (what `quantgate gate` says unless it finds the workspace changed since: it checks
    `dvc status` and re-derives every row, compare only judged them). Verdicts come first, so `dvc exp show --only-changed` at a terminal's width
    shows the rows whose verdict changed before the numbers; compare.json keeps everything else."""
    def rounded(value, digits: int):
        return round(float(value), digits) if usable(value) else None

    def per_row(pick) -> dict:
        return {name: {domain: pick((v["domains"].get(domain) or {})) for domain in report["domains"]}
                for name, v in report["variants"].items()}

    baseline_ok = (report.get("fp16") or {}).get("status") == "ok"
    gate = worst(v["verdict"] for v in report["variants"].values()) if baseline_ok else "undecided"
    memory = {name: v.get("memory") or {} for name, v in report["variants"].items()}
    return {"gate": gate,
            "verdict": per_row(lambda d: d.get("verdict")),
            "difference": per_row(lambda d: rounded((d.get("paired") or {}).get("difference"), 3)),
            "ci_low": per_row(lambda d: rounded((d.get("paired") or {}).get("ci_low"), 3)),
            "items": per_row(lambda d: (d.get("paired") or {}).get("items")),
            "memory_saving_pct": {n: rounded(m.get("footprint_saving_pct"), 1) for n, m in memory.items()},
            "growth_excess_pct": {n: rounded(m.get("growth_excess_pct"), 2) for n, m in memory.items()}}
