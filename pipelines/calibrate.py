"""Stage `calibrate`: domain calibration sets, the mixed set the quantizers consume, and coverage.

The incident behind this stage: a GPTQ checkpoint lost accuracy on code requests because its
calibration set held too few code-comment samples, and nobody had compared the calibration set with
what production sends. So every set is built per domain from a recipe in params.yaml, and the
coverage report (pipelines/text/coverage.py) puts each domain's calibration share next to its share of real traffic.
"""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.core.errors import QuantgateError
from pipelines.core.io import atomic_dir, read_jsonl, sha256_file, sha256_text, write_json
from pipelines.core.params_requests import SourceParams
from pipelines.core.params_sections import CALIBRATED_METHODS, METHODS, CalibrationParams, CoverageParams
from pipelines.core.paths import BUILT_DIR, COVERAGE_DIR, METHOD_DIR
from pipelines.text import arithmetic
from pipelines.text.code_comments import bare_functions, extract
from pipelines.text.coverage import coverage_report, load_traffic, plot_classifier, plot_coverage

log = logging.getLogger(__name__)

MATH_LINES_PER_SAMPLE = 6


@dataclass(frozen=True)
class CalibrationText:
    text: str
    source: str  # file:line, or generator and index


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def _python_files(src: SourceParams) -> list[Path]:
    root = Path(src.path)
    if not root.exists():
        raise QuantgateError(f"calibration.sources: {root}: not found (domain {src.domain}, kind {src.kind})")
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    if not files:
        raise QuantgateError(f"calibration.sources: {root}: no .py files (domain {src.domain})")
    return files


def _from_datasets(src: SourceParams) -> list[CalibrationText]:
    """Local JSONL/Parquet/CSV files and hub datasets, all through `datasets.load_dataset`."""
    import datasets

    if src.kind == "hf":
        ds = datasets.load_dataset(src.name, src.config, split=src.split)
        where = f"{src.name}:{src.split}"
    else:
        path = Path(src.path)
        if not path.is_file():
            raise QuantgateError(f"calibration.sources: {path}: file not found (domain {src.domain})")
        if src.kind == "jsonl":  # datasets reports bad JSON without a line number; check it first
            for number, row in enumerate(read_jsonl(path), start=1):
                if not isinstance(row.get(src.text_field), str):
                    raise QuantgateError(f"{path}:{number}: no string field '{src.text_field}' (text_field)")
        builder = {"jsonl": "json", "parquet": "parquet", "csv": "csv"}[src.kind]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        where = str(path)
    if src.text_field not in ds.column_names:
        raise QuantgateError(f"{where}: no column '{src.text_field}' (text_field); columns: {ds.column_names}")
    return [CalibrationText(t, f"{where}:{i + 1}") for i, t in enumerate(ds[src.text_field]) if isinstance(t, str)]


def load_source(src: SourceParams, seed: int) -> list[CalibrationText]:
    """Every candidate text one source offers, with where each came from."""
    try:
        return _load_source(src, seed)
    except SyntaxError as err:
        raise QuantgateError(f"calibration.sources: {err.msg}") from None


def _load_source(src: SourceParams, seed: int) -> list[CalibrationText]:
    if src.kind == "python_code":
        return [CalibrationText(s.text, f"{p}:{s.line}") for p in _python_files(src)
                for s in bare_functions(p.read_text(encoding="utf-8"), str(p))]
    if src.kind == "python_comments":
        return [CalibrationText(s.text, f"{p}:{s.line}") for p in _python_files(src)
                for s in extract(p.read_text(encoding="utf-8"), str(p))]
    if src.kind == "math":
        lines = arithmetic.math_lines(seed, src.count * MATH_LINES_PER_SAMPLE)
        return [CalibrationText("\n".join(lines[i : i + MATH_LINES_PER_SAMPLE]), f"math-generator(seed={seed}):{i // MATH_LINES_PER_SAMPLE + 1}")
                for i in range(0, len(lines), MATH_LINES_PER_SAMPLE)]
    return _from_datasets(src)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def quotas(recipe: CalibrationParams) -> dict[str, int]:
    """Samples per domain: `samples` split by weight, largest remainder, summing exactly to `samples`."""
    domains = recipe.domains
    total_w = sum(recipe.weight(d) for d in domains)
    raw = {d: recipe.samples * recipe.weight(d) / total_w for d in domains}
    out = {d: int(v) for d, v in raw.items()}
    for d in sorted(domains, key=lambda d: (out[d] - raw[d], d))[: recipe.samples - sum(out.values())]:
        out[d] += 1
    return out


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def shingles(text: str, n: int = 5) -> frozenset[str]:
    """Character n-grams of the normalised text: the unit of near-duplicate detection.

    Characters, not words, so that Chinese (no spaces) and code are compared as finely as English.
    """
    norm = _normalise(text)
    return frozenset(norm[i : i + n] for i in range(max(1, len(norm) - n + 1)))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def select(domain: str, candidates: list[CalibrationText], want: int, recipe: CalibrationParams, tokenizer) -> tuple[list[dict], dict]:
    """Seeded pick of `want` samples within the token bounds, exact and near duplicates skipped."""
    order = list(range(len(candidates)))
    random.Random(f"{recipe.seed}:{domain}").shuffle(order)
    kept: list[dict] = []
    kept_shingles: list[frozenset] = []
    seen: set[str] = set()
    stats = {"out_of_length_bounds": 0, "exact_duplicates": 0, "near_duplicates": 0}
    for i in order:
        if len(kept) == want:
            break
        cand = candidates[i]
        n_tokens = len(tokenizer(cand.text, add_special_tokens=False)["input_ids"])
        if not recipe.min_tokens <= n_tokens <= recipe.max_tokens:
            stats["out_of_length_bounds"] += 1
            continue
        key = sha256_text(_normalise(cand.text))
        if key in seen:
            stats["exact_duplicates"] += 1
            continue
        sh = shingles(cand.text)
        if any(jaccard(sh, other) >= recipe.near_duplicate_jaccard for other in kept_shingles):
            stats["near_duplicates"] += 1
            continue
        seen.add(key)
        kept_shingles.append(sh)
        kept.append({"id": f"{domain}-{len(kept):04d}", "domain": domain, "text": cand.text,
                     "source": cand.source, "tokens": n_tokens, "sha256": sha256_text(cand.text)})
    if len(kept) < want:
        raise QuantgateError(
            f"calibration: domain '{domain}' needs {want} samples but its sources hold only {len(kept)} within "
            f"{recipe.min_tokens}-{recipe.max_tokens} tokens after dedup ({stats} of {len(candidates)} "
            "candidates); lower calibration.samples or its weight, widen the token bounds, or add a source"
        )
    return kept, {"candidates": len(candidates), "scanned": sum(stats.values()) + len(kept), **stats}


def token_stats(rows: list[dict]) -> dict:
    lengths = np.array([r["tokens"] for r in rows])
    return {"count": len(rows), "tokens_total": int(lengths.sum()), "tokens_min": int(lengths.min()),
            "tokens_mean": round(float(lengths.mean()), 2), "tokens_p50": round(float(np.percentile(lengths, 50)), 2),
            "tokens_p95": round(float(np.percentile(lengths, 95)), 2), "tokens_max": int(lengths.max())}


def build_sets(recipe: CalibrationParams, tokenizer) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """(per-domain rows, mixed rows, per-domain selection stats) for a recipe."""
    by_domain: dict[str, list[CalibrationText]] = {d: [] for d in recipe.domains}
    for src in recipe.sources:
        if src.domain in by_domain:
            by_domain[src.domain].extend(load_source(src, recipe.seed))
    sets, stats = {}, {}
    for domain, want in quotas(recipe).items():
        if not by_domain[domain]:
            raise QuantgateError(f"calibration: domain '{domain}' is empty: no entry of calibration.sources gives it text")
        sets[domain], stats[domain] = select(domain, by_domain[domain], want, recipe, tokenizer)
    mixed = [row for domain in recipe.domains for row in sets[domain]]
    random.Random(recipe.seed).shuffle(mixed)
    return sets, mixed, stats


def write_sets(sets: dict[str, list[dict]], mixed: list[dict], stats: dict, recipe: CalibrationParams,
               tokenizer_name: str, out_dir: Path = BUILT_DIR) -> dict:
    """Write each set through `datasets` (JSONL) and a manifest, all or nothing."""
    from datasets import Dataset

    with atomic_dir(out_dir) as tmp:
        files = {}
        for name, rows in [*sets.items(), ("mixed", mixed)]:
            path = tmp / f"{name}.jsonl"
            Dataset.from_list(rows).to_json(str(path), force_ascii=False)
            files[f"{name}.jsonl"] = sha256_file(path)
        # What each quantization method reads: the mixed set, or nothing. quantize@<variant> depends on its
        # method's file only, so fp16 and int8 do not re-run when the recipe changes.
        (tmp / METHOD_DIR).mkdir()
        for method in METHODS:
            path = tmp / METHOD_DIR / f"{method}.jsonl"
            path.write_bytes((tmp / "mixed.jsonl").read_bytes() if method in CALIBRATED_METHODS else b"")
            files[f"{METHOD_DIR}/{method}.jsonl"] = sha256_file(path)
        manifest = {
            "recipe": recipe.model_dump(mode="json"),
            "tokenizer": tokenizer_name,
            "files": files,
            "mixed_sha256": files["mixed.jsonl"],
            "domains": {d: {**token_stats(rows), "selection": stats[d],
                            "sources": dict(Counter(r["source"].rsplit(":", 1)[0] for r in rows))}
                        for d, rows in sets.items()},
            "mixed": token_stats(mixed),
            "excluded": list(recipe.exclude),
        }
        write_json(tmp / "manifest.json", manifest)
    return manifest


def run(recipe: CalibrationParams, cov: CoverageParams, tokenizer, tokenizer_name: str,
        built_dir: Path = BUILT_DIR, coverage_dir: Path = COVERAGE_DIR) -> dict:
    """The whole stage; raises QuantgateError on bad input before anything is written."""
    traffic, truth = load_traffic(cov)
    sets, mixed, stats = build_sets(recipe, tokenizer)
    report = coverage_report(traffic, sets, mixed, cov, tokenizer, truth)
    manifest = write_sets(sets, mixed, stats, recipe, tokenizer_name, built_dir)
    report["calibration_sha256"] = manifest["mixed_sha256"]
    write_json(coverage_dir / "coverage.json", report)
    plot_coverage(report, coverage_dir)
    write_json(coverage_dir / "classifier.json", report["classifier"])
    plot_classifier(report["classifier"], coverage_dir)
    return report


def main() -> int:
    """Stage `calibrate`: build the domain calibration sets and check their coverage against production traffic."""
    from pipelines.core.params import load_params
    from pipelines.models.loading import load_tokenizer, resolve_model

    params = load_params()
    source = resolve_model(params.model)
    report = run(params.calibration, params.coverage, load_tokenizer(source), source.location)
    for domain, row in report["domains"].items():
        log.info("calibrate: %-12s production %5.1f%%  calibration %5.1f%%  n-gram coverage %s%s", domain,
                 100 * row["production_share"], 100 * row["calibration_share"],
                 "-" if row["ngram_coverage"] is None else f"{100 * row['ngram_coverage']:.0f}%",
                 "  UNDER-REPRESENTED" if row["under_represented"] else "")
    measured = report["classifier"]

    def percent(accuracy: float | None) -> str:
        return "-" if accuracy is None else f"{100 * accuracy:.1f}%"

    log.info("calibrate: classifier accuracy %s on %d labelled requests (%s), confusion matrix in %s",
             percent(measured["accuracy"]), measured["labelled_requests"],
             ", ".join(f"{t} {percent(v['accuracy'])}" for t, v in measured["types"].items()),
             COVERAGE_DIR / "classifier_confusion.png")
    log.info("calibrate: sets in %s, coverage in %s", BUILT_DIR, COVERAGE_DIR / "coverage.json")
    problems = []
    if report["under_represented"]:
        problems.append(f"calibration set under-represents {', '.join(report['under_represented'])} "
                        f"against {params.coverage.traffic} ({report['rule']})")
    if report["classifier_flagged"]:
        problems.append("the classifier recognises too few labelled requests of " + ", ".join(
            f"{t} ({100 * measured['types'][t]['accuracy']:.1f}%, {measured['types'][t]['correct']}/"
            f"{measured['types'][t]['requests']})" for t in report["classifier_flagged"])
            + f" in {params.coverage.traffic}, below coverage.min_classifier_accuracy "
            f"{params.coverage.min_classifier_accuracy}; the coverage shares of those types are not to be trusted")
    unknown = report["unknown"]
    log.info("calibrate: unknown (no type claims it, served by fp16) %5.1f%% of production traffic%s",
             100 * unknown["production_share"], "  ABOVE coverage.max_unknown_share" if unknown["flagged"] else "")
    if unknown["flagged"]:
        problems.append(f"{100 * unknown['production_share']:.1f}% of {params.coverage.traffic} is claimed by no "
                        f"request type (above coverage.max_unknown_share {params.coverage.max_unknown_share}): fp16 "
                        "serves it and no probe measures it; declare the request types it holds")
    for message in problems:
        if params.coverage.on_gap == "fail":
            raise QuantgateError("; ".join(problems) + "; coverage.on_gap is 'fail'")
        log.warning("calibrate: warning: %s", message)
    return 0
