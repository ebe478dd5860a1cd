"""Re-measuring the recorded evidence (`quantgate audit`, `quantgate gate --audit`).

Everything after evaluate re-derives faithfully from the per-item records, the lm-eval scores and the fidelity
numbers; nothing downstream can tell a record that was measured from one that was edited and committed with
`dvc commit -f`. The audit checks two things. First, every recorded summary against the records it claims to
summarise (an lm-eval score against its items' mean, a fidelity summary against its per-text rows and fp16's
base file). Second, a fresh random sample of the records against the checkpoint itself: the sampled items are
re-generated and re-scored with the same lm-eval task and settings, the sampled texts' per-token KL re-computed.
A record further from its re-measurement than the tolerance (params `audit:`, set above the measured float noise:
docs/record-gate.md, "Audit") is named, variant, request type and item.
"""

from __future__ import annotations

import ast
import logging
import math
import random
import time

from pipelines.core import logs
from pipelines.core.io import read_json, read_jsonl
from pipelines.core.isolation import run_isolated
from pipelines.core.paths import BASELINE, EVAL_RESULTS, FIDELITY_BASE, FIDELITY_TEXTS, VARIANTS_DIR
from pipelines.evaluation.plans import by_id

log = logging.getLogger(__name__)
SUMMARY_RTOL = 1e-6  # a summary recomputed from its own records: the same float32 arithmetic, so only rounding


def loglikelihood(response: str) -> tuple[float, bool] | None:
    """A multiple-choice record's response, lm-eval's `(log-likelihood, is_greedy)` of its first choice; None for a
    generated answer (compared as text)."""
    try:
        value = ast.literal_eval(response)
    except (ValueError, SyntaxError, TypeError):
        return None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (int, float)) and isinstance(value[1], bool):
        return float(value[0]), value[1]
    return None


def draw(records: dict[str, dict[str, list[str]]], texts: dict[str, dict[str, int]], items: int, per_text: int,
         seed: int) -> dict:
    """The audit's sample: per variant and row, `items` recorded item ids; per variant and domain, `per_text` text
    indices. Sorted before drawing, so one seed gives one sample whatever order the records are in."""
    rng = random.Random(seed)
    sample = {}
    for name in sorted(records):
        sample[name] = {
            "items": {row: sorted(rng.sample(sorted(ids), min(items, len(ids)))) for row, ids in sorted(records[name].items())},
            "texts": {d: sorted(rng.sample(range(n), min(per_text, n))) for d, n in sorted(texts.get(name, {}).items())}}
    return sample


def _close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=SUMMARY_RTOL, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return a == b


def summary_problems(name: str, result: dict, items: list[dict], texts: list[dict], base: dict) -> list[dict]:
    """Recorded summaries that are not what their own records give: lm-eval score and item count against the
    per-item records, each fidelity summary against its per-text rows and fp16's base file."""
    from pipelines.evaluation import fidelity

    problems = []
    rows_ok = {row for row, s in (result.get("probes") or {}).items() if s.get("status") == "ok"}
    for row, s in (result.get("probes") or {}).items():
        if row not in rows_ok:
            continue
        recs = by_id(items, row)
        mean = sum(r.get("correct") is True for r in recs.values()) / len(recs) if recs else None
        blocks = sum(b.get("items", 0) for b in s.get("blocks") or [])
        if s.get("items") != len(recs) or (s.get("blocks") and blocks != len(recs)):
            problems.append({"variant": name, "row": row, "items": [],
                             "what": f"lm-eval counted {s.get('items')} items, {len(recs)} per-item records"})
        elif mean is None or not isinstance(s.get("score"), (int, float)) or abs(s["score"] - mean) > 1e-9:
            problems.append({"variant": name, "row": row, "items": [],
                             "what": f"lm-eval score {s.get('score')!r} is not its {len(recs)} records' mean {mean}"})
    strays = sorted({r.get("item_id") for r in items} - {i for row in rows_ok for i in by_id(items, row)}, key=str)
    if strays:
        problems.append({"variant": name, "row": "?", "items": strays[:20],
                         "what": "per-item records of no row lm-eval scored"})
    for domain, fid in (result.get("fidelity") or {}).items():
        rows = sorted((t for t in texts if t.get("domain") == domain), key=lambda t: t.get("text", -1))
        try:
            if [t.get("text") for t in rows] != list(range(len(base[f"{domain}.lengths"]))):
                raise ValueError(f"{len(rows)} per-text rows for {len(base[f'{domain}.lengths'])} stored texts")
            again = fidelity.summary(rows, base, domain)
        except (KeyError, ValueError, TypeError) as err:
            problems.append({"variant": name, "row": domain, "items": [], "what": f"fidelity per-text rows: {err}"})
            continue
        if not _close(again, fid):
            bad = sorted(k for k in again.keys() | fid.keys() if not _close(again.get(k), fid.get(k)))
            problems.append({"variant": name, "row": domain, "items": [],
                             "what": f"fidelity summary ({', '.join(bad)}) is not what its per-text rows give"})
    return problems


def _item_difference(old: dict, new: dict | None, tol: float) -> tuple[str | None, float]:
    """Why a re-measured item disagrees with its record (None: it agrees), and its log-likelihood difference."""
    if new is None:
        return "not re-measured", 0.0
    for key in ("doc_hash", "prompt_hash", "target"):
        if old.get(key) != new.get(key):
            return f"{key} differs: the item is not the one recorded", 0.0
    old_ll, new_ll = loglikelihood(str(old.get("response"))), loglikelihood(new["response"])
    delta = abs(old_ll[0] - new_ll[0]) if old_ll and new_ll else 0.0
    if old.get("correct") is not new["correct"]:
        return f"recorded correct={old.get('correct')!r}, re-measured {new['correct']}", delta
    if old_ll and new_ll:
        if delta > tol or old_ll[1] != new_ll[1]:
            return f"recorded {old.get('response')}, re-measured {new['response']}", delta
    elif str(old.get("response")) != new["response"]:
        return f"recorded response {str(old.get('response'))[:40]!r}, re-measured {new['response'][:40]!r}", delta
    return None, delta


def remeasure(model, tokenizer, name: str, plans: dict, p, sample: dict, texts: list[dict], base: dict,
              items: list[dict], audit, device: str) -> tuple[list[dict], dict]:
    """Re-generate and re-score the sampled items, re-compute the sampled texts' per-token KL; (problems, the
    largest differences seen: what the tolerances are measured against)."""
    from pipelines.evaluation import fidelity
    from pipelines.evaluation.harness import run_probes, task_configs

    noise = {"logprob": 0.0, "kl": 0.0, "items": 0, "texts": 0, "mismatched": 0, "tolerated": []}
    problems = []
    picked = {row: ids for row, ids in sample["items"].items() if ids}
    recorded = {row: by_id(items, row) for row in picked}
    requests = {row: [int(recorded[row][i]["doc_id"]) for i in ids] for row, ids in picked.items()}
    configs = task_configs({r: plans[r] for r in picked})
    probes = {r: plans[r]["probe"] for r in picked if "probe" in plans[r]}
    summary, fresh = run_probes(model, tokenizer, requests, p.batch_size, p.allow_unisolated_code, configs, probes) \
        if requests else ({}, [])
    for row, ids in picked.items():
        if (summary.get(row) or {}).get("status") != "ok":
            problems.append({"variant": name, "row": row, "items": ids, "what": "could not be re-measured here: "
                             f"{(summary.get(row) or {}).get('reason', 'no result')}"})
            continue
        again = by_id(fresh, row)
        bad = {}
        for i in ids:
            why, delta = _item_difference(recorded[row][i], again.get(i), audit.logprob_tolerance)
            noise["logprob"] = max(noise["logprob"], delta)
            noise["items"] += 1
            if why:
                bad[i] = why
        noise["mismatched"] = max(noise["mismatched"], len(bad))
        if len(bad) > audit.max_mismatched_items:
            problems.append({"variant": name, "row": row, "items": sorted(bad),
                             "what": "; ".join(f"{i}: {w}" for i, w in sorted(bad.items())[:5])})
        elif bad:  # within the measured noise; kept, so a repeated audit can look at it
            noise["tolerated"] += [f"{name} {row} {i}: {w}" for i, w in sorted(bad.items())]
    by_text = {(t.get("domain"), t.get("text")): t for t in texts}
    for domain, indices in sample["texts"].items():
        bad = {}
        for new in fidelity.text_values(model, base, domain, indices, device):
            old = by_text.get((domain, new["text"])) or {}
            noise["texts"] += 1
            if any(len(old.get(k) or []) != len(new[k]) for k in ("kl", "logprob", "same_top1")):
                bad[new["text"]] = "token count differs"
                continue
            dkl = max(abs(a - b) for a, b in zip(old["kl"], new["kl"]))
            dlp = max(abs(a - b) for a, b in zip(old["logprob"], new["logprob"]))
            noise["kl"], noise["logprob"] = max(noise["kl"], dkl), max(noise["logprob"], dlp)
            flipped = sum(a != b for a, b in zip(old.get("same_top1") or [], new["same_top1"]))
            if dkl > audit.kl_tolerance or dlp > audit.logprob_tolerance or flipped > 1:  # one near tie is noise
                bad[new["text"]] = f"per-token KL off by up to {dkl:.3g}, log-prob by {dlp:.3g}, top-1 on {flipped} tokens"
        if bad:
            problems.append({"variant": name, "row": f"{domain} fidelity", "items": [f"text {j}" for j in sorted(bad)],
                             "what": "; ".join(f"text {j}: {w}" for j, w in sorted(bad.items())[:5])})
    return problems, noise


def remeasure_models(names: list[str], params, sample: dict, device: str) -> dict:
    """In the audit's child process: each model's checkpoint and records loaded in turn and its sample re-measured
    (`remeasure`); {name: {problems, noise, seconds}}, or the reason one could not be."""
    from pipelines.evaluation import fidelity
    from pipelines.evaluation.plans import probe_plans

    p = params.evaluate
    # no distributions when fp16's baseline is a sample log (baseline_log.py): no texts to re-measure
    plans, out = probe_plans(p.domains, p), {}
    base = fidelity.load_base(FIDELITY_BASE) if FIDELITY_BASE.exists() else {}
    with logs.progress(total=len(names), desc="audit (re-measuring)", unit="model") as bar:
        for name in names:
            out[name] = _remeasure_one(name, params, plans, base, sample[name], device)
            bar.update()
    return out


def _remeasure_one(name: str, params, plans: dict, base: dict, sample: dict, device: str) -> dict | str:
    """One model's re-measured sample, or why it could not be (a Python error loading or running it)."""
    from pipelines.models.loading import load_variant

    start = time.perf_counter()
    try:
        items = read_jsonl(EVAL_RESULTS / name / "items.jsonl")
        texts = read_jsonl(EVAL_RESULTS / name / FIDELITY_TEXTS)
        model, tokenizer = load_variant(str(VARIANTS_DIR / name), device, params.gpus.shares())
        if tokenizer.pad_token is None:  # as evaluate did (harness.evaluate_variant)
            tokenizer.pad_token = tokenizer.eos_token
        problems, noise = remeasure(model, tokenizer, name, plans, params.evaluate, sample, texts, base, items,
                                    params.audit, device)
    except Exception as err:  # noqa: BLE001 - that model's evidence is not vouched for; the others' still is
        log.debug("audit %s", name, exc_info=True)
        return f"{type(err).__name__}: {err}"
    return {"problems": problems, "noise": noise, "seconds": round(time.perf_counter() - start, 2)}


def audit(params, names: list[str], seed: int, device: str) -> dict:
    """The whole audit over `names` (variants and candidates, fp16 included when asked): summaries against their
    records, then each model's sample re-measured. Returns what `results/audit.json` keeps."""
    from pipelines.evaluation import fidelity
    from pipelines.evaluation.plans import row_of
    from pipelines.models.loading import no_model_here

    p, tol = params.evaluate, params.audit
    base = fidelity.load_base(FIDELITY_BASE) if FIDELITY_BASE.exists() else {}  # none: fp16's is a sample log
    problems, loaded, skipped = [], {}, {}
    for name in names:
        path = EVAL_RESULTS / f"{name}.json"
        try:
            result = read_json(path)
            items = read_jsonl(EVAL_RESULTS / name / "items.jsonl")
            texts = read_jsonl(EVAL_RESULTS / name / FIDELITY_TEXTS)
        except Exception as err:  # noqa: BLE001 - a missing or unreadable record is evidence that cannot be audited
            problems.append({"variant": name, "row": "*", "items": [], "what": f"records unreadable: {err}"})
            continue
        if result.get("status") != "ok":  # no evidence for it to be trusted on: the gate judges it failed already
            skipped[name] = f"evaluation {result.get('status')}: nothing recorded to audit"
            continue
        if name == BASELINE and result.get("baseline"):  # fp16's records are its team's log: nothing here to re-run
            skipped[name] = ("not re-measured: fp16's records come from "
                             + (f"its endpoint {result['baseline']['base_url']}" if result["baseline"].get("base_url")
                                else f"its lm-eval sample log ({result['baseline'].get('path')})")
                             + ", checked and scored again by the baseline stage")
            continue
        if no_model_here(VARIANTS_DIR / name):  # said, never silently left out: the gate prints it with the audit
            skipped[name] = ("not re-measured: its evidence is an lm-eval sample log (a team's, or the one evaluate "
                             "wrote against its endpoint), no model here to re-run; the records are that log's")
            continue
        problems += summary_problems(name, result, items, texts, base)
        loaded[name] = (result, items, texts)
    rows = {n: {row: [r["item_id"] for r in items if row_of(r) == row]
                for row, s in (res.get("probes") or {}).items() if s.get("status") == "ok"}
            for n, (res, items, _) in loaded.items()}
    counts = {n: {d: len(base[f"{d}.lengths"]) for d in (res.get("fidelity") or {})} for n, (res, _, _) in loaded.items()}
    sample = draw(rows, counts, tol.items, tol.texts, seed)
    noise = {"logprob": 0.0, "kl": 0.0, "items": 0, "texts": 0, "mismatched": 0, "tolerated": []}
    seconds = {}
    # one process for every model: the imports (torch, transformers, lm-eval) are most of an audit's time, and a
    # checkpoint's loading code that crashes or hangs still cannot take the caller down (its own process, a timeout)
    done, error = run_isolated(remeasure_models, (list(loaded), params, sample, device),
                               p.timeout_seconds, "audit", logs.current_log_file) if loaded else ({}, None)
    seconds = {}
    for name in loaded:
        found = (done or {}).get(name)
        if found is None or isinstance(found, str):
            why = found or error or "no result"
            problems.append({"variant": name, "row": "*", "items": [], "what": f"could not be re-measured: {why}"})
            continue
        problems += found["problems"]
        seen = found["noise"]
        for key in noise:
            noise[key] = noise[key] + seen[key] if key in ("items", "texts", "tolerated") else max(noise[key], seen[key])
        seconds[name] = found["seconds"]
    if BASELINE in skipped or BASELINE not in loaded and not any(p["variant"] == BASELINE for p in problems):
        problems.append({"variant": BASELINE, "row": "*", "items": [], "what": "fp16's records were not audited "
                         f"({skipped.get(BASELINE, 'not among the audited')}): every variant is judged against them"})
    if not noise["items"] or not noise["texts"]:  # an audit that re-measured nothing vouches for nothing
        problems.append({"variant": "*", "row": "*", "items": [], "what": f"re-measured {noise['items']} items and "
                         f"{noise['texts']} texts: nothing was audited"})
    return {"seed": seed, "verdict": "refused" if problems else "ok", "variants": list(names), "skipped": skipped,
            "sample": sample, "problems": problems, "largest_difference": noise, "seconds": seconds,
            "tolerance": tol.model_dump(), "baseline": BASELINE}


def describe(problem: dict) -> str:
    """One line naming variant, request type and items."""
    items = problem.get("items") or []
    named = f" items {', '.join(map(str, items[:12]))}{' ...' if len(items) > 12 else ''}" if items else ""
    return f"{problem['variant']} {problem['row']}:{named}: {problem['what']}"
