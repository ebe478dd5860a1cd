"""Blocks from the other stages' results: evaluate, memory, quantize, calibration and the reference model."""

from __future__ import annotations

import json

from .format import count, minus, pct, small, span, table, words
from .sources import Context

# ---------------------------------------------------------------- results: evaluate

def eval_result(ctx: Context, variant: str) -> dict:
    return ctx.json(f"results/eval/{variant}.json", f"stage:evaluate@{variant}")


def render_eval_accuracy(ctx: Context, arg: str, old: list[str]) -> list[str]:
    report = ctx.json("results/compare.json", "stage:compare")
    domains = list(report.get("domains") or [])
    variants = ["fp16", *[v for v, x in (report.get("variants") or {}).items() if x.get("kind") != "candidate"]]
    results = {v: eval_result(ctx, v) for v in variants}
    fam = {}
    for d in domains:
        items = ctx.read(f"eval/{d}/items.jsonl").splitlines()
        fam[d] = (len(items), len({json.loads(x).get("family", json.loads(x).get("id")) for x in items}))
    rows = [["pool (families)", *[f"{count(fam[d][0])} ({fam[d][1]})" for d in domains]]]
    probes = results["fp16"].get("probes") or {}
    rows.append(["fp16, whole pool", *[f"{probes[d]['score']:.3f}" if d in probes else "–" for d in domains]])
    answered = {}
    for v in variants[1:]:
        probes = results[v].get("probes") or {}
        rows.append([f"{v} (items)", *[f"{probes[d]['score']:.3f} ({count(probes[d]['items'])})"
                                       if probes.get(d, {}).get("score") is not None else "–" for d in domains]])
        answered[v] = sum(probes[d]["items"] for d in domains if d in probes)
    lines = table(["", *domains], rows)
    baseline = sum((results["fp16"].get("probes") or {}).get(d, {}).get("items", 0) for d in domains)
    if answered and baseline:
        total = baseline + sum(answered.values())
        lines += ["", f"The baseline and the {len(answered)} variants answered {count(baseline)} + "
                      f"{' + '.join(count(n) for n in answered.values())} items: the looks spared "
                      f"{100 * (1 - total / (baseline * (len(answered) + 1))):.0f} % of what evaluating all "
                      f"{len(answered) + 1} on every pool would cost "
                      f"({100 * (1 - sum(answered.values()) / (baseline * len(answered))):.0f} % of the variants' share)."]
    return lines


def render_eval_fidelity(ctx: Context, arg: str, old: list[str]) -> list[str]:
    report = ctx.json("results/compare.json", "stage:compare")
    domains = list(report.get("domains") or [])
    rows, tokens = [], {}
    for v, x in (report.get("variants") or {}).items():
        if x.get("kind") == "candidate":
            continue
        fid = (eval_result(ctx, v).get("fidelity") or {})
        fs = [fid[d] for d in domains if (fid.get(d) or {}).get("kl")]
        if not fs:
            continue
        for d in domains:
            if fid.get(d):
                tokens[d] = fid[d].get("tokens")
        rows.append([v, span([f["kl"]["mean"] for f in fs], small), span([f["kl"]["p99"] for f in fs], small),
                     span([f["kl"]["max"] for f in fs], small),
                     span([f["same_top1"] for f in fs], lambda x: f"{100 * x:.1f}") + " %"])
    scored = ", ".join(f"{d} {count(t)}" for d, t in tokens.items() if t)
    return [f"Scored tokens per domain: {scored}.", ""] + table(["variant", "KL mean", "KL p99", "KL max", "same top-1"],
                                                             rows)


# ---------------------------------------------------------------- results: memory, quantize

def render_memory(ctx: Context, arg: str, old: list[str]) -> list[str]:
    summary = ctx.json("results/memory_summary.json", "stage:memory-report")
    rows, notes = [], []
    for v, s in (summary.get("variants") or {}).items():
        if s.get("status") != "ok":
            rows.append([v, *["–"] * 11])
            notes.append(f"{v}: {s.get('status')} ({s.get('error') or 'no reason recorded'})")
            continue
        detail = ctx.json(f"results/memory/{v}.json", f"stage:memory@{v}")
        heap = (detail.get("soak") or {}).get("growth_last_minus_first")
        rate = s.get("growth_bytes_per_round") or 0
        counted = (f"{rate:,.0f} B/round" if rate else "0 (settled)" if s.get("warmup_end_round") else "0")
        excess = s.get("growth_excess_pct")
        rows.append([v, count(s["footprint_bytes"]), count(s["theoretical_weight_bytes"]),
                     f"{s['fitted_bytes_per_token']:.0f}", count(s["theoretical_kv_bytes_per_token"]),
                     str(s.get("measured_rounds", "–")), str(s.get("warmup_end_round", "–")),
                     minus(f"{heap / 1024:+.1f} KiB") if heap is not None else "–", counted,
                     "0" if not excess else minus(f"{excess:+.2f} %"), "yes" if s.get("leak") else "no",
                     f"{s['fragmentation']:.3f}" if s.get("fragmentation") is not None else "–"])
        reason = (detail.get("leak") or {}).get("reason")
        if reason and s.get("warmup_end_round"):
            notes.append(f"{v}: {reason}")
    lines = table(["variant", "footprint (tensor bytes)", "theory", "KV fitted B/token", "theory", "measured rounds",
                   "warm-up ended at round", "heap over the soak (first → last round)", "growth rate counted",
                   "growth excess vs fp16", "leak", "1 − alloc/reserved"], rows)
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return lines


def render_quantize(ctx: Context, arg: str, old: list[str]) -> list[str]:
    summary = ctx.json("results/memory_summary.json", "stage:memory-report")
    rows = []
    made = list((ctx.yaml("params.yaml") or {}).get("variants") or {})  # quantize@<variant>; candidates are admitted
    for v in [v for v in summary.get("variants") or {} if v in made]:
        q = ctx.json(f"results/quantize/{v}.json", f"stage:quantize@{v}")
        s = summary["variants"][v]
        peak = (q.get("peak_memory_bytes") or {}).get("peak_rss")
        rows.append([v, q.get("status", "?"), f"{q['quantize_seconds']:.1f}" if q.get("quantize_seconds") else "–",
                     count(s["theoretical_weight_bytes"]) + " B" if s.get("theoretical_weight_bytes") else "–",
                     count(s["footprint_bytes"]) + " B" if s.get("footprint_bytes") else "–",
                     f"{peak / 2**20:,.0f} MiB" if peak else "–"])
    return table(["variant", "status", "quantize s", "theoretical weight bytes", "load footprint (tensor bytes)",
                  "peak RSS while quantizing"], rows)


# ---------------------------------------------------------------- results: calibration, reference

def render_coverage(ctx: Context, arg: str, old: list[str]) -> list[str]:
    cov = ctx.json("results/calibration/coverage.json", "stage:calibrate")
    rows = [[d, pct(x["production_share"]), pct(x["calibration_share"]), f"{x['share_ratio']:.2f}",
             pct(x["ngram_coverage"]), "**flagged**" if x.get("under_represented") else "covered"]
            for d, x in sorted((cov.get("domains") or {}).items())]
    lines = [f"{count(cov['traffic_requests'])} production requests; rule: {cov.get('rule', '?')}.", ""]
    lines += table(["domain", "production share", "calibration share", "ratio", "n-gram coverage", "flag"], rows)
    verdict = "covered" if cov.get("covered") else "under-represented: " + ", ".join(cov.get("under_represented") or [])
    lines += ["", f"Overall: {verdict} (`coverage.on_gap: {cov.get('on_gap')}`)."]
    unknown = cov.get("unknown")
    if unknown:  # what no declared type claims: served by fp16, measured by no probe
        lines[-1] += (f" Claimed by no request type (`unknown`, served by fp16): {pct(unknown['production_share'])}"
                      f" ({count(unknown['production_requests'])} requests), "
                      + ("**flagged**" if unknown["flagged"] else "not flagged")
                      + f" (`coverage.max_unknown_share: {unknown['max_share']}`).")
    return lines


def render_classifier(ctx: Context, arg: str, old: list[str]) -> list[str]:
    c = ctx.json("results/calibration/classifier.json", "stage:calibrate")
    per = ", ".join(f"{t} {x['correct']}/{x['requests']}" for t, x in (c.get("types") or {}).items())
    flagged = c.get("flagged") or []
    return [f"On the shipped sample ({count(c['labelled_requests'])} labelled requests) the classifier names "
            f"{count(c['correct'])} right ({pct(c['accuracy'])}): {per}; of the declared types' requests "
            f"{c.get('unknown', 0)} came out unknown, {c.get('ambiguous', 0)} ambiguous; "
            + (f"flagged: {words(flagged)}." if flagged else "no type below the threshold.")]


REFERENCE_SKILLS = [("held-out two-digit additions, exact match", "addition_exact_match", "addition_items"),
                    ("held-out Chinese-commented functions, body exact match", "code_comment_accuracy",
                     "code_comment_items"),
                    ("held-out small functions, tests pass", "function_pass_rate", "function_items"),
                    ("customer-service intent, 4 choices", "chat_accuracy", "chat_items")]


def render_reference(ctx: Context, arg: str, old: list[str]) -> list[str]:
    report = ctx.json("results/reference.json", "stage:reference")
    if report.get("status") == "skipped":
        return ["`model` is not `reference`: the reference stage trained nothing (results/reference.json)."]
    recipe = json.loads(ctx.read("reference_model/recipe.json", "`python scripts/make_reference.py`"))
    rows = [[name, pct(report[key]), count(report[n])] for name, key, n in REFERENCE_SKILLS if key in report]
    trained = [f"{count(report['parameters'])} parameters"]
    if recipe.get("train_seconds"):
        trained.append(f"trained in {recipe['train_seconds']:.1f} s")
    if report.get("final_loss") is not None:
        trained.append(f"final loss {report['final_loss']:.3f}")
    if recipe.get("torch"):
        trained.append(f"torch {recipe['torch']}")
    if report.get("chat_chance"):
        rows = [[r[0] + (f" (chance {pct(report['chat_chance'], 0)})" if r[0].startswith("customer") else ""), *r[1:]]
                for r in rows]
    return [f"The {report.get('source', 'built')} model: {', '.join(trained)}.", ""] + \
        table(["skill", "measured", "items"], rows)


def render_reference_history(ctx: Context, arg: str, old: list[str]) -> list[str]:
    commit = arg.strip()
    report = ctx.at_commit(commit, "reference_model/recipe.json").get("report") or {}
    rows = [[name, pct(report[key]), count(report[n])] for name, key, n in REFERENCE_SKILLS if key in report]
    return table(["skill (model of that commit)", "measured", "items"], rows)


# ---------------------------------------------------------------- results: shadow replay

def render_shadow_agreement(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """Per replayed variant and request type: exact agreement with fp16 [Wilson 95 %] over N, similarity, outcome."""
    report = ctx.json("results/shadow.json", "stage:shadow")
    models = {n: m for n, m in report["models"].items() if m.get("agreement")}
    types = sorted({t for m in models.values() for t in m["agreement"]})
    rows = []
    for name, m in models.items():
        cells = []
        for t in types:
            c = (m["agreement"].get(t) or {}).get("all")
            if not c:
                cells.append("–")
                continue
            e = c["exact"]
            out = f"; outcome {c['outcome']['share']:.2f}" if c.get("outcome") else ""
            cells.append(f"{e['share']:.2f} [{e['low']:.2f}, {e['high']:.2f}] of {c['requests']}, "
                         f"similarity {c['similarity']['mean']:.2f}{out}")
        rows.append([name, *cells])
    failed = [f"{n} ({m.get('error')})" for n, m in report["models"].items() if m.get("status") != "ok"]
    t = report["traffic"]
    lines = [f"{count(t['replayed'])} of {count(t['requests'])} requests replayed ({t['skipped']['too_long']} too long "
             f"for the context), {report['settings']['max_new_tokens']} new tokens each, greedy.", ""]
    lines += table(["variant", *types], rows)
    if failed:
        lines += ["", "Replay failed: " + "; ".join(failed)]
    return lines


def render_fleet_plan(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """The fleet plan beside its alternatives (deployments, fleet memory, saving against fp16 alone), the best plan
    per deployment count, and the plan's stability under the memory stage's footprint noise."""
    fleet = ctx.json("results/routing_table.json", "stage:route")["fleet"]
    f = fleet["fleet"]
    lines = [f"Fleet: {f['requests_in_flight']} requests in flight, {f['requests_per_replica']} per replica, a KV "
             f"pool of {count(f['kv_pool_tokens'])} tokens and {f['standby_replicas']:g} standby replica per "
             "deployment (params.yaml `route.fleet`).", ""]
    rows = [[a["plan"], a["deployments"], " + ".join(a["deployed"]), f"{a['fleet_bytes'] / 2**20:,.1f} MiB",
             f"{a['saving_pct']:+.2f} %"] for a in fleet["alternatives"] + fleet["by_deployments"]
            if a["fleet_bytes"] is not None and a["saving_pct"] is not None]
    lines += table(["plan", "deployments", "deployed", "fleet memory", "saved against fp16 alone"], rows)
    s = fleet["stability"]
    earns = "; ".join(f"{v} earns {b / 2**20:,.2f} MiB" for v, b in fleet["earns_bytes"].items() if b is not None)
    lines += ["", (f"{earns}. " if earns else "") + f"Noise margin {fleet['noise_margin_bytes'] / 2**10:,.0f} KiB: "
              f"with every footprint moved by up to ±{count(s['noise_bytes'])} B ({s['draws']} draws), "
              f"{s['mean_changed_rows']:.2f} of {s['rows']} rows change server on average, {s['max_changed_rows']} "
              f"at most, in {100 * s['share_of_draws_with_a_change']:.0f} % of draws."]
    return lines
