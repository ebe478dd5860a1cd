"""Find the `<!-- numbers:KIND [ARG] -->` blocks of README.md and docs/*.md, render each from its sources, and say
which are stale; the registry of block kinds lives here."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .compare_blocks import (render_gate_summary, render_history_row, render_margin_move, render_verdict_summary,
                             render_verdicts)
from .measured_blocks import (render_admission_cost, render_evaluate_overhead, render_fanout, render_gate_operating,
                              render_measured_rows, render_pipeline_speed, render_quantize_overhead,
                              render_quantizer_settings, render_real_profile, render_trace_overhead)
from .params_blocks import render_params
from .result_blocks import (render_classifier, render_shadow_agreement, render_coverage, render_eval_accuracy, render_eval_fidelity,
                            render_fleet_plan, render_memory, render_quantize, render_reference,
                            render_reference_history)
from .sources import GENERATOR, Context, SourceMissing, provenance, undated

OPEN_RE = re.compile(r"^<!-- numbers:(?P<kind>[a-z0-9-]+)(?: (?P<arg>[^>]*?))? -->\s*$")
CLOSE = "<!-- /numbers -->"


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# kind -> (renderer, what it reads: --list prints it)
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
    "shadow-agreement": (render_shadow_agreement, "results/shadow.json: agreement with fp16 per variant and type"),
    "fleet-plan": (render_fleet_plan, "results/routing_table.json: the fleet plan beside its alternatives"),
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
    "trace-overhead": (render_trace_overhead, "docs/measured/trace_overhead.json (benchmarks/trace_overhead.py)"),
    "quantizer-settings": (render_quantizer_settings, "docs/measured/ARG.json (benchmarks/quantizer_settings.py)"),
    "measured-table": (render_measured_rows, "docs/measured/ARG.json: a table recorded with its date and command"),
    "real-profile": (render_real_profile, "docs/measured/real_profile.json and real_profile_sequential.json "
                                          "(benchmarks/real_profile.py); `stages fresh|sequential`; `seed-incident`: "
                                          "docs/measured/real_profile_seed_incident.json"),
}


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
    if arg and arg.startswith("@"):  # `@FOLDER [ARG]`: another run's results, copied into FOLDER (results/, params.yaml)
        ctx.run_copy, _, arg = arg[1:].partition(" ")
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
