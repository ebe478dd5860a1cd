"""`quantgate gate`: the release verdict CI gates on, failing closed.

Exit 0: every gated variant passed every domain. Exit 1: something failed (a verdict, a missing or
non-numeric required metric, a refused promotion). Exit 2: it could not decide (no usable baseline,
the workspace differs from what DVC recorded, compare.json disagrees with its own numbers or with the
per-item records, an `inconclusive` verdict, any exception inside the gate).
The gate decides only on the workspace it stands in (DVC's own status must be clean) and never trusts
a verdict field: it re-derives each verdict from compare.json's numbers with the rules compare judged by
(judging/verdict.py), and recomputes compare.json from the per-item records (judging/comparison.py).
"""

from __future__ import annotations

import shlex

from pipelines.core import lineage
from pipelines.core.params import Params
from pipelines.core.paths import BASELINE
from pipelines.evaluation import standard_tasks
from pipelines.judging.verdict import check_row, inconsistencies, shadow_failures, usable, worst

EXIT = {"pass": 0, "fail": 1, "undecided": 2}


def rerun_command(judged: object, judged_digest: object, now: dict | None) -> str:
    """The `dvc repro` that makes results and verdicts agree again: the stages whose dvc.lock entry changed after
    compare.json was made, forced, and every stage after them. Forced, because DVC cannot tell a stage that
    re-ran to the same bytes from a hand-made `dvc commit -f`; re-running it makes its outputs true again.
    `judged` (compare.json's per-stage digests) is trusted only when it hashes to compare.json's own digest;
    otherwise, or when no stage can be named, everything is re-run."""
    valid = (isinstance(judged, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in judged.items())
             and lineage.digest_of_stages(judged) == judged_digest)
    changed = [name for name, digest in (now or {}).items() if judged.get(name) != digest] if valid else []
    return f"dvc repro --force --downstream {' '.join(map(shlex.quote, changed))}" if changed else "dvc repro --force"


def decide(report: dict | None, fresh: dict | None, params: Params, changes: list[str], upstream_digest: str | None,
           gated: list[str] | None = None, upstream_stages: dict | None = None, shadow: dict | None = None,
           table: dict | None = None, served: list[str] | None = None) -> dict:
    """The release verdict over the gated variants (default: every variant and candidate).

    report: compare.json as found; fresh: compare recomputed now from the workspace's files; changes: what
    DVC's status says differs from dvc.lock; upstream_digest/upstream_stages: dvc.lock's entries of the stages
    before compare, now (lineage); shadow/table: results/shadow.json and the routing table (a variant whose replay
    failed, or that the replay refused for every request type, fails: verdict.shadow_failures); served: what a served
    model's server answers otherwise than when it was evaluated (evaluation/redeploy.py). Anything stale or
    inconsistent is `undecided`, never `pass`.
    """
    names = gated or [*[n for n in params.variants if n != BASELINE], *params.candidates]
    result = {"verdict": "undecided", "gated": names, "reasons": [], "variants": {}}
    if changes:
        result["reasons"] += ["the workspace differs from what DVC recorded in dvc.lock; run dvc repro:"]
        result["reasons"] += [f"  {c}" for c in changes]
        return result
    if served:
        result["reasons"] += ["a served model is not what was evaluated (DVC hashes its deployment spec, not its "
                              "server):", *[f"  {line}" for line in served]]
        return result
    if untracked := standard_tasks.untracked_data(params.evaluate.tasks):
        result["reasons"] += untracked
        return result
    if report is None:
        result["reasons"].append("no comparison results (results/compare.json): run dvc repro")
        return result
    if upstream_digest is None:
        result["reasons"].append("no dvc.lock: these results were not made by dvc repro; run dvc repro")
        return result
    if report.get("dvc_lock_sha256") != upstream_digest:
        command = rerun_command(report.get("dvc_lock_stages"), report.get("dvc_lock_sha256"), upstream_stages)
        result["reasons"].append(
            "results/compare.json was not made from the results dvc.lock records: a stage before compare re-ran on a "
            "changed input and wrote the same outputs, so DVC did not judge again, or dvc.lock was committed by hand; "
            f"re-run what changed and everything after it: {command}")
        return result
    if list(report.get("domains") or []) != list(params.evaluate.domains):
        result["reasons"].append(f"compare.json judges domains {report.get('domains')}, params.yaml asks for "
                                 f"{params.evaluate.domains}: run dvc repro")
        return result
    if fresh is None or report.get("plans") != fresh.get("plans") or report.get("settings") != fresh.get("settings"):
        result["reasons"].append("compare.json's look plans or statistics settings differ from params.yaml and the "
                                 "probe items: run dvc repro")
        return result
    if (fresh.get("fp16") or {}).get("status") != "ok" or (report.get("fp16") or {}).get("status") != "ok":
        # nothing to judge against says nothing about the variants: could not decide, not their failure
        result["reasons"].append(f"baseline fp16 missing or failed: {(fresh.get('fp16') or {}).get('error')}")
        return result
    outcomes, broken = [], []
    for name in names:
        row = (report.get("variants") or {}).get(name)
        fresh_row = (fresh.get("variants") or {}).get(name)
        per_domain = {}
        for domain in params.evaluate.domains:
            d = ((row or {}).get("domains") or {}).get(domain)
            if d is not None:
                broken += inconsistencies(name, domain, d, ((fresh_row or {}).get("domains") or {}).get(domain),
                                          (row or {}).get("memory"), params)
            verdict, why = check_row(name, domain, d, params)
            per_domain[domain] = verdict
            outcomes.append(verdict)
            result["reasons"].extend(why)
        replay = shadow_failures(name, shadow, table)
        outcomes += ["fail"] * bool(replay)
        result["reasons"].extend(replay)
        replayed = ((shadow or {}).get("models") or {}).get(name) or {}
        if replayed.get("status") == "not_measured":  # a candidate judged from its sample log: said, never skipped
            result["reasons"].append(f"{name}: {replayed.get('reason')}; the routing table serves nothing from it")
        verdicts = [*per_domain.values(), *(["fail"] if replay else [])]
        result["variants"][name] = {"verdict": worst(verdicts), "domains": per_domain}
    if broken:
        result["verdict"] = "undecided"
        result["reasons"] = ["compare.json is not what its numbers and the workspace's per-item records give: "
                             "run dvc repro (and do not edit results by hand)"] + broken
        return result
    result["verdict"] = worst(outcomes) if outcomes else "undecided"
    if not outcomes:
        result["reasons"].append("nothing to gate: no variants or candidates")
    return result


def _fmt(value, spec: str) -> str:
    """A number for the report; anything else shown as what it is, so a bad value is visible, not fatal."""
    if not usable(value):
        return f"`{value!r}`"
    return format(int(value) if spec == "d" else value, spec)


def shadow_lines(table: dict, policy_for=None) -> list[str]:
    """report.md's "Shadow replay": per routed (type, variant) the exact agreement with fp16 on the replayed traffic
    and whether it met the policy's min_agreement, and each variant the replay refused. Empty for a routing table
    built before route listened to the shadow replay."""
    rows = table.get("rows") or []
    if not any("shadow" in r for r in rows):
        return []
    routed: dict[tuple, list] = {}
    refused: dict[tuple, list] = {}
    for r in rows:
        s = r.get("shadow")
        if r.get("serve") != BASELINE and s:
            routed.setdefault((r["domain"], r["serve"], s.get("bucket")), [s]).append(r["max_context_tokens"])
        for c in r.get("considered") or []:
            if c.get("shadow_refused"):
                refused.setdefault((r["domain"], c["variant"], c["shadow_refused"]), []).append(r["max_context_tokens"])
    lines = ["### Shadow replay", ""]
    if routed:
        lines += ["| type | ≤ tokens | variant | replayed (bucket) | exact agreement [interval] | min_agreement |",
                  "|---|---|---|---|---|---|"]
    for (domain, variant, bucket), (s, *tokens) in routed.items():
        exact = s.get("exact") or {}
        need = getattr(policy_for(domain), "min_agreement", None) if policy_for else None
        met = "n/a" if not usable(need) or not usable(exact.get("share")) else \
            f"{'met' if exact['share'] >= need else '**not met**'} ({need:.2f})"
        lines.append(f"| {domain} | {', '.join(map(str, tokens))} | {variant} | {_fmt(s.get('requests'), 'd')} ({bucket}) | "
                     f"{_fmt(exact.get('share'), '.3f')} [{_fmt(exact.get('low'), '.3f')}, {_fmt(exact.get('high'), '.3f')}] | {met} |")
    if not routed:
        lines.append("No variant routed: fp16 serves every type.")
    lines += [""] + [f"- refused by the replay: {variant} for {domain} (≤ {', '.join(map(str, tokens))} tokens): {why}"
                     for (domain, variant, why), tokens in refused.items()]
    return lines + ([""] if refused else [])


def fleet_lines(table: dict) -> list[str]:
    """report.md's "Fleet plan": the deployments route chose and its saving beside fp16 alone, the rows' own choices
    and the best single variant (pipelines/routing/fleet.py); empty for a table without a plan."""
    fleet = table.get("fleet")
    if not fleet:
        return []
    lines = ["### Fleet plan", "", "| plan | deployments | deployed | fleet memory saved vs fp16 alone |",
             "|---|---|---|---|"]
    lines += [f"| {a['plan']} | {a['deployments']} | {' + '.join(a['deployed'])} | {_fmt(a['saving_pct'], '+.2f')} % |"
              for a in fleet["alternatives"]]
    s = fleet.get("stability") or {}
    lines += [""] + [f"- {note}" for note in fleet.get("notes") or []]
    lines += ["", f"Footprints moved by up to ±{_fmt(s.get('noise_bytes'), ',.0f')} B (memory.noise_floor_bytes), "
                  f"{s.get('draws')} draws: {_fmt(s.get('mean_changed_rows'), '.2f')} of {s.get('rows')} rows change "
                  f"server on average, {s.get('max_changed_rows')} at most.", ""]
    return lines


def render_report(result: dict, report: dict | None, table: dict | None, policy_for=None) -> str:
    """results/report.md: the verdict, the per-domain evidence, the routing table and the shadow replay behind it,
    for a pull request (`policy_for`: params.compare.policy_for, for each type's min_agreement)."""
    head = {"pass": "PASS", "fail": "FAIL", "undecided": "UNDECIDED (counts as a failure)"}[result["verdict"]]
    lines = [f"## quantgate release gate: {head}", ""]
    lines.append(f"Gated: {', '.join(result['gated']) or 'nothing'}. Results digest `{(result.get('results_digest') or 'none')[:12]}`"
                 + (f", commit `{result['git']['commit'][:10]}`" if (result.get("git") or {}).get("commit") else "") + ".")
    if result.get("mlflow_run_id"):
        lines.append(f"MLflow parent run `{result['mlflow_run_id']}` (experiment `{result.get('experiment')}`).")
    lines.append("")
    if report and report.get("variants"):
        lines += ["| variant | domain | verdict | items (look) | accuracy (fp16) | difference [interval] | flips −/+ | KL p99 | growth excess |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name in result["gated"]:
            for domain, d in (((report["variants"].get(name) or {}).get("domains")) or {}).items():
                p, fid = d.get("paired"), d.get("fidelity") or {}
                if not p:
                    lines.append(f"| {name} | {domain} | **{d['verdict']}** | – | – | – | – | – | – |")
                    continue
                growth = ((d.get("checks") or {}).get("growth_excess_pct") or {}).get("value")
                looks, not_here = d.get("looks") or {}, d.get("not_checked_here") or {}
                lines.append(f"| {name} | {domain} | **{d['verdict']}** | {_fmt(p.get('items'), 'd')} "
                             f"({looks.get('look')} of {len(looks.get('looks') or [])}) | {_fmt(p.get('accuracy'), '.3f')} "
                             f"({_fmt(p.get('accuracy_fp16'), '.3f')}) | {_fmt(p.get('difference'), '+.3f')} "
                             f"[{_fmt(p.get('ci_low'), '+.3f')}, {_fmt(p.get('ci_high'), '+.3f')}] "
                             f"({_fmt(100 * p['confidence'] if usable(p.get('confidence')) else None, '.1f')} %) | "
                             f"{_fmt(p.get('correct_to_wrong'), 'd')}/{_fmt(p.get('wrong_to_correct'), 'd')} | "
                             + ("not measured here | " if "fidelity" in not_here else
                                f"{_fmt((fid.get('kl') or {}).get('p99'), '.3g')} | ")
                             + ("not measured here |" if "memory" in not_here else f"{_fmt(growth, '+.2f')} % |"))
        lines.append("")
        forwards = [(n, (report["variants"].get(n) or {}).get("forward")) for n in result["gated"]]
        lines += [f"{n} was evaluated with {f}." for n, f in forwards if f] + ([""] if any(f for _, f in forwards) else [])
    elsewhere = {n: (report or {}).get("variants", {}).get(n, {}).get("evidence") for n in result["gated"]}
    base = ((report or {}).get("fp16") or {}).get("evidence")
    if any(elsewhere.values()) or base:  # evaluated elsewhere (pipelines/evaluation/sample_logs.py, endpoints.py)
        lines += ["### Evidence from sample logs and endpoints", ""] + ([
            (f"- fp16 (the baseline): served at {base.get('base_url')} as `{base.get('model')}`, evaluated here by "
             f"lm-eval's `{base.get('backend')}` (its server asked again by this gate)" if base.get("base_url") else
             f"- fp16 (the baseline): lm-eval sample log, backend `{base.get('backend')}`, model_args "
             f"`{base.get('model_args')}`, lm-eval {base.get('lm_eval_version')}") + ": every item checked against the "
            "tasks here and scored again; no token distributions, so KL is not measured for any model, and the audit "
            "cannot re-run fp16"] if base else []) + [
            (f"- {n}: served at {e.get('base_url')} as `{e.get('model')}`, evaluated here by lm-eval's "
             f"`{e.get('backend')}` (prompt logprobs: {'yes' if e.get('logprobs') else 'no'}) and replayed through it; "
             "KL, memory and the audit's re-run need the weights here and were not measured" if e.get("base_url") else
             f"- {n}: lm-eval sample log, backend `{e.get('backend')}`, model_args `{e.get('model_args')}`, lm-eval "
             f"{e.get('lm_eval_version')}: paired with fp16 here; KL, memory, the shadow replay and the audit's re-run "
             "need a model here and were not measured") + " (the reasons say what that leaves)"
            for n, e in elsewhere.items() if e]
        lines.append("")
    if result["reasons"]:
        lines += ["### Why", ""] + [f"- {r}" for r in result["reasons"]] + [""]
    growth = [((report or {}).get("variants", {}).get(n, {}).get("memory") or {}).get("growth_cause")
              for n in result["gated"]]
    if any(growth):  # why memory grows: pipelines/measure/attribution.py
        lines += ["### Memory growth", ""] + [f"- {g}" for g in growth if g] + [""]
    if result.get("promotion"):
        promo = result["promotion"]
        lines += ["### Promotion", "", f"- {promo['status']}: {promo['detail']}", ""]
    if table:
        lines += fleet_lines(table)
        lines += ["### Routing table", "", "| domain | ≤ tokens | serve | fallback under memory pressure | alone |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['domain']} | {r['max_context_tokens']} | {r['serve']} | {r['fallback_under_memory_pressure']} "
                  f"| {r.get('row_by_row', r['serve'])} |" for r in table["rows"]]
        lines.append("")
        lines += shadow_lines(table, policy_for)
    return "\n".join(lines)


def _audit(params, variant: list[str] | None, seed: int | None) -> dict:
    """`quantgate audit` inside the gate: the same floor function, its result kept in results/audit.json."""
    import os

    from pipelines.core.io import write_json
    from pipelines.core.paths import AUDIT_RESULT
    from pipelines.evaluation.remeasure import audit, describe
    from pipelines.models.loading import resolve_device

    names = [n for n in [BASELINE, *params.variants, *params.candidates]
             if n == BASELINE or not variant or n in variant]
    names = list(dict.fromkeys(names))
    seed = int.from_bytes(os.urandom(8), "big") if seed is None else seed
    print(f"quantgate gate: audit seed {seed}", flush=True)
    found = audit(params, names, seed, resolve_device(params.device))  # its child shows the progress
    write_json(AUDIT_RESULT, found)
    return {"verdict": found["verdict"], "seed": seed, "lines": [describe(p) for p in found["problems"]],
            "skipped": [f"{name}: {why}" for name, why in found["skipped"].items()],
            "largest_difference": found["largest_difference"]}


def main(variant: list[str] | None = None, promote: bool = False, audit: bool = False,
         audit_seed: int | None = None) -> int:
    """`quantgate gate`: the release verdict; exit 0 pass, 1 fail, 2 could not decide (any exception included).
    `audit`: first re-measure a sample of the evidence (evaluation/remeasure.py); records that disagree: exit 2."""
    import logging
    import os
    import sys

    from pipelines.core.io import atomic_write_text, read_json, write_json
    from pipelines.core.paths import GATE_REPORT, GATE_RESULT

    result = {"verdict": "undecided", "gated": variant or [], "results_digest": None, "reasons": []}
    report = fresh = table = policy_for = None
    try:
        from pipelines.core.errors import QuantgateError
        from pipelines.core.lineage import lock_digest, recorded_commit, results_digest, stage_digests, workspace_changes
        from pipelines.core.params import load_params
        from pipelines.core.paths import COMPARE_REPORT, MLFLOW_RUN, RESULTS, ROUTING_TABLE, SHADOW_REPORT, VARIANTS_DIR
        from pipelines.evaluation.plans import probe_plans
        from pipelines.evaluation.redeploy import stale_endpoints
        from pipelines.judging.comparison import compare_all
        from pipelines.models.gguf import stale_model

        params = load_params()
        policy_for = params.compare.policy_for
        unknown = [n for n in variant or [] if n not in params.variants and n not in params.candidates]
        if unknown:
            raise QuantgateError(f"--variant {unknown[0]!r} is neither a variant nor a candidate in params.yaml")
        if BASELINE in (variant or []):
            raise QuantgateError(f"--variant {BASELINE}: fp16 is the baseline every variant is judged against")
        changes = workspace_changes() + stale_model()  # a GGUF model lies outside the repository: DVC cannot hash it
        report = read_json(COMPARE_REPORT) if COMPARE_REPORT.is_file() else None
        table = read_json(ROUTING_TABLE) if ROUTING_TABLE.is_file() else None
        # each served model's server asked again; not a candidate that fails anyway (its server cannot change that)
        failing = {n for n, v in ((report or {}).get("variants") or {}).items() if (v or {}).get("verdict") == "fail"}
        served = [] if changes else stale_endpoints(params, [n for n in variant or params.candidates if n not in failing])
        if not changes:  # recompute the comparison from the per-item records: the same function compare ran
            fresh = compare_all(list(params.variants), list(params.candidates),
                                probe_plans(params.evaluate.domains, params.evaluate), params.compare, RESULTS,
                                VARIANTS_DIR, params.judged_elsewhere())
        shadow = read_json(SHADOW_REPORT) if SHADOW_REPORT.is_file() else None
        result = decide(report, fresh, params, changes, lock_digest(), variant or None, stage_digests(), shadow, table,
                        served)
        if audit and not changes and not served:  # undecided already: a stale workspace's checkpoints are not DVC's
            result["audit"] = _audit(params, variant, audit_seed)
            if result["audit"]["verdict"] != "ok":
                result["verdict"] = "undecided"
                result["reasons"] = ["the audit re-measured recorded evidence and it disagrees (results/audit.json; "
                                     "repeat with --audit-seed {}): re-run the stages named, do not edit results"
                                     .format(result["audit"]["seed"]), *result["audit"]["lines"], *result["reasons"]]
            result["reasons"] += [f"audit: {line}" for line in result["audit"]["skipped"]]
        digest = results_digest()
        result["results_digest"] = digest
        result["git"] = recorded_commit()  # as record tags it: a workspace's checkout commit
        if MLFLOW_RUN.is_file():
            run = read_json(MLFLOW_RUN)
            if run.get("results_digest") == digest:
                result.update(mlflow_run_id=run.get("parent_run_id"), experiment=params.mlflow.experiment)
        if promote:
            if result["verdict"] == "pass":
                from pipelines.store.promotion import promote_candidate
                from pipelines.store.tracking import tracking_uri

                result["promotion"] = promote_candidate(tracking_uri(), params.registered_model_name(), result, params,
                                                        digest)
                if result["promotion"]["status"] == "refused":
                    result["verdict"] = "fail"
                    result["reasons"].append(f"promotion refused: {result['promotion']['detail']}")
            else:
                result["promotion"] = {"status": "refused", "detail": f"the gate did not pass ({result['verdict']})"}
    except Exception as err:  # noqa: BLE001 - fail closed: any error is "could not decide", exit 2
        logging.getLogger("pipelines").debug("gate error", exc_info=True)
        result["verdict"] = "undecided"
        result["reasons"].append(f"the gate could not finish: {type(err).__name__}: {err}")
    result["exit_code"] = EXIT[result["verdict"]]
    try:
        write_json(GATE_RESULT, result)
        atomic_write_text(GATE_REPORT, render_report(result, fresh or report, table, policy_for))
    except Exception as err:  # noqa: BLE001
        print(f"quantgate gate: could not write results/gate.json: {err}", file=sys.stderr)
        return 2
    lines = [f"quantgate gate: {result['verdict'].upper()} (exit {result['exit_code']}) for "
             f"{', '.join(result['gated']) or 'nothing'}", *[f"  - {reason}" for reason in result["reasons"][:12]]]
    if len(result["reasons"]) > 12:
        lines.append(f"  ... {len(result['reasons']) - 12} more in results/gate.json")
    if result.get("promotion"):
        lines.append(f"  promotion: {result['promotion']['status']}: {result['promotion']['detail']}")
    lines.append("  results/gate.json, results/report.md")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `quantgate gate | head -1`: the reader left, the verdict's exit code stands
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return result["exit_code"]
