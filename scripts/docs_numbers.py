#!/usr/bin/env python3
"""Write the numbers README.md and docs/*.md quote from the files they come from, and check that they still match.

    python scripts/docs_numbers.py           # rewrite every stale number block (each file atomically)
    python scripts/docs_numbers.py --check   # exit 1, listing file:line of every stale block and of every
                                             # path the docs name that the project does not ship
    python scripts/docs_numbers.py --list    # the block kinds, and which files each one reads

A number block in a Markdown file is

    <!-- numbers:KIND [ARG] -->
    (Markdown this script writes: a table or a few short sentences)

    _From `results/compare.json` (2026-12-01), made by `dvc repro`; regenerate with `python scripts/docs_numbers.py`._
    <!-- /numbers -->

Everything between the two markers is written here, from results/ (what `dvc repro` writes), params.yaml,
reference_model/recipe.json, results files as an older commit holds them (`git show`), and docs/measured/*.json
(what the benchmarks write when they run: date, machine, command). Never edit inside a block: edit the source and
run this script. One exception: a `params SECTION` block holds a hand-written `key | default | meaning` table whose
key and meaning columns are yours; only its default column is written, from params.yaml's SECTION. The last line of a block names its sources and their dates. A source's date is the date of its
last commit when the file is committed unchanged, else the day the file was last written; once a block is written,
its dates stay until the numbers it shows change. The date of a benchmark's numbers is the one its JSON file
records.

A block whose source is not in this checkout (a commit a shallow clone lacks, per-item records only `dvc repro`
makes) is left as it is and listed as not checked; it does not fail --check.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = "python scripts/docs_numbers.py"
OPEN_RE = re.compile(r"^<!-- numbers:(?P<kind>[a-z0-9-]+)(?: (?P<arg>[^>]*?))? -->\s*$")
CLOSE = "<!-- /numbers -->"
MINUS = "\u2212"
# files the docs name that are written by a command outside dvc.yaml's stages
WRITTEN_OUTSIDE_DVC = {
    "results/gate.json": "quantgate gate",
    "results/report.md": "quantgate gate",
    "logs/quantgate.log": "every quantgate command",
    "logs/benchmark.log": "the benchmarks",
}
# paths the docs name that are not files of this repository (checked as such by hand)
NOT_REPOSITORY_PATHS = {
    "results/quantgate.json": "an artifact path inside an MLflow child run (docs/record-gate.md)",
}
CHECKED_PREFIXES = ("results/", "docs/", "scripts/", "benchmarks/", "tests/")


class SourceMissing(Exception):
    """A block's source is not in this checkout: the block is left as it is, and not checked."""


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# ---------------------------------------------------------------- formatting

def signed(x: float, nd: int = 3) -> str:
    """+0.010, -0.015 (with a real minus sign), +0.000 for zero."""
    text = f"{abs(x):.{nd}f}"
    return (MINUS if x < 0 and float(text) != 0 else "+") + text


def interval(low: float, high: float, nd: int = 3) -> str:
    return f"[{signed(low, nd)}, {signed(high, nd)}]"


def count(n) -> str:
    return f"{int(n):,}"


def pct(x: float, nd: int = 1) -> str:
    return f"{100 * x:.{nd}f} %"


def small(x: float | None) -> str:
    """A KL value: 4 decimals under 0.01, else 3."""
    if x is None:
        return "–"
    return f"{x:.4f}" if abs(x) < 0.01 else f"{x:.3f}"


def span(values: list[float], fmt, sep: str = "–") -> str:
    """'a–b' of the smallest and largest, or one value when they print the same."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def minus(text: str) -> str:
    return text.replace("-", MINUS) if text.startswith("-") else text


def words(items: list[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


# ---------------------------------------------------------------- sources and their dates

def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


@dataclass
class Used:
    kind: str            # file, git, measured
    path: str
    made_by: str = ""
    commit: str = ""
    data: dict | None = None


@dataclass
class Context:
    root: Path
    used: list[Used] = field(default_factory=list)

    def _note(self, used: Used) -> None:
        if not any(u.kind == used.kind and u.path == used.path and u.commit == used.commit for u in self.used):
            self.used.append(used)

    def read(self, path: str, made_by: str = "") -> str:
        file = self.root / path
        if not file.is_file():
            who = f"`dvc repro` (stage `{made_by[6:]}`)" if made_by.startswith("stage:") else made_by
            raise SourceMissing(f"{path} is not in this checkout" + (f" ({who} writes it)" if who else ""))
        self._note(Used("file", path, made_by))
        return file.read_text(encoding="utf-8")

    def json(self, path: str, made_by: str = "") -> dict:
        return json.loads(self.read(path, made_by))

    def yaml(self, path: str) -> dict:
        return yaml.safe_load(self.read(path))

    def at_commit(self, commit: str, path: str) -> dict:
        out = git(self.root, "show", f"{commit}:{path}")
        if out.returncode != 0:
            raise SourceMissing(f"{path} at commit {commit} is not in this clone (a shallow clone lacks it)")
        self._note(Used("git", path, commit=commit))
        return json.loads(out.stdout)

    def measured(self, name: str) -> dict:
        path = f"docs/measured/{name}.json"
        file = self.root / path
        if not file.is_file():
            raise SourceMissing(f"{path} is missing: run the benchmark that writes it")
        data = json.loads(file.read_text(encoding="utf-8"))
        self._note(Used("measured", path, data=data))
        return data


def file_date(root: Path, path: str) -> str:
    """The date of the file's last commit when it is committed unchanged, else the day it was last written."""
    if git(root, "ls-files", "--error-unmatch", "--", path).returncode == 0 \
            and git(root, "diff", "--quiet", "HEAD", "--", path).returncode == 0:
        day = git(root, "log", "-1", "--format=%cs", "--", path).stdout.strip()
        if day:
            return day
    stamp = (root / path).stat().st_mtime
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc).date().isoformat()


def commit_date(root: Path, commit: str) -> str:
    return git(root, "log", "-1", "--format=%cs", commit).stdout.strip() or "date unknown"


def machine_text(machine: dict | None) -> str:
    if not machine:
        return ""
    if machine.get("description"):
        return machine["description"]
    parts = [f"{machine['cpus']} cores" if machine.get("cpus") else "", machine.get("cpu", ""), machine.get("gpu", "")]
    return ", ".join(p for p in parts if p)


def undated(line: str) -> str:
    return re.sub(r"\(\d{4}-\d\d-\d\d(?: to \d{4}-\d\d-\d\d)?\)", "(DATE)", line)


def _grouped(paths: list[str]) -> list[tuple[str, list[str]]]:
    """Paths that differ in one name as one label, in first-seen order: files of one folder and suffix as
    `folder/{a,b}.json`, then files of one name in sibling folders as `eval/{math,code}/items.jsonl`."""
    def split(path: str) -> tuple[str, str, str]:
        folder, _, name = path.rpartition("/")
        stem, dot, suffix = name.partition(".")
        return folder, stem, dot + suffix

    by_file: dict[tuple, list[str]] = {}
    for path in paths:
        folder, _, suffix = split(path)
        by_file.setdefault((folder, suffix), []).append(path)
    groups: dict[tuple, list[str]] = {}
    for key, members in by_file.items():
        if len(members) > 1:
            groups[("file",) + key] = members
        else:
            folder, _, name = members[0].rpartition("/")
            parent, _, _ = folder.rpartition("/")
            groups.setdefault(("folder", parent, name), []).append(members[0])
    out = []
    for key, members in groups.items():
        if len(members) == 1:
            out.append((members[0], members))
        elif key[0] == "file":
            folder, suffix = key[1], key[2]
            inner = "{" + ",".join(split(m)[1] for m in members) + "}"
            out.append((f"{folder + '/' if folder else ''}{inner}{suffix}", members))
        else:
            parent, name = key[1], key[2]
            inner = "{" + ",".join(m.rpartition("/")[0].rpartition("/")[2] for m in members) + "}"
            out.append((f"{parent + '/' if parent else ''}{inner}/{name}", members))
    return out


def _stages(names: list[str]) -> str:
    """`memory-report`, `memory@<variant>`: a stage per variant named once."""
    prefixes = [n.split("@")[0] for n in names if "@" in n]
    shown = []
    for n in names:
        if "@" in n and prefixes.count(n.split("@")[0]) > 1:
            n = n.split("@")[0] + "@<variant>"
        if n not in shown:
            shown.append(n)
    return f"`dvc repro` (stage{'s' if len(shown) > 1 else ''} {', '.join(f'`{x}`' for x in shown)})"


def provenance(ctx: Context) -> str:
    """The block's last line: every source with its date, what made it, and how to regenerate the block."""
    measured = [u for u in ctx.used if u.kind == "measured"]
    others = [u for u in ctx.used if u.kind != "measured"]
    sentences = []
    for u in measured:
        d = u.data or {}
        how = f"`{d['command']}`" if d.get("command") else d.get("method") or f"`{d.get('benchmark', '?')}`"
        where = ", ".join(p for p in (machine_text(d.get("machine")),
                                      f"commit {d['commit']}" if d.get("commit") else "") if p)
        text = f"As measured on {d.get('date', 'an unknown date')} by {how}" + (f" ({where})" if where else "")
        if d.get("provenance"):
            text += f"; {d['provenance'].rstrip('.')}"
        sentences.append(text + f". From `{u.path}`")
    if others:
        parts = []
        for label, members in _grouped([u.path for u in others if u.kind == "file"]):
            days = sorted({file_date(ctx.root, m) for m in members})
            parts.append(f"`{label}` ({days[0] if len(days) == 1 else days[0] + ' to ' + days[-1]})")
        parts += [f"`{u.path}` as committed in {u.commit} ({commit_date(ctx.root, u.commit)})"
                  for u in others if u.kind == "git"]
        stages = list(dict.fromkeys(u.made_by[6:] for u in others if u.made_by.startswith("stage:")))
        made = sorted({u.made_by for u in others if u.made_by and not u.made_by.startswith("stage:")})
        if stages:
            made.insert(0, _stages(stages))
        sentences.append("From " + words(parts) + (f", written by {words(made)}" if made else ""))
    return "_" + ". ".join(sentences) + f"; regenerate with `{GENERATOR}`._"


# ---------------------------------------------------------------- results: compare, routing, gate

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
        lines[0] += " fp16 on the whole pools: " + ", ".join(f"{d} {a:.3f}" for d, a in fp16.items()) + "."
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
    return lines


def render_classifier(ctx: Context, arg: str, old: list[str]) -> list[str]:
    c = ctx.json("results/calibration/classifier.json", "stage:calibrate")
    per = ", ".join(f"{t} {x['correct']}/{x['requests']}" for t, x in (c.get("types") or {}).items())
    flagged = c.get("flagged") or []
    return [f"On the shipped sample ({count(c['labelled_requests'])} labelled requests) the classifier names "
            f"{count(c['correct'])} right ({pct(c['accuracy'])}): {per}; {c.get('unknown', 0)} unknown, "
            f"{c.get('ambiguous', 0)} ambiguous; "
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


# ---------------------------------------------------------------- params.yaml

def _parts(cell: str) -> list[str]:
    """A table cell's comma-separated values, commas inside brackets kept."""
    parts, depth, cur = [], 0, ""
    for ch in cell:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def _value_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return str(value)


def _same(text: str, value) -> bool:
    try:
        parsed = yaml.safe_load(text.replace("`", ""))
    except yaml.YAMLError:
        return False
    if isinstance(parsed, (int, float)) and isinstance(value, (int, float)) and not isinstance(parsed, bool):
        return float(parsed) == float(value)
    if isinstance(parsed, list) and isinstance(value, list):
        return len(parsed) == len(value) and all(_same(_value_text(p), v) for p, v in zip(parsed, value))
    return parsed == value


def render_params(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """The table in the block keeps its keys and meanings; its `default` column is params.yaml's values."""
    params = ctx.yaml("params.yaml")
    section = params
    for key in arg.split("."):
        section = (section or {}).get(key) if isinstance(section, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"params.yaml has no section {arg!r}")
    body = [line for line in old if line.startswith("|")]
    if len(body) < 2:
        raise ValueError("a params block holds a table with `key | default | meaning` columns")
    header = [c.strip() for c in body[0].strip("|").split("|")]
    k, d = header.index("key"), header.index("default")
    out = body[:2]
    for line in body[2:]:
        cells = line.strip()[1:-1].split("|")
        keys = [x.strip().strip("`") for x in cells[k].split(",")]
        values = _parts(cells[d].strip())
        if all(key in section for key in keys) and len(values) == len(keys):
            new = []
            for key, text in zip(keys, values):
                lead = re.match(r"^(\[[^\]]*\]|[^\s(]+)(.*)$", text)
                head, tail = (lead.group(1), lead.group(2)) if lead else (text, "")
                if isinstance(section[key], dict) or _same(head, section[key]):
                    new.append(text)
                else:  # the value changed: its old note (e.g. "(12 h)") no longer holds
                    new.append(_value_text(section[key]))
            cells[d] = f" {', '.join(new)} "
        out.append("|" + "|".join(cells) + "|")
    return out


# ---------------------------------------------------------------- benchmarks (docs/measured/*.json)

def render_pipeline_speed(ctx: Context, arg: str, old: list[str]) -> list[str]:
    data = ctx.measured("pipeline_speed")
    r = data["results"]
    rows = [[f"fresh `dvc repro` ({r['fresh_repro_stages']} stages)", f"{r['fresh_repro_minutes']:.1f} min", "≤ 10 min"],
            ["no-op `dvc repro`", f"{r['noop_repro_seconds']:.1f} s", "≤ 3 s"]]
    ran = r.get("recipe_change_ran")
    what = f"{r['recipe_change_seconds']:.0f} s; ran " + (", ".join(ran) if ran else r.get("recipe_change_note", "?"))
    untouched = r.get("recipe_change_untouched")
    if untouched is not None:
        what += "; of the stages that do not read the recipe, ran anyway: " + (", ".join(untouched) or "none")
    rows.append(["`dvc repro` after changing only `calibration.samples`", what, "only what reads the recipe runs"])
    rows.append(["`quantgate route lookup`, median of 5", f"{r['lookup_wall_seconds']:.2f} s, "
                 f"{r['lookup_peak_rss_mib']:.0f} MiB peak RSS", "≤ 0.5 s, ≤ 80 MiB"])
    rows.append(["importable `Router`: a lookup / with classification",
                 f"{r['router_lookup_us']:.1f} µs / {r['router_route_us']:.1f} µs", "≤ 50 µs"])
    lines = table(["what", "measured", "goal"], rows)
    if data.get("note"):
        lines += ["", data["note"]]
    return lines


def render_gate_operating(ctx: Context, arg: str, old: list[str]) -> list[str]:
    data = ctx.measured("gate_operating")
    r = data["results"]
    plan = "/".join(count(n) for n in r["looks_plan"])
    one = "/".join(count(n) for n in r["one_look_plan"])
    rows = []
    for row in r["rows"]:
        a, b = row["one_look"], row["looks"]
        bold = row["goal"].startswith(("<=", ">="))
        def cells(x, first):
            p = f"{x['pass']:.3f}"
            return (f"**{p}**" if bold and first else p) + f" / {x['inconclusive']:.3f} / {x['fail']:.3f}"
        goal = row["goal"].replace("<=", "≤").replace(">=", "≥")
        rows.append([row["scenario"], goal, cells(a, True), cells(b, row["goal"].startswith("<=")),
                     f"{b['items']:.0f}"])
    lines = [f"{count(r['runs'])} simulated runs per row (seed {r['seed']}), margin {r['margin']:g}, "
             f"one-sided α {r['alpha']:g}, {r['spending']} spending; {r.get('seconds', 0):.0f} s.", ""]
    lines += table(["scenario", "goal", f"one look of {one}: pass / inconclusive / fail",
                    f"looks {plan}: pass / inconclusive / fail", "mean items"], rows)
    margin = [row for row in r["rows"] if row["true_difference"] == -r["margin"]]
    if margin:
        worst = max(max(row["one_look"]["pass"], row["looks"]["pass"]) for row in margin)
        se = (worst * (1 - worst) / r["runs"]) ** 0.5
        lines += ["", f"At the margin the rule passed at most {pct(worst)} of runs (± {pct(se)} Monte-Carlo standard "
                      f"error; goal ≤ 5 %, the rule's nominal budget {pct(r['alpha'])})."]
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
                  ("phase 1 alone (`candidates.inspect`: every check that reads no tensor bytes), warm",
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
        rows.append(cells)
    if len(domains) > 1:
        head = ["setting", f"KL mean: {' / '.join(domains)}", "KL p99", "same top-1",
                f"probes lost / gained: {', '.join(gen)}"]
    else:
        head = ["setting", f"fidelity on {domains[0]} texts: KL mean, same top-1",
                "probes lost / gained" + (f" of {count(pools[gen[0]])}" if gen and gen[0] in pools else "")]
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


RENDERERS = {
    "verdicts": (render_verdicts, "results/compare.json: the verdict table, pools, fp16's accuracy"),
    "verdict-summary": (render_verdict_summary, "results/compare.json, results/routing_table.json: what the table says"),
    "gate-summary": (render_gate_summary, "results/compare.json: which variants pass, the gate's exit code"),
    "eval-accuracy": (render_eval_accuracy, "results/eval/<variant>.json, eval/<domain>/items.jsonl"),
    "eval-fidelity": (render_eval_fidelity, "results/eval/<variant>.json: KL and same top-1 ranges"),
    "memory": (render_memory, "results/memory_summary.json, results/memory/<variant>.json"),
    "quantize": (render_quantize, "results/quantize/<variant>.json, results/memory_summary.json"),
    "coverage": (render_coverage, "results/calibration/coverage.json"),
    "classifier": (render_classifier, "results/calibration/classifier.json"),
    "reference": (render_reference, "results/reference.json, reference_model/recipe.json"),
    "reference-history": (render_reference_history, "reference_model/recipe.json at commit ARG"),
    "history-row": (render_history_row, "results/compare.json at commit ARG (COMMIT VARIANT DOMAIN)"),
    "margin-move": (render_margin_move, "results/compare.json at commit ARG and now (COMMIT VARIANT DOMAIN)"),
    "params": (render_params, "params.yaml section ARG: the default column of the table in the block"),
    "pipeline-speed": (render_pipeline_speed, "docs/measured/pipeline_speed.json (benchmarks/pipeline_speed.py)"),
    "gate-operating": (render_gate_operating, "docs/measured/gate_operating.json (benchmarks/gate_operating.py)"),
    "quantize-overhead": (render_quantize_overhead, "docs/measured/quantize_overhead.json"),
    "admission-cost": (render_admission_cost, "docs/measured/admission_cost.json (benchmarks/admission_cost.py)"),
    "evaluate-overhead": (render_evaluate_overhead, "docs/measured/evaluate_overhead.json"),
    "fanout": (render_fanout, "docs/measured/fanout.json (benchmarks/fanout.py)"),
    "quantizer-settings": (render_quantizer_settings, "docs/measured/ARG.json (benchmarks/quantizer_settings.py)"),
    "measured-table": (render_measured_rows, "docs/measured/ARG.json: a table recorded with its date and command"),
}


# ---------------------------------------------------------------- blocks

@dataclass
class Problem:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


def split_old(old: list[str]) -> tuple[list[str], str]:
    """A block's body as (content, provenance line)."""
    body = list(old)
    prov = ""
    while body and not body[-1].strip():
        body.pop()
    if body and body[-1].startswith("_") and "regenerate with" in body[-1]:
        prov = body.pop()
    while body and not body[-1].strip():
        body.pop()
    while body and not body[0].strip():
        body.pop(0)
    return body, prov


def render_block(root: Path, kind: str, arg: str, old: list[str]) -> list[str]:
    if kind not in RENDERERS:
        raise ValueError(f"unknown block kind {kind!r} (known: {', '.join(RENDERERS)})")
    content, old_prov = split_old(old)
    ctx = Context(root)
    new = [line.rstrip() for line in RENDERERS[kind][0](ctx, arg or "", content)]
    prov = provenance(ctx)
    if new == content and old_prov and undated(old_prov) == undated(prov):
        prov = old_prov  # the same numbers from the same sources: the dates they were first written with stay
    return [""] + new + ["", prov]


def process(root: Path, path: Path) -> tuple[str, list[Problem], list[Problem]]:
    """(new text, stale or broken blocks, blocks not checked)."""
    rel = str(path.relative_to(root))
    lines = path.read_text(encoding="utf-8").split("\n")
    out, stale, unchecked, i = [], [], [], 0
    while i < len(lines):
        m = OPEN_RE.match(lines[i])
        if not m:
            if lines[i].strip() == CLOSE:
                stale.append(Problem(rel, i + 1, "a block's end marker without its start"))
            out.append(lines[i])
            i += 1
            continue
        j = next((k for k in range(i + 1, len(lines)) if lines[k].strip() == CLOSE or OPEN_RE.match(lines[k])), None)
        if j is None or lines[j].strip() != CLOSE:
            stale.append(Problem(rel, i + 1, f"block {m['kind']!r} has no end marker ({CLOSE})"))
            out.append(lines[i])
            i += 1
            continue
        old = lines[i + 1:j]
        name = m["kind"] + (f" {m['arg']}" if m["arg"] else "")
        try:
            new = render_block(root, m["kind"], m["arg"], old)
        except SourceMissing as e:
            unchecked.append(Problem(rel, i + 1, f"block {name!r} not checked: {e}"))
            new = old
        except Exception as e:  # noqa: BLE001 - a broken source names the block, never a traceback
            stale.append(Problem(rel, i + 1, f"block {name!r} cannot be rendered: {type(e).__name__}: {e}"))
            new = old
        if new != old:
            first = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            shown = old[first].strip() if first < len(old) else "(end of block)"
            stale.append(Problem(rel, i + 1, f"block {name!r} is stale: line {i + 2 + first} differs from its "
                                             f"sources ({shown[:80]!r}); run {GENERATOR}"))
        out += [lines[i], *new, CLOSE]
        i = j + 1
    return "\n".join(out), stale, unchecked


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- paths the docs name

PATH_RE = re.compile(r"(?<![\w./$-])((?:%s)(?:[^\s`'\"()\],;:|!?{]|\{[^\s{}]*\})*)"
                     % "|".join(re.escape(p) for p in CHECKED_PREFIXES))


def shipped_files(root: Path) -> list[str]:
    """What a commit of this checkout would ship: tracked files and untracked ones git does not ignore."""
    out = git(root, "ls-files", "-co", "--exclude-standard", "-z")
    if out.returncode != 0:
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [f for f in out.stdout.split("\0") if f and (root / f).exists()]


def dvc_outputs(root: Path) -> list[str]:
    """Every out, metric and plot of dvc.yaml's stages, foreach variables as `*`."""
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    found = []
    for stage in stages.values():
        body = stage.get("do", stage) if isinstance(stage, dict) else {}
        for key in ("outs", "metrics", "plots"):
            for entry in body.get(key) or []:
                name = next(iter(entry)) if isinstance(entry, dict) else entry
                found.append(re.sub(r"\$\{[^}]*\}", "*", str(name)).rstrip("/"))
    return found


def expand(path: str) -> list[str]:
    """`results/eval/<variant>.json` -> `results/eval/*.json`; `{a,b}` -> both."""
    path = re.sub(r"<[^>]*>|\bDIR\b|\bNAME\b", "*", path.rstrip("."))
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [q for alt in m.group(1).split(",") for q in expand(path[:m.start()] + alt.strip() + path[m.end():])]
    return [path]


def path_shipped(path: str, files: list[str], outs: list[str]) -> bool:
    path = path.rstrip("/")
    for f in files:
        if f == path or f.startswith(path + "/") or fnmatch.fnmatch(f, path) or fnmatch.fnmatch(f, path + "/*"):
            return True
    for o in [*outs, *WRITTEN_OUTSIDE_DVC]:
        if o == path or path.startswith(o + "/") or o.startswith(path + "/") or fnmatch.fnmatch(path, o) \
                or fnmatch.fnmatch(o, path) or fnmatch.fnmatch(path, o + "/*"):
            return True
    return False


def unshipped_paths(root: Path) -> list[Problem]:
    files, outs = shipped_files(root), dvc_outputs(root)
    problems = []
    for doc in doc_files(root):
        rel = str(doc.relative_to(root))
        for n, line in enumerate(doc.read_text(encoding="utf-8").split("\n"), 1):
            for m in PATH_RE.finditer(line):
                raw = m.group(1).rstrip(".")
                if raw.rstrip("/") in {p.rstrip("/") for p in CHECKED_PREFIXES} or "..." in raw or "…" in raw \
                        or raw in NOT_REPOSITORY_PATHS:
                    continue
                if not any(path_shipped(p, files, outs) for p in expand(raw)):
                    problems.append(Problem(rel, n, f"names `{raw}`, which is neither shipped (tracked by git) "
                                                    "nor written by a dvc.yaml stage"))
    return problems


# ---------------------------------------------------------------- main

def run(root: Path, check: bool) -> tuple[list[Problem], list[Problem], list[str]]:
    """(problems, blocks not checked, files rewritten)."""
    problems, unchecked, written = [], [], []
    for doc in doc_files(root):
        text = doc.read_text(encoding="utf-8")
        new, stale, skipped = process(root, doc)
        problems += stale
        unchecked += skipped
        if not check and new != text:
            write_atomic(doc, new)
            written.append(str(doc.relative_to(root)))
    if check:
        problems += unshipped_paths(root)
    return problems, unchecked, written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale or a "
                                                             "doc names a path the project does not ship")
    parser.add_argument("--list", action="store_true", help="the block kinds and what each reads")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        for kind, (_, what) in RENDERERS.items():
            print(f"{kind:20} {what}")
        return 0
    root = args.root.resolve()
    problems, unchecked, written = run(root, args.check)
    for p in unchecked:
        print(f"note: {p}")
    if args.check:
        for p in problems:
            print(p)
        if problems:
            print(f"{len(problems)} problem(s); stale blocks are rewritten by: {GENERATOR}")
            return 1
        print("docs: every number block matches its sources; every path they name is shipped")
        return 0
    for p in problems:  # blocks that could not be rendered stay as they were
        if "is stale" not in p.message:
            print(p)
    print("rewrote " + (", ".join(written) if written else "nothing (every block was current)"))
    return 1 if any("is stale" not in p.message for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
