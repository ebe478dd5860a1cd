"""Hand-made pipeline results whose right verdict is known, written in the layout the stages produce.

A model is described by its per-item correctness per domain; everything else (manifest, lm-eval summary,
fidelity, memory) is filled in with plausible values that each test can override.
"""

from __future__ import annotations

import copy
from pathlib import Path

from pipelines.core.io import read_json, write_json, write_jsonl

DOMAINS = ["math", "code"]
KL = {"mean": 0.01, "stderr": 0.001, "max": 0.4, "p99_9": 0.3, "p99": 0.2, "p95": 0.05, "p90": 0.02,
      "median": 0.001, "p10": 1e-5, "p5": 1e-6, "p1": 1e-7, "p0_1": 1e-8, "min": 0.0}
FOOTPRINT = {"fp16": 2_000_000, "int8": 1_500_000, "awq4": 1_300_000, "gptq3": 1_250_000, "vendor": 1_280_000}


def correctness(n: int, correct: int, *, lose: int = 0, gain: int = 0) -> list[bool]:
    """fp16-like answers (first `correct` right), then `lose` right answers made wrong and `gain` wrong made right."""
    row = [i < correct for i in range(n)]
    for i in range(lose):
        row[i] = False
    for i in range(gain):
        row[correct + i] = True
    return row


def write_model(root: Path, name: str, answers: dict[str, list[bool]], *, kl: dict | None = None,
                tokens: int = 400, kind: str = "variant", status: str = "ok", responses_like_fp16: bool = False) -> None:
    """models/variants/<name>/quantgate.json, results/eval/<name>.json and its items.jsonl."""
    manifest = {"variant": name, "status": status, "method": "none" if name == "fp16" else "awq",
                "device": "cpu", "libraries": {"torch": "2.13.0+cpu"},
                "calibration": {"sha256": "c" * 64, "samples": 512},
                "files": {"model.safetensors": name[0] * 64, "config.json": "f" * 64}}
    if kind == "candidate":
        manifest.pop("calibration")
    if status != "ok":
        manifest["error"] = "RuntimeError: quantization blew up"
    write_json(root / "models/variants" / name / "quantgate.json", manifest)
    if status != "ok":
        write_json(root / "results/eval" / f"{name}.json", {"variant": name, "status": "failed", "error": "model failed"})
        return
    items, probes, fidelity = [], {}, {}
    for domain, row in answers.items():
        for i, correct in enumerate(row):
            wrong = f"wrong-{i}" if name == "fp16" or responses_like_fp16 else f"wrong-{name}-{i}"
            response = f"answer-{i}" if correct else wrong
            items.append({"domain": domain, "task": f"quantgate_{domain}", "item_id": f"{domain}-{i:04d}", "doc_id": i,
                          "family": f"f{i % 8}",
                          "doc_hash": f"d{domain}{i}", "prompt_hash": f"p{domain}{i}", "target": f"answer-{i}",
                          "response": response, "correct": correct, "chance": 0.0})
        probes[domain] = {"task": f"quantgate_{domain}", "status": "ok", "task_version": 1.0, "metric": "acc",
                          "score": sum(row) / len(row) if row else None, "stderr": 0.03, "items": len(row)}
        fidelity[domain] = {"tokens": tokens, "kl": copy.deepcopy(kl or KL), "same_top1": 0.95, "rms_delta_p": 0.05,
                            "ppl_ratio": 1.02}
    write_jsonl(root / "results/eval" / name / "items.jsonl", items)
    write_json(root / "results/eval" / f"{name}.json",
               {"variant": name, "device": "cpu", "batch_size": 16, "status": "ok", "probes": probes, "fidelity": fidelity})


def measured_memory(footprint: int, per_round: float, rounds: int = 0) -> dict:
    """results/memory/<name>.json as the memory stage writes it, cut to what memory-report and its charts read."""
    return {"status": "ok", "device": "cpu", "load": {"footprint_bytes": footprint, "theoretical_weight_bytes": 1},
            "sweep": {"lengths": [{"tokens": 8, "decode_peak_increase": 5}], "fitted_bytes_per_token": 1.0,
                      "theoretical_kv_bytes_per_token": 1},
            "soak": {"growth_bytes_per_round": per_round, "fragmentation": {"one_minus_allocated_over_reserved": 0.1},
                     "rounds": [{"round": n, "allocated": 1000} for n in range(rounds)], "signal": "allocated",
                     "requests_per_round": 8},
            "leak": {"leak": False}}


def memory_row(name: str, *, growth_excess_pct: float = 0.0, leak: bool = False, oom: str | None = None) -> dict:
    base = FOOTPRINT["fp16"]
    return {"status": "ok", "device": "cpu", "footprint_bytes": FOOTPRINT[name], "theoretical_weight_bytes": FOOTPRINT[name],
            "peak_by_tokens": {"64": 100_000, "256": 400_000}, "fitted_bytes_per_token": 512.0,
            "theoretical_kv_bytes_per_token": 512, "growth_bytes_per_round": 0.0,
            "growth_bytes_per_request": 0.0, "measured_rounds": 12, "warmup_end_round": 0,
            "leak": leak, "oom": oom, "fragmentation": 0.03, "growth_excess_pct": growth_excess_pct,
            "footprint_saving_pct": 100 * (1 - FOOTPRINT[name] / base)}


def write_memory(root: Path, rows: dict[str, dict]) -> None:
    write_json(root / "results/memory_summary.json", {"baseline": "fp16", "baseline_ok": "fp16" in rows, "variants": rows})


def write_eval_items(root: Path, counts: dict[str, int]) -> None:
    """eval/<domain>/items.jsonl: compare reads their ids and families (the look plan), nothing else."""
    for domain, n in counts.items():
        write_jsonl(root / "eval" / domain / "items.jsonl", [{"id": f"{domain}-{i:04d}", "family": f"f{i % 8}"}
                                                            for i in range(n)])


def plans(root: Path, domains=("math", "code"), look_items: int = 10_000, max_items: int | None = None) -> dict:
    """compare's look plans over root/eval; by default one look over the whole pool."""
    from pipelines.core.params_sections import EvaluateParams
    from pipelines.evaluation.plans import probe_plans

    return probe_plans(list(domains), EvaluateParams(look_items=look_items, max_items=max_items), root / "eval")


PARAMS_YAML = """\
variants:
  fp16: {method: none, dtype: float16}
  int8: {method: bnb-int8, dtype: float16}
  awq4: {method: awq, bits: 4, group_size: 64, dtype: float16}
candidates: {}
evaluate:
  domains: [math, code]
  look_items: 10000
compare:
  confidence: 0.95
calibration:
  weights: {chat: 1.0, code: 1.0, code_comment: 1.0, math: 1.0}
mlflow:
  experiment: handmade
route:
  context_buckets: [64, 256]
"""


# Two stages standing in for the pipeline: DVC records the hash of every file the gate decides on, exactly
# as `dvc repro` would, so `dvc status` (which the gate runs) sees any later edit. `results` plays the
# stages that produce results, `compare` the judging one (its entry is not part of the upstream digest).
DVC_YAML = """\
stages:
  results:
    cmd: "true"
    deps: [eval, models/variants, results/eval, results/memory_summary.json]
    params: [variants, candidates, evaluate]
  compare:
    cmd: "true"
    deps: [results/eval, results/memory_summary.json]
    params: [compare]
    outs:
      - results/compare.json: {cache: false}
      - results/routing_table.json: {cache: false}
"""


def dvc_commit(root: Path) -> None:
    """Record the workspace in dvc.lock (a DVC repository without git, created on first use)."""
    import contextlib

    from dvc.repo import Repo

    with contextlib.chdir(root):  # DVC's run-cache resolves stage paths against the working directory
        if not Path(".dvc").is_dir():
            Repo.init(".", no_scm=True).close()
        Path("dvc.yaml").write_text(DVC_YAML)
        with Repo(".") as repo:
            repo.commit(None, force=True)


def rerun_compare(root: Path) -> tuple[dict, dict]:
    """compare and route over the workspace's results, then dvc.lock updated: what `dvc repro` does after
    an upstream change (the upstream digest is taken once DVC has recorded the upstream stage)."""
    from pipelines import route
    from pipelines.core import lineage
    from pipelines.core.params import load_params
    from pipelines.evaluation.plans import probe_plans
    from pipelines.judging.comparison import compare_all

    params = load_params(root / "params.yaml")
    report = compare_all(list(params.variants), [], probe_plans(params.evaluate.domains, params.evaluate, root / "eval"),
                         params.compare, root / "results", root / "models/variants")
    write_json(root / "results/compare.json", report)
    (root / "results/compare.csv").write_text("variant\n")
    write_json(root / "results/routing_table.json", {})
    dvc_commit(root)
    report["dvc_lock_sha256"] = digest = lineage.lock_digest(root / "dvc.lock")
    report["dvc_lock_stages"] = lineage.stage_digests(root / "dvc.lock")
    write_json(root / "results/compare.json", report)
    shadow = root / "results/shadow.json"  # written by write_shadow: route listens to it
    table = route.build_table(report, params.route.context_buckets, params.compare.policy_for, root / "models/variants",
                              digest, shadow=read_json(shadow) if shadow.is_file() else None)
    write_json(root / "results/routing_table.json", table)
    dvc_commit(root)
    return report, table


def write_shadow(root: Path, shares: dict[str, dict[str, float]], requests: int = 40) -> None:
    """results/shadow.json and shadow_metrics.json as stage shadow writes them: `shares` is variant -> type -> exact
    agreement with fp16 (the same in every bucket); rerun_compare then routes on it."""
    def cell(share):
        return {"requests": requests, "exact": {"share": share, "low": share - 0.1, "high": min(1.0, share + 0.1)},
                "first_difference": {"median": 3.0, "mean": 3.5}, "similarity": {"mean": 0.9, "low": 0.85, "high": 0.95},
                "outcome": None}
    models = {"fp16": {"status": "ok", "error": None}} | {
        name: {"status": "ok", "error": None, "agreement": {t: {"64": cell(v), "all": cell(v)} for t, v in types.items()}}
        for name, types in shares.items()}
    write_json(root / "results/shadow.json", {
        "baseline": "fp16", "traffic": {"path": "traffic.jsonl", "sha256": "ab" * 32, "requests": 2 * requests,
                                        "replayed": 2 * requests, "skipped": {"too_long": 0}, "by_type": {}},
        "settings": {"max_new_tokens": 16, "max_batch": 8, "time_compression": None, "store": "masked"}, "models": models})
    latency = {"ttft_ms": {"p50": 10.0, "p99": 40.0}, "tpot_ms": {"p50": 2.0, "p99": 7.0}, "tokens_per_s": 1000.0}
    write_json(root / "results/shadow_metrics.json", {
        "models": {n: {"latency": latency, "memory": {"measure": "rss", "start_bytes": 100, "peak_bytes": 1000,
                                                     "growth_bytes": 900, "growth_pct": 900.0}, "seconds": 1.0}
                   for n in models},
        "memory_saving": {n: {"replay_pct": 40.0, "claimed_pct": 35.0, "agrees": True, "tolerance_pct": 10.0}
                          for n in shares}})


def write_pipeline(root: Path, answers: dict[str, dict[str, list[bool]]]) -> dict:
    """A whole finished pipeline (params.yaml, calibration sets, results, compare + route, dvc.lock) in `root`.

    `answers`: model name -> domain -> per-item correctness; fp16 must be among them.
    """
    from pipelines.core import lineage
    from pipelines.core.params import load_params

    (root / "params.yaml").write_text(PARAMS_YAML)
    params = load_params(root / "params.yaml")
    for name, per_domain in answers.items():
        write_model(root, name, per_domain)
    write_memory(root, {n: memory_row(n) for n in answers})
    n = len(next(iter(answers.values()))["math"])
    write_eval_items(root, {d: n for d in params.evaluate.domains})
    for domain in ("chat", "code", "code_comment", "math"):
        write_jsonl(root / "calibration_sets/built" / f"{domain}.jsonl", [{"id": f"{domain}-{i}", "text": f"{domain} {i}"}
                                                                       for i in range(4)])
    write_jsonl(root / "calibration_sets/built/mixed.jsonl", [{"id": f"m-{i}", "text": f"text {i}"} for i in range(16)])
    report, table = rerun_compare(root)
    (root / "results/plots").mkdir(parents=True, exist_ok=True)
    (root / "results/plots/pareto.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # stands in for compare's plots
    return {"params": params, "digest": lineage.results_digest(root / "dvc.lock"), "report": report, "table": table}
