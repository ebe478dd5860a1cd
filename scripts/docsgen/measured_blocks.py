"""Blocks from docs/measured/*.json: what the benchmarks recorded, with their date, machine and command."""

from __future__ import annotations

import json

from .format import MINUS, count, pct, signed, small, table, words
from .sources import Context


def render_pipeline_speed(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """benchmarks/pipeline_speed.py: the summary against the goals; `stages RUN`: where RUN's time went, per stage."""
    data = ctx.measured("pipeline_speed")
    r = data["results"]
    if arg.startswith("stages"):
        return _stage_table(r["stages"][arg.split()[1]])
    g = r["goals"]
    how = "the chains on a local Ray cluster" if r.get("fresh_parallel") else "one stage after another"
    rows = [[f"fresh `quantgate repro` ({r['fresh_stages']} stages; {how})", f"{r['fresh_minutes']:.1f} min",
             f"≤ {g['fresh_minutes']:g} min"]]
    if "sequential_minutes" in r:
        rows.append(["fresh `dvc repro` (sequential), for comparison", f"{r['sequential_minutes']:.1f} min", ""])
    if "differs_from_sequential" in r:
        rows.append(["verdict and routing rows that differ, fanned out vs sequential",
                     ", ".join(r["differs_from_sequential"]) or "none", "none"])
    rows.append(["no-op `quantgate repro` / `dvc repro`", f"{r['noop_seconds']:.1f} s / {r['noop_dvc_seconds']:.1f} s",
                 f"≤ {g['noop_seconds']:g} s"])
    untouched = ", ".join(r["change_untouched"]) or "none"
    rows.append(["`quantgate repro` after changing only `calibration.samples`",
                 f"{r['change_seconds']:.0f} s; ran {len(r['change_ran'])} stages; of those that do not read the recipe, "
                 f"ran anyway: {untouched}", "only what reads the recipe runs"])
    rows.append(["`quantgate route lookup`, median of 5", f"{r['lookup_wall_seconds']:.2f} s, "
                 f"{r['lookup_peak_rss_mib']:.0f} MiB peak RSS",
                 f"≤ {g['lookup_wall_seconds']:g} s, ≤ {g['lookup_peak_rss_mib']:g} MiB"])
    rows.append(["importable `Router`: a lookup / with classification",
                 f"{r['router_lookup_us']:.1f} µs / {r['router_route_us']:.1f} µs", f"≤ {g['router_lookup_us']:g} µs"])
    lines = table(["what", "measured", "goal"], rows)
    if data.get("note"):
        lines += ["", data["note"]]
    return lines


def render_real_profile(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """benchmarks/real_profile.py: the run against its goal; `stages RUN`: where RUN's time went; `seed-incident`:
    awq4 and gptq3 with and without code comments in the calibration set."""
    if arg.strip() == "seed-incident":
        incident = ctx.measured("real_profile_seed_incident")["results"]["seed_incident"]
        rows = []
        for key, before in incident["full_calibration"].items():
            after = incident["without_code_comments"].get(key) or {}

            def cell(x: dict) -> str:
                if x.get("difference") is None:
                    return f"{x.get('verdict', '–')}"
                return (f"{x['verdict']}: {x['difference']:+.3f} [{x['ci_low']:+.3f}, {x['ci_high']:+.3f}], "
                        f"{x['items']} items, flips {x['flips_lost']}/{x['flips_gained']}")

            kl = (f"{before.get('kl_p99'):.3f} → {after.get('kl_p99'):.3f}"
                  if before.get("kl_p99") is not None and after.get("kl_p99") is not None else "–")
            rows.append([*key.split("/"), cell(before), cell(after), kl])
        lines = table(["variant", "request type", "full calibration", "without code comments", "KL p99"], rows)
        shares = ", ".join(f"{d} {v:.0%}" for d, v in (incident.get("calibration_shares") or {}).items()
                           if v is not None)
        return lines + ["", "`dvc exp run -S 'calibration.exclude=[code_comment]'` in the profile's workspace, after the "
                            "run above: calibrate, awq4's and gptq3's quantize and evaluate, compare and the stages after "
                            "it again" + (f"; the calibration set without code comments: {shares}." if shares else ".")]
    if arg.startswith("stages"):  # `stages fresh` (the fanned-out run), `stages sequential`
        run = arg.split()[1]
        return _stage_table(ctx.measured("real_profile" if run == "fresh" else f"real_profile_{run}")["results"]
                            ["stages"][run])
    data = ctx.measured("real_profile")
    r = data["results"]
    rows = [[f"fresh `quantgate repro` of profile {r['profile']} "
             f"({'the chains on a local Ray cluster' if r.get('fresh_parallel') else 'one stage after another'})",
             f"{r['fresh_minutes']:.1f} min", f"≤ {r['goal_minutes']:g} min"]]
    if (ctx.root / "docs/measured/real_profile_sequential.json").is_file():
        seq = ctx.measured("real_profile_sequential")
        rows.append(["fresh `quantgate repro --sequential` (plain `dvc repro`)",
                     f"{seq['results']['sequential_minutes']:.1f} min", ""])
        # the rows that differ, as the later of the two runs found them, only if it compared with the run shown here
        found = [d for d, against in ((seq["results"].get("differs_from_other_mode"), data),
                                      (r.get("differs_from_other_mode"), seq))
                 if d and "rows" in d and d.get("other_commit") == against.get("commit")]
        if found:
            rows.append(["verdict and routing rows that differ, fanned out vs sequential",
                         ", ".join(found[0]["rows"]) or "none", "none"])
    if "gate_exit" in r:
        rows.append(["`quantgate gate` exit code", str(r["gate_exit"]), "0, 1 or 2 (decided on evidence)"])
    return table(["what", "measured", "goal"], rows) + (["", data["note"]] if data.get("note") else [])


def _stage_table(stages: dict) -> list[str]:
    """One row per stage, slowest first: its wall time, the seconds inside bare library calls, the rest."""
    rows = []
    for name, s in sorted(stages.items(), key=lambda kv: -kv[1]["wall_seconds"]):
        lib = sum(v["seconds"] for v in s["library"].values())
        calls = ", ".join(f"{k} {v['seconds']:.1f}" + (f" ({v['calls']}×)" if v["calls"] > 1 else "")
                          for k, v in sorted(s["library"].items(), key=lambda kv: -kv[1]["seconds"]))
        rows.append([f"`{name}`", f"{s['wall_seconds']:.1f}", f"{lib:.1f}", f"{s['wall_seconds'] - lib:.1f}",
                     calls or "none"])
    total = sum(s["wall_seconds"] for s in stages.values())
    return table(["stage", "wall s", "library s", "other s", "library calls (s)"], rows) + [
        "", f"Sum of the stages' wall times: {total:.0f} s."]


def render_gate_operating(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """benchmarks/gate_operating.py: quantgate's accuracy rule and three peers' rules on the same simulated runs."""
    data = ctx.measured("gate_operating")
    r = data["results"]
    rows = []
    groups = {c["pool"]: c["families"] for c in r["cells"] if c.get("families")}
    cases = {"independent": "independent items", "declared": "{} families declared, independent items",
             "clustered": "{} families, clustered (CV 1)", "strong": "{} families, strongly clustered (CV 1.5)"}
    for c in r["cells"]:
        q, p = c["quantgate"], c["peers"]
        looks = "/".join(count(n) for n in c["looks"])
        at_margin = abs(c["true_difference"] + r["margin"]) < 1e-9
        verdicts = f"{q['pass']:.3f} / {q['inconclusive']:.3f} / {q['fail']:.3f}"
        rows.append([f"{count(c['pool'])} items, {cases[c['case']].format(groups.get(c['pool']))} (looks {looks})",
                     signed(c["true_difference"], 2), pct(c["flip_rate"]), f"**{verdicts}**" if at_margin else verdicts,
                     f"{q['items']:,.0f}", f"{c['planned_pass']:.3f}", f"{p['llm-compressor']:.3f}", f"{p['vllm']:.3f}",
                     f"{p['gptqmodel']:.3f}"])
    lines = [f"{count(r['runs'])} simulated runs per cell (seed {r['seed']}), margin {r['margin']:g}, one-sided "
             f"α {r['alpha']:g}, {r['spending']} spending; base accuracy {r['base_accuracy']:g}; {r['flip_model']}; "
             f"{r.get('seconds', 0):.0f} s. Peers take every item of the pool and only pass or fail.", ""]
    lines += table(["pool", "true difference", "flip rate", "quantgate pass / inconclusive / fail", "mean items",
                    "planned pass", "llm-compressor recovery ≥ 0.95: pass", "vLLM rtol 0.08: pass",
                    "GPTQModel floor 5 %: pass"], rows)
    if r.get("goals"):
        lines += ["", "Goals:", ""]
        for g in r["goals"]:
            sign = "≤" if g.get("comparison", "<=") == "<=" else "≥"
            value = f"{g['value']:.0f}" if g["limit"] >= 1 else f"{g['value']:.3f}"
            what = g["what"].replace("-0", MINUS + "0")
            lines.append(f"- {what}: {value} (goal {sign} {g['limit']:g}): {'met' if g['met'] else '**missed**'}")
    if r.get("sizing"):
        first = r["sizing"][0]
        lines += ["", f"The {count(first['pool'])}-item pool's shape ({first['families']} families) sized by the planner "
                      "for a variant 2 points worse:", ""]
        lines += [f"- {cases[s['case']].format(s['families'])}: a pass rate of {s['power']:g} needs "
                  + (f"about {s['items']:,} items" if s["items"] else "more families: items alone do not reach it")
                  for s in r["sizing"]]
    return lines


def render_quantize_overhead(ctx: Context, arg: str, old: list[str]) -> list[str]:
    data = ctx.measured("quantize_overhead")
    r = data["results"]
    rows = [[x["variant"], f"{x['direct_seconds']:.2f}", f"{x['quantgate_seconds']:.2f}", f"{x['ratio']:.3g}"]
            for x in r["rows"]]
    lines = [f"Best of {r['repeats']}" + (f", {r['seconds'] / 60:.1f} min in all" if r.get("seconds") else "")
             + f"; goal: ratio under {r.get('goal_ratio', 1.10):.2f} wherever quantizing takes real time.", ""]
    lines += table(["variant", "direct s", "quantgate s", "ratio"], rows)
    return lines


ADMISSION_ROWS = [("read every byte once, warm (page cache)", "read_warm_s", "s"),
                  ("read every byte once, cold (pages dropped with `posix_fadvise`)", "read_cold_s", "s"),
                  ("`sha256sum` of every file, one core, warm", "sha256_warm_s", "s"),
                  ("phase 1 alone (`admission.inspect`: every check that reads no tensor bytes), warm",
                   "phase1_warm_s", "s"),
                  ("`validate` (every check, sha256, NaN/inf scan), warm", "validate_warm_s", "s"),
                  ("`admit` (the same plus the copy), warm", "admit_warm_s", "s"),
                  ("`admit`, cold", "admit_cold_s", "s"),
                  ("**admit cold / cold read, fastest of each** (goal ≤ 1.5)", "ratio_fastest", "x"),
                  ("**paired, median** (goal ≤ 1.5)", "paired_median", "x")]


def render_admission_cost(ctx: Context, arg: str, old: list[str]) -> list[str]:
    data = ctx.measured("admission_cost")
    runs = data["results"]["runs"]
    sizes = {(x.get("checkpoint_mb"), x.get("shards"), x.get("repeats")) for x in runs}
    intro = [f"A {count(mb)} MB fp16 Llama-shaped checkpoint of random tensors in {shards} shards + index, "
             f"{repeats} repeats per run." for mb, shards, repeats in sizes if mb] if len(sizes) == 1 else []
    head = [""] + [f"run {i + 1}" + (f" ({x['date']})" if x.get("date") and x.get("date") != data.get("date") else "")
                   for i, x in enumerate(runs)]
    rows = []
    for name, key, unit in ADMISSION_ROWS:
        if not any(key in x for x in runs):
            continue
        cells = []
        for x in runs:
            v = x.get(key)
            text = "–" if v is None else f"{v:.3f} s" if unit == "s" else f"{v:.2f}"
            cells.append(f"**{text}**" if unit == "x" and v is not None else text)
        rows.append([name, *cells])
    lines = (intro + [""] if intro else []) + table(head, rows)
    notes = [f"run {i + 1}: {x['note']}" for i, x in enumerate(runs) if x.get("note")]
    if notes:
        lines += ["", "; ".join(notes) + "."]
    return lines


def render_evaluate_overhead(ctx: Context, arg: str, old: list[str]) -> list[str]:
    data = ctx.measured("evaluate_overhead")
    r = data["results"]
    rows = [["probe throughput (items/s)", f"{r['bare_items_per_s']:.1f}", f"{r['quantgate_items_per_s']:.1f}",
             f"{r['throughput_ratio']:.2f}", "≥ 0.95"],
            ["fidelity vs one forward pass over the same tokens (s)", f"{r['forward_seconds']:.2f}",
             f"{r['fidelity_seconds']:.2f}", f"{r['fidelity_ratio']:.2f}", "≤ 1.2"]]
    lines = [f"{r['variant']}, {count(r['items'])} probe items of {words(r['domains'])}, best of {r['repeats']}.", ""]
    return lines + table(["what", "bare", "through quantgate", "ratio", "goal"], rows)


def render_trace_overhead(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """benchmarks/trace_overhead.py: a growing soak's rounds with and without the tracer, and what it named."""
    r = ctx.measured("trace_overhead")["results"]
    inj, own = r["injected"], r["own_growth"]
    rows = [["seconds per round", f"{r['untraced_seconds_per_round']:.2f}", f"{r['traced_seconds_per_round']:.2f}",
             f"**×{r['overhead_ratio']:.2f}**"],
            [f"reading the capture, drawing the flame graph ({r['rounds']} rounds)", "–",
             f"{r['analysis_seconds']:.1f} s", f"{r['analysis_seconds'] / r['rounds']:.1f} s a round"]]
    lines = [f"`{r['variant']}`, context {r['context_tokens']} tokens, {r['rounds']} rounds each way, "
             f"{r['leak_bytes_per_round']:,} B kept alive per round (the Intel int8 rate).", ""]
    lines += table(["", "untraced", "traced", "ratio"], rows)
    lines += ["", f"Injected: **{inj['class']}**, {pct(inj['top_share'])} under `{inj['top_site']}` in "
                  f"{inj['top_library']} ({inj['grew_per_round']:,.0f} B a round grew between traced round ends); "
                  f"capture {inj['capture_bytes'] / 1e6:,.0f} MB (deleted once read), flame graph "
                  f"{r['flamegraph_bytes'] / 1e3:,.0f} KB. Nothing injected: {own['grew_between_round_ends']:,} B grew "
                  f"between the {r['rounds']} round ends"
                  + (f", the largest site `{own['top_site']}` in {own['top_library']}." if own["top_site"] else ".")]
    return lines


def render_fanout(ctx: Context, arg: str, old: list[str]) -> list[str]:
    data = ctx.measured("fanout")
    rows = []
    for x in data["results"]["runs"]:
        rows.append([x.get("label", "this run"), f"{x['sequential_seconds']:.1f} s",
                     f"{x['fanout_seconds'] + x['rest_seconds']:.1f} s ({x['fanout_seconds']:.1f} + {x['rest_seconds']:.1f})",
                     f"**{x['ratio']:.2f}**", f"{x['empty_task_ms']:.1f} ms / {x['stage_task_ms']:.1f} ms"])
    return table(["run", "sequential `dvc repro`", "`quantgate fanout` + `dvc repro`", "**ratio** (goal ≤ 0.75)",
                  "Ray overhead per task (empty / a `true` stage)"], rows)


def render_quantizer_settings(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """ARG: the file's name under docs/measured/; the columns are whatever its rows hold."""
    data = ctx.measured(arg.strip())
    r = data["results"]
    domains, gen = r["domains"], r.get("generating_domains") or []
    pools = r.get("pool_sizes") or {}
    timed = any("quantize_seconds" in row for row in r["rows"])
    rows = []
    for row in r["rows"]:
        fid, lg = row.get("fidelity") or {}, row.get("lost_gained") or {}
        label = row.get("label") or f"`{json.dumps(row['settings'])}`"
        cells = [label]
        if len(domains) > 1:
            cells += [" / ".join(f"{fid[d]['kl_mean']:.3f}" for d in domains),
                      " / ".join(f"{fid[d]['kl_p99']:.2f}" for d in domains),
                      " / ".join(f"{100 * fid[d]['same_top1']:.1f}" for d in domains) + " %"]
        else:
            d = domains[0]
            cells += [f"{small(fid[d]['kl_mean'])}, {pct(fid[d]['same_top1'])}"]
        cells += [", ".join(f"{lg[d][0]}/{lg[d][1]}" for d in gen if d in lg)]
        if timed:  # newer runs record what quantizing took, and from how many calibration texts
            cells += [f"{row['quantize_seconds']:.0f}" if row.get("quantize_seconds") is not None else "–",
                      str(row.get("calibration_samples") or "–")]
        rows.append(cells)
    extra = ["quantize s", "calibration texts"] if timed else []
    if len(domains) > 1:
        head = ["setting", f"KL mean: {' / '.join(domains)}", "KL p99", "same top-1",
                f"probes lost / gained: {', '.join(gen)}", *extra]
    else:
        head = ["setting", f"fidelity on {domains[0]} texts: KL mean, same top-1",
                "probes lost / gained" + (f" of {count(pools[gen[0]])}" if gen and gen[0] in pools else ""), *extra]
    lines = table(head, rows)
    if data.get("note"):
        lines += ["", data["note"]]
    return lines


def render_measured_rows(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """ARG: a docs/measured/ file whose results are a ready table: {"header": [...], "rows": [[...]]}."""
    data = ctx.measured(arg.strip())
    r = data["results"]
    lines = table(r["header"], r["rows"])
    if data.get("note"):
        lines += ["", data["note"]]
    return lines
