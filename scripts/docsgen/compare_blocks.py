"""Blocks from results/compare.json: the verdict table, its summaries, the gate's exit code, and how rows moved
since an older commit."""

from __future__ import annotations

from .format import count, interval, minus, pct, signed, small, span, table, words
from .sources import Context


def compare_rows(report: dict):
    """(variant, row name, row) for every variant and candidate, domains in declaration order, task rows after
    their domain."""
    order = list(report.get("domains") or [])
    for name, v in (report.get("variants") or {}).items():
        rows = v.get("domains") or {}
        names = [d for d in order if d in rows]
        for d in list(names):
            names[names.index(d) + 1:names.index(d) + 1] = [t for t in rows if t.startswith(d + ":")]
        names += [r for r in rows if r not in names]
        for r in names:
            yield name, r, rows[r]


def margin_of(row: dict) -> float | None:
    return ((row.get("policy") or {}).get("max_accuracy_drop")
            or ((row.get("checks") or {}).get("accuracy_drop") or {}).get("limit"))


def kl_of(row: dict) -> tuple[str, float | None]:
    kl = (row.get("checks") or {}).get("kl") or {}
    return kl.get("percentile", "p99"), kl.get("value")


def margins_text(report: dict) -> str:
    margins = {}
    for _, name, row in compare_rows(report):
        if margin_of(row) is not None:
            margins.setdefault(name, set()).add(margin_of(row))
    values = {m for s in margins.values() for m in s}
    if len(values) == 1:
        return f"Margin {values.pop():g} in every domain"
    return "Margins: " + ", ".join(f"{d} {'/'.join(f'{m:g}' for m in sorted(s))}" for d, s in margins.items())


def render_verdicts(ctx: Context, arg: str, old: list[str]) -> list[str]:
    report = ctx.json("results/compare.json", "stage:compare")
    plans, fp16 = report.get("plans") or {}, (report.get("fp16") or {}).get("accuracy") or {}
    pools = [f"{d} {count(p['pool'])} items (looks {'/'.join(count(n) for n in p['looks'])})"
             for d, p in plans.items()]
    lines = [f"{margins_text(report)}. Pools: {words(pools)}."]
    if fp16:
        lines[0] += " fp16 on the items it answered (every look): " + ", ".join(f"{d} {a:.3f}" for d, a in fp16.items()) + "."
    pcts = {kl_of(r)[0] for _, _, r in compare_rows(report) if r.get("paired")}
    kl_head = f"KL {pcts.pop()}" if len(pcts) == 1 else "KL (policy's percentile)"
    rows, unscored, confidences = [], [], []
    for variant, name, row in compare_rows(report):
        p = row.get("paired")
        if not p or p.get("difference") is None:
            unscored.append(f"{variant} {name}: {row.get('verdict')} ({'; '.join(row.get('reasons') or [])})")
            continue
        looks = row.get("looks") or {}
        confidences.append(p.get("confidence"))
        pct_name, kl = kl_of(row)
        verdict = row.get("verdict", "?")
        if verdict == "inconclusive" and row.get("items_to_decide"):
            verdict += f" (about {count(row['items_to_decide'])} items in all would decide)"
        rows.append([variant, name, verdict, f"{count(p['items'])} ({looks.get('look', '?')})",
                     f"{p['accuracy_fp16']:.3f} → {p['accuracy']:.3f}",
                     f"{signed(p['difference'])} {interval(p['ci_low'], p['ci_high'])}",
                     f"{p.get('families', '–')}, {p.get('design_effect', float('nan')):.2f}",
                     f"{p.get('correct_to_wrong', '–')}/{p.get('wrong_to_correct', '–')}",
                     small(kl) + ("" if len(pcts) <= 1 and pct_name else f" ({pct_name})")])
    lines += [""] + table(["variant", "domain", "verdict", "items (look)", "fp16 → variant", "difference [interval]",
                           "families, deff", "flips −/+", kl_head], rows)
    confidences = [c for c in confidences if c is not None]
    if confidences:
        lines += ["", f"Intervals at each look's spending-adjusted confidence, {span(confidences, lambda c: f'{100 * c:.1f}')} %."]
    if unscored:
        lines += ["", "Rows without paired numbers: " + "; ".join(unscored) + "."]
    return lines


def passing_variants(report: dict) -> tuple[list[str], dict[str, str]]:
    """Variants and candidates that pass every row, and every name's overall verdict."""
    overall = {}
    for variant, _, row in compare_rows(report):
        rank = {"pass": 0, "inconclusive": 1}.get(row.get("verdict"), 2)
        overall[variant] = max(overall.get(variant, 0), rank)
    names = {0: "pass", 1: "inconclusive", 2: "fail"}
    verdicts = {v: names[r] for v, r in overall.items()}
    return [v for v, r in verdicts.items() if r == "pass"], verdicts


def cheapest(report: dict, names: list[str]) -> str | None:
    cost = {n: ((report["variants"][n].get("memory") or {}).get("footprint_bytes")) for n in names}
    cost = {n: c for n, c in cost.items() if c is not None}
    return min(cost, key=cost.get) if cost else None


def points(report: dict, variant: str) -> list[float]:
    return [100 * r["paired"]["difference"] for v, name, r in compare_rows(report)
            if v == variant and ":" not in name and (r.get("paired") or {}).get("difference") is not None]


def points_text(values: list[float]) -> str:
    if values and max(values) < 0:
        lo, hi = f"{-max(values):.1f}", f"{-min(values):.1f}"
        return f"loses {lo if lo == hi else lo + '–' + hi} points"
    return f"differs by {span(values, lambda x: minus(f'{x:+.1f}'), ' to ')} points"


def margin_points(report: dict) -> str:
    margins = {margin_of(r) for _, _, r in compare_rows(report) if margin_of(r) is not None}
    return f"the {100 * margins.pop():g}-point margin" if len(margins) == 1 else "each domain's margin"


def gate_exit(verdicts: dict[str, str]) -> int:
    values = set(verdicts.values())
    return 1 if "fail" in values else 2 if "inconclusive" in values else 0


def render_gate_summary(ctx: Context, arg: str, old: list[str]) -> list[str]:
    report = ctx.json("results/compare.json", "stage:compare")
    passing, verdicts = passing_variants(report)
    others = [f"{v} {'fails' if r == 'fail' else 'is inconclusive'}" for v, r in verdicts.items() if r != "pass"]
    code = gate_exit(verdicts)
    lines = []
    text = (f"On the embedded model {words(passing) or 'no variant'} pass{'es' if len(passing) == 1 else ''} "
            f"every request type" + (f"; {words(others)}" if others else "") +
            f", so on these results `quantgate gate` (no `--variant`) exits {code}.")
    best = cheapest(report, passing)
    if best:
        text += (f" The cheapest that passed, {best}, is the `candidate`; it {points_text(points(report, best))} "
                 f"against fp16 per request type, inside {margin_points(report)} "
                 f"(docs/compare.md: how close each interval comes to it).")
    lines.append(text)
    return lines


def render_verdict_summary(ctx: Context, arg: str, old: list[str]) -> list[str]:
    report = ctx.json("results/compare.json", "stage:compare")
    rows = list(compare_rows(report))
    scored = [(v, n, r) for v, n, r in rows if (r.get("paired") or {}).get("difference") is not None]
    tally = {k: sum(r.get("verdict") == k for _, _, r in rows) for k in ("pass", "inconclusive", "fail")}
    out = [f"- **Verdicts:** {len(rows)} rows, {tally['pass']} pass, {tally['inconclusive']} inconclusive, "
           f"{tally['fail']} fail."]
    decided = []
    for variant in dict.fromkeys(v for v, _, _ in scored):
        by_look: dict[int, list[str]] = {}
        for v, name, r in scored:
            if v == variant:
                by_look.setdefault((r.get("looks") or {}).get("look", 0), []).append(name)
        decided.append(f"{variant} at " + " and ".join(f"look {k} ({', '.join(n)})" for k, n in sorted(by_look.items())))
    if decided:
        out.append("- **Where the looks decided:** " + "; ".join(decided) + ".")
    passing, _ = passing_variants(report)
    best = cheapest(report, passing)
    if passing:
        saving = (report["variants"][best].get("memory") or {}).get("footprint_saving_pct") if best else None
        out.append(f"- **Released:** {words(passing)} pass every domain, so `record` registers them in MLflow; "
                   f"the cheapest, {best}" + (f" ({saving:.1f} % under fp16's load footprint)" if saving is not None
                                             else "") + ", is the `candidate`.")
    else:
        out.append("- **Released:** no variant passes every domain; nothing is registered.")
    diffs = []
    for variant in dict.fromkeys(v for v, _, _ in scored):
        ps = [r["paired"].get("mcnemar_p") for v, n, r in scored if v == variant and ":" not in n]
        ps = [p for p in ps if p is not None]
        diffs.append(f"{variant} {points_text(points(report, variant))}"
                     + (f" (McNemar p {span(ps, lambda p: f'{p:.2f}')})" if ps else ""))
    if diffs:
        out.append("- **Against fp16, per domain:** " + "; ".join(diffs) + ".")
    near = sorted(((r["paired"]["ci_low"] + margin_of(r), v, n, r) for v, n, r in scored
                   if r.get("verdict") == "pass" and margin_of(r) is not None), key=lambda t: t[0])
    if near:
        text = "; ".join(f"{v} {n}, low end {signed(r['paired']['ci_low'])} against {signed(-margin_of(r))}"
                         for _, v, n, r in near[:2])
        out.append(f"- **Closest to the margin** (passing rows, interval low end against −margin): {text}.")
    items = {}
    for v, n, r in scored:
        if ":" not in n:
            items[v] = items.get(v, 0) + r["paired"]["items"]
    pool = sum(p["pool"] for d, p in (report.get("plans") or {}).items())
    if items and pool:
        spent = sum(items.values())
        out.append(f"- **Items answered:** the variants answered {' + '.join(count(n) for n in items.values())} of "
                   f"{len(items)} × {count(pool)}, {100 * (1 - spent / (len(items) * pool)):.0f} % fewer than "
                   f"judging every item.")
    table_ = ctx.json("results/routing_table.json", "stage:route")
    if table_:
        serve: dict[str, set] = {}
        for row in table_.get("rows") or []:
            serve.setdefault(row["domain"], set()).add(row["serve"])
        groups: dict[str, list[str]] = {}
        for domain, names in serve.items():
            groups.setdefault("/".join(sorted(names)), []).append(domain)
        buckets = table_.get("buckets") or []
        out.append("- **Routing table:** " + "; ".join(f"{words(ds)} → {s}" for s, ds in groups.items())
                   + (f" (context buckets {', '.join(map(str, buckets))} tokens)" if buckets else "") + ".")
    fid = fidelity_ranges(report)
    if fid:
        out.append("- **Token-level fidelity against fp16** (KL over fp16's top-k + rest): " + "; ".join(
            f"{v} KL mean {f['kl_mean']}, same top-1 {f['top1']}" for v, f in fid.items()) + ".")
    return out


def fidelity_ranges(report: dict) -> dict[str, dict[str, str]]:
    out = {}
    for variant in report.get("variants") or {}:
        rows = [(n, r["fidelity"]) for v, n, r in compare_rows(report)
                if v == variant and ":" not in n and (r.get("fidelity") or {}).get("kl")]
        if not rows:
            continue
        means = [f["kl"]["mean"] for _, f in rows]
        top = sorted(rows, key=lambda t: t[1]["same_top1"])
        lo, hi = top[0], top[-1]
        top1 = pct(lo[1]["same_top1"]) if pct(lo[1]["same_top1"]) == pct(hi[1]["same_top1"]) else \
            f"{pct(lo[1]['same_top1'])} ({lo[0]}) to {pct(hi[1]['same_top1'])} ({hi[0]})"
        out[variant] = {"kl_mean": span(means, small), "top1": top1}
    return out



# ---------------------------------------------------------------- history: results as an older commit holds them

def render_history_row(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """`COMMIT VARIANT DOMAIN`: one compare row and fp16's pool accuracies as that commit recorded them."""
    commit, variant, domain = arg.split()
    report = ctx.at_commit(commit, "results/compare.json")
    row = report["variants"][variant]["domains"][domain]
    p = row["paired"]
    text = (f"At commit {commit}: {variant} on {domain} `{row['verdict']}` at {count(p['items'])} items "
            f"(look {(row.get('looks') or {}).get('look', '?')}): {p['correct_to_wrong']} lost / "
            f"{p['wrong_to_correct']} gained against fp16, {signed(p['difference'])} "
            f"{interval(p['ci_low'], p['ci_high'])}, {p.get('families')} families, design effect "
            f"{p.get('design_effect', 1):.2f}")
    if row.get("items_to_decide"):
        text += f"; about {count(row['items_to_decide'])} items in all would have decided it at 80 % power"
    fp16 = (report.get("fp16") or {}).get("accuracy") or {}
    if fp16:
        text += ". fp16 on the whole pools then: " + ", ".join(f"{d} {a:.3f}" for d, a in fp16.items())
    return [text + "."]


def render_margin_move(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """`COMMIT VARIANT DOMAIN`: how a row's interval low end moved from that commit to the results now."""
    commit, variant, domain = arg.split()
    old_report = ctx.at_commit(commit, "results/compare.json")
    new_report = ctx.json("results/compare.json", "stage:compare")
    then = old_report["variants"][variant]["domains"][domain]
    now = new_report["variants"][variant]["domains"][domain]
    a, b = then["paired"], now["paired"]
    pool = [(r.get("fp16") or {}).get("accuracy", {}).get(domain) for r in (old_report, new_report)]
    move = "away from the margin" if b["ci_low"] > a["ci_low"] else "towards the margin" if b["ci_low"] < a["ci_low"] \
        else "nowhere"
    fp16 = f"fp16 on the whole pool {pool[0]:.3f} → {pool[1]:.3f}" if None not in pool else \
        f"fp16 {a['accuracy_fp16']:.3f} → {b['accuracy_fp16']:.3f} on the items judged"
    return [f"{variant} on {domain}, then (commit {commit}) and now: {fp16}, items {count(a['items'])} → "
            f"{count(b['items'])}, lost/gained {a['correct_to_wrong']}/{a['wrong_to_correct']} → "
            f"{b['correct_to_wrong']}/{b['wrong_to_correct']}, low end {signed(a['ci_low'])} → {signed(b['ci_low'])} "
            f"({move}), verdict {then['verdict']} → {now['verdict']}."]
