"""Calibration coverage against production traffic, and how well the request classifier names labelled requests.

The calibrate stage (pipelines/calibrate.py) builds the sets; this module measures them against a
production sample (shares, length distance, n-gram coverage per domain), measures the classifier on
the labelled rows, and draws both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy.spatial.distance import jensenshannon

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_jsonl, write_json
from pipelines.core.params_sections import CoverageParams
from pipelines.core.paths import COVERAGE_DIR
from pipelines.text.classify import UNDECIDED, UNKNOWN, Classifier
from pipelines.text.pii import mask

LENGTH_BINS = [0, 8, 16, 32, 64, 128, 256, 512, 1024, 1 << 30]


def _histogram(lengths: list[int]) -> np.ndarray:
    counts, _ = np.histogram(lengths, bins=LENGTH_BINS)
    return counts.astype(float)


def _ngrams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def classifier_report(texts: list[str], labels: list[str | None], cov: CoverageParams,
                      predicted: list[str] | None = None) -> dict:
    """How often the classifier names a labelled request's true type: per type, overall, and the confusion matrix.

    Only rows with a label count (None: unlabelled). Per true type: its requests, how many the classifier named
    correctly, the accuracy and `below_threshold` (accuracy < coverage.min_classifier_accuracy); a type with no
    labelled request has accuracy None and is not flagged. `confusion[true][predicted]` counts every pairing, with
    `unknown` and `ambiguous` as predicted columns; `predicted` (the classifier's answers) is computed if not given.
    Requests labelled `unknown` (no declared type describes them) are a row of their own: right when no rule claims
    them, since a claimed one is served by a variant no probe measured on it.
    """
    declared = sorted(cov.classify)
    undeclared = sorted({lab for lab in labels if lab is not None and lab not in declared and lab != UNKNOWN})
    if undeclared:
        raise QuantgateError(f"label {undeclared[0]!r} is not a declared request type; declared: {', '.join(declared)}"
                             f" (or {UNKNOWN}: none of them)")
    types = declared + ([UNKNOWN] if UNKNOWN in labels else [])
    if predicted is None:
        classifier = Classifier(cov.classify)
        predicted = [classifier.classify(mask(t)) for t in texts]
    columns = [*declared, *UNDECIDED]
    confusion = {t: dict.fromkeys(columns, 0) for t in types}
    for lab, pred in zip(labels, predicted):
        if lab is not None:
            confusion[lab][pred] += 1
    per_type = {}
    for t in types:
        n, correct = sum(confusion[t].values()), confusion[t][t]
        accuracy = correct / n if n else None
        per_type[t] = {"requests": n, "correct": correct,
                       "accuracy": round(accuracy, 4) if accuracy is not None else None,
                       "below_threshold": accuracy is not None and accuracy < cov.min_classifier_accuracy,
                       **{u: confusion[t][u] for u in UNDECIDED}}
    labelled = sum(v["requests"] for v in per_type.values())
    correct = sum(v["correct"] for v in per_type.values())
    return {
        "labelled_requests": labelled,
        "unlabelled_requests": sum(lab is None for lab in labels),
        "label_field": cov.label_field,
        "threshold": cov.min_classifier_accuracy,
        "rule": f"flagged when a type's accuracy on its labelled requests < {cov.min_classifier_accuracy}",
        "accuracy": round(correct / labelled, 4) if labelled else None,
        "correct": correct,
        **{u: sum(confusion[t][u] for t in declared) for u in UNDECIDED},  # declared types' requests left undecided
        "flagged": [t for t, v in per_type.items() if v["below_threshold"]],
        "types": per_type,
        "columns": columns,
        "confusion": confusion,
    }


def coverage_report(traffic: list[str], sets: dict[str, list[dict]], mixed: list[dict], cov: CoverageParams,
                    tokenizer, truth: list[str | None] | None = None) -> dict:
    """Per domain: production vs calibration share, length distance, n-gram coverage, and the flag; with `truth`
    (each request's label, or None) also how accurate the classifier is on the labelled ones (`classifier`)."""
    masked = [mask(t) for t in traffic]
    classifier = Classifier(cov.classify)
    labels = [classifier.classify(t) for t in masked]
    measured = classifier_report(masked, truth or [None] * len(traffic), cov, predicted=labels)
    prod_ids = tokenizer(masked, add_special_tokens=False)["input_ids"]
    calib_ngrams = set().union(*(_ngrams(ids, cov.ngram) for ids in
                                 tokenizer([r["text"] for r in mixed], add_special_tokens=False)["input_ids"]))
    domains = {}
    for d in sorted(cov.classify):
        idx = [i for i, lab in enumerate(labels) if lab == d]
        rows = sets.get(d, [])
        prod_share = len(idx) / len(traffic)
        calib_share = len(rows) / len(mixed)
        prod_hist = _histogram([len(prod_ids[i]) for i in idx])
        calib_hist = _histogram([r["tokens"] for r in rows])
        js = (float(jensenshannon(prod_hist, calib_hist, base=2))
              if prod_hist.sum() and calib_hist.sum() else (0.0 if not prod_hist.sum() else 1.0))
        prod_ngrams = set().union(*(_ngrams(prod_ids[i], cov.ngram) for i in idx)) if idx else set()
        ngram_cov = len(prod_ngrams & calib_ngrams) / len(prod_ngrams) if prod_ngrams else None
        flagged = calib_share < cov.min_share_ratio * prod_share
        domains[d] = {
            "production_requests": len(idx),
            "production_share": round(prod_share, 4),
            "calibration_samples": len(rows),
            "calibration_share": round(calib_share, 4),
            "share_ratio": round(calib_share / prod_share, 4) if prod_share else None,
            "length_js_distance": round(js, 4),
            "ngram_coverage": round(ngram_cov, 4) if ngram_cov is not None else None,
            "under_represented": flagged,
            "classifier_accuracy": measured["types"][d]["accuracy"],  # None: no labelled request of this type
            "examples": [masked[i][:200] for i in idx[:2]],
        }
    gaps = [d for d, v in domains.items() if v["under_represented"]]
    unknown = [i for i, lab in enumerate(labels) if lab == UNKNOWN]
    unknown_share = len(unknown) / len(traffic)
    return {
        "traffic_requests": len(traffic),
        # what no declared type claims is served by fp16 and measured by no probe: a large share means a request type
        # is missing (coverage.max_unknown_share; on_gap applies)
        "unknown": {"production_requests": len(unknown), "production_share": round(unknown_share, 4),
                    "max_share": cov.max_unknown_share, "flagged": unknown_share > cov.max_unknown_share,
                    "rule": f"flagged when the share of production requests no type claims > {cov.max_unknown_share}",
                    "examples": [masked[i][:200] for i in unknown[:2]]},
        "rule": f"flagged when calibration_share < {cov.min_share_ratio} x production_share",
        "on_gap": cov.on_gap,
        "under_represented": gaps,
        "covered": not gaps,
        "domains": domains,
        # the shares above are the classifier's; a type it recognises too rarely makes them wrong (on_gap applies)
        "classifier_flagged": measured["flagged"],
        "classifier": measured,
    }


def load_traffic(cov: CoverageParams) -> tuple[list[str], list[str | None]]:
    """(texts, labels) of the production sample; a row without `coverage.label_field` has label None, a request no
    declared type describes has label `unknown`."""
    rows = read_jsonl(cov.traffic)
    if not rows:
        raise QuantgateError(f"{cov.traffic}: no requests (coverage.traffic)")
    texts, labels = [], []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get(cov.text_field), str):
            raise QuantgateError(f"{cov.traffic}:{number}: no string field '{cov.text_field}' (coverage.text_field)")
        label = row.get(cov.label_field)
        if label is not None and (not isinstance(label, str) or (label not in cov.classify and label != UNKNOWN)):
            raise QuantgateError(f"{cov.traffic}:{number}: label {label!r} ({cov.label_field}) is not a declared "
                                 f"request type; declared: {', '.join(sorted(cov.classify))} (requests in params.yaml), "
                                 f"or {UNKNOWN} for a request none of them describes")
        texts.append(row[cov.text_field])
        labels.append(label)
    return texts, labels


def plot_coverage(report: dict, out_dir: Path = COVERAGE_DIR) -> None:
    """A bar chart (PNG) and its data for `dvc plots`: production vs calibration share per domain."""
    from pipelines.core.plots import grouped_bars

    rows = [{"domain": d, "set": kind, "share": v[f"{kind}_share"]}
            for d, v in report["domains"].items() for kind in ("production", "calibration")]
    write_json(out_dir / "coverage_shares.json", rows)
    labels = [f"{d} (under-represented)" if v["under_represented"] else d for d, v in report["domains"].items()]
    grouped_bars(out_dir / "coverage.png", labels,
                 {"production": [v["production_share"] for v in report["domains"].values()],
                  "calibration": [v["calibration_share"] for v in report["domains"].values()]},
                 title="Calibration set vs production traffic", ylabel="share of requests / samples")


def plot_classifier(measured: dict, out_dir: Path = COVERAGE_DIR) -> None:
    """The confusion matrix as a heatmap (PNG, counts in the cells, shaded by share of the true type's requests),
    and one {actual, predicted} row per labelled request for `dvc plots` (its confusion template)."""
    from pipelines.core.plots import plt, save

    types, columns = list(measured["confusion"]), measured["columns"]
    write_json(out_dir / "classifier_predictions.json",
               [{"actual": t, "predicted": p} for t in types for p in columns for _ in range(measured["confusion"][t][p])])
    counts = np.array([[measured["confusion"][t][p] for p in columns] for t in types], dtype=float)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(2.2 + 1.1 * len(columns), 1.4 + 0.6 * len(types)))
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for i in range(len(types)):
        for j in range(len(columns)):
            ax.text(j, i, f"{int(counts[i, j])}", ha="center", va="center", fontsize=8,
                    color="white" if shares[i, j] > 0.6 else "black")
    rows = []
    for t in types:
        v = measured["types"][t]
        acc = "-" if v["accuracy"] is None else f"{100 * v['accuracy']:.1f}%"
        rows.append(f"{t} ({acc}{', BELOW THRESHOLD' if v['below_threshold'] else ''})")
    ax.set_xticks(range(len(columns)), columns, rotation=20, ha="right", fontsize=8)
    ax.set_yticks(range(len(types)), rows, fontsize=8)
    ax.set_xlabel("classified as")
    ax.set_ylabel("labelled (accuracy)")
    overall = "no labelled requests" if measured["accuracy"] is None else f"accuracy {100 * measured['accuracy']:.1f}%"
    ax.set_title(f"Request classifier on the labelled production sample: {overall} "
                 f"(threshold {100 * measured['threshold']:.0f}%)", fontsize=9)
    save(fig, out_dir / "classifier_confusion.png")
