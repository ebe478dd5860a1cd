"""`quantgate <stage>`: one subcommand per pipeline stage, each a dvc.yaml stage too.

Bad input ends with one line on stderr naming the file, line or key (exit 2); unexpected errors
keep their traceback in logs/quantgate.log and print one line here (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipelines import logs
from pipelines.errors import QuantgateError

log = logging.getLogger("pipelines.cli")

RESULTS = Path("results")
BASELINE = "fp16"  # the variant every other is judged against (compare.BASELINE; repeated so the CLI imports no torch)


def cmd_reference(args: argparse.Namespace) -> int:
    """Train the embedded reference model (or record that params.yaml names another model)."""
    from pipelines import reference
    from pipelines.io import atomic_dir, write_json
    from pipelines.models import REFERENCE_DIR, resolve_model
    from pipelines.params import load_params

    params = load_params()
    source = resolve_model(params.model)
    report_path = RESULTS / "reference.json"
    if not source.is_reference:
        reason = f"params.yaml names model {source.location!r} ({source.kind}); the reference model is not built"
        with atomic_dir(REFERENCE_DIR) as tmp:
            write_json(tmp / "skipped.json", {"status": "skipped", "reason": reason})
        write_json(report_path, {"status": "skipped", "reason": reason})
        log.info("reference: skipped: %s", reason)
        return 0
    report = reference.from_shipped(params.reference, REFERENCE_DIR, report_path) \
        or reference.build(params.reference, REFERENCE_DIR, report_path)
    log.info("reference: %s", "the shipped weights (reference_model/, trained from this recipe) -> models/reference"
             if report["source"] == "shipped" else f"trained here in {report['train_seconds']} s")
    functions = report["function_pass_rate"]
    log.info(
        "reference: %s params, held-out addition exact match %.1f%%, held-out functions pass@1 %s, "
        "code from a Chinese comment %.1f%%, chat %.1f%% (chance 25%%) -> %s",
        f"{report['parameters']:,}", 100 * report["addition_exact_match"],
        "n/a (no sandbox isolation)" if functions is None else f"{100 * functions:.1f}%",
        100 * report["code_comment_accuracy"], 100 * report["chat_accuracy"], report_path,
    )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Build the domain calibration sets and check their coverage against production traffic."""
    from pipelines import calibrate
    from pipelines.models import load_tokenizer, resolve_model
    from pipelines.params import load_params

    params = load_params()
    source = resolve_model(params.model)
    report = calibrate.run(params.calibration, params.coverage, load_tokenizer(source), source.location)
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
             calibrate.COVERAGE_DIR / "classifier_confusion.png")
    log.info("calibrate: sets in %s, coverage in %s", calibrate.BUILT_DIR, calibrate.COVERAGE_DIR / "coverage.json")
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
    for message in problems:
        if params.coverage.on_gap == "fail":
            raise QuantgateError("; ".join(problems) + "; coverage.on_gap is 'fail'")
        log.warning("calibrate: warning: %s", message)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize one variant in its own process; its failure (an exception, a crash, a hang past
    quantize.timeout_seconds) is recorded in its manifest and the stage still succeeds."""
    from pipelines import quantize
    from pipelines.calibrate import BUILT_DIR
    from pipelines.io import write_json
    from pipelines.isolation import run_isolated
    from pipelines.models import VARIANTS_DIR, resolve_device, resolve_model
    from pipelines.params import load_params

    params = load_params()
    settings = params.variants.get(args.variant)
    if settings is None:
        params.model_under_test(args.variant)  # names what exists
        raise QuantgateError(f"{args.variant!r} is a candidate: use `quantgate admit {args.variant}`")
    source = resolve_model(params.model)
    device = resolve_device(params.device)
    if args.failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        quantize.record_failure(args.variant, settings, source, device, args.failed_because)
        write_json(RESULTS / "quantize" / f"{args.variant}.json", {"variant": args.variant, "status": "failed"})
        log.warning("quantize %s: recorded as FAILED (%s)", args.variant, args.failed_because)
        return 0
    with logs.progress(total=1, desc=f"quantize {args.variant} ({settings.method})", bar_format="{desc}: {elapsed}") as bar:
        done, error = run_isolated(quantize.quantize_variant,
                                   (args.variant, settings, source, BUILT_DIR, device, VARIANTS_DIR, params.gpus.shares()),
                                   params.quantize.timeout_seconds, f"quantize {args.variant}", logs.current_log_file)
        bar.update()
    manifest, timing = (quantize.record_failure(args.variant, settings, source, device, error), {}) if error else done
    write_json(RESULTS / "quantize" / f"{args.variant}.json", {"variant": args.variant, "status": manifest["status"],
                                                               **timing})
    if manifest["status"] == "ok":
        log.info("quantize %s: %s in %.1fs, %s weight bytes on disk (theory %s) -> models/variants/%s",
                 args.variant, settings.method, timing["quantize_seconds"],
                 f"{manifest['disk_bytes']['weights']:,}", f"{manifest['theoretical_weight_bytes']['total']:,}",
                 args.variant)
    else:
        log.warning("quantize %s: FAILED (%s); recorded in models/variants/%s/quantgate.json",
                    args.variant, manifest["error"], args.variant)
    return 0


def cmd_admit(args: argparse.Namespace) -> int:
    """Validate a third-party checkpoint; a rejection is recorded as that candidate's failure."""
    from pipelines import candidates
    from pipelines.models import resolve_model
    from pipelines.params import load_params

    params = load_params()
    if args.candidate not in params.candidates:
        params.model_under_test(args.candidate)
        raise QuantgateError(f"{args.candidate!r} is a variant: use `quantgate quantize {args.candidate}`")
    source = resolve_model(params.model)
    if args.failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        candidates.record_failure(args.candidate, params.candidates[args.candidate].path, source.location,
                                  args.failed_because)
        log.warning("admit %s: recorded as FAILED (%s)", args.candidate, args.failed_because)
        return 0
    manifest = candidates.admit(args.candidate, params.candidates[args.candidate].path, source.location)
    if manifest["status"] == "ok":
        log.info("admit %s: %s checkpoint validated (%d tensors) -> models/variants/%s", args.candidate,
                 manifest["method"], manifest["validation"]["tensors"], args.candidate)
    else:
        log.warning("admit %s: REJECTED:\n  %s", args.candidate, "\n  ".join(manifest["validation"]["reasons"]))
    return 0


MEMORY_DIR = RESULTS / "memory"


def cmd_memory(args: argparse.Namespace) -> int:
    """Measure one variant's memory in a fresh process; a variant that failed earlier is recorded as failed."""
    from pipelines import memory
    from pipelines.io import write_json
    from pipelines.models import VARIANTS_DIR, resolve_device
    from pipelines.params import load_params

    params = load_params()
    params.model_under_test(args.variant)
    device = resolve_device(params.device)
    if args.failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        write_json(MEMORY_DIR / f"{args.variant}.json", {"variant": args.variant, "device": device, "status": "failed",
                                                         "error": args.failed_because})
        log.warning("memory %s: recorded as FAILED (%s)", args.variant, args.failed_because)
        return 0
    with logs.progress(total=1, desc=f"memory {args.variant} ({device})", bar_format="{desc}: {elapsed}") as bar:
        result = memory.measure_isolated(str(VARIANTS_DIR / args.variant), params.memory, device, args.inject_leak_bytes,
                                         args.inject_leak_rounds, params.gpus.shares())
        bar.update()
    if args.inject_leak_bytes:
        result["injected_leak"] = {"bytes_per_round": args.inject_leak_bytes, "rounds": args.inject_leak_rounds}
    write_json(MEMORY_DIR / f"{args.variant}.json", result)
    if result["status"] == "ok":
        sw = result["sweep"]
        log.info("memory %s: footprint %s B, KV %.0f B/token fitted (theory %d), soak: %s",
                 args.variant, f"{result['load']['footprint_bytes']:,}", sw["fitted_bytes_per_token"],
                 sw["theoretical_kv_bytes_per_token"], result["leak"]["reason"])
    else:
        log.warning("memory %s: FAILED (%s)", args.variant, result["error"])
    return 0


def cmd_memory_report(args: argparse.Namespace) -> int:
    """Every variant's memory on one chart each, and growth against fp16."""
    from pipelines import memory_plots, memory_verdict
    from pipelines.io import read_json, write_json
    from pipelines.params import load_params
    from pipelines.plots import PLOTS_DIR

    params = load_params()
    results = {}
    for name in [*params.variants, *params.candidates]:
        path = MEMORY_DIR / f"{name}.json"
        results[name] = read_json(path) if path.is_file() else {"status": "failed", "error": f"{path} missing"}
    summary = memory_verdict.summarize(results, params.memory)
    write_json(memory_verdict.SUMMARY, summary)
    memory_plots.plot_all(results, PLOTS_DIR)
    for name, row in summary["variants"].items():
        if row["status"] == "ok":
            excess = row["growth_excess_pct"]
            log.info("memory-report %-10s footprint %10s B  growth excess vs fp16 %s  leak %s%s", name,
                     f"{row['footprint_bytes']:,}", "n/a" if excess is None else f"{excess:+.3f} %", row["leak"],
                     f"  OUT OF MEMORY: {row['oom']}" if row["oom"] else "")
        else:
            log.info("memory-report %-10s FAILED: %s", name, row["error"])
    return 0


EVAL_RESULTS = RESULTS / "eval"
BASELINE_RESULTS = RESULTS / "baseline"
FIDELITY_BASE = BASELINE_RESULTS / "fidelity.safetensors"


def _log_probes(name: str, result: dict) -> None:
    if result["status"] != "ok":
        log.warning("evaluate %s: FAILED (%s)", name, result["error"])
        return
    for domain, row in result["probes"].items():
        if row["status"] != "ok":
            log.warning("evaluate %s %-12s REFUSED: %s", name, domain, row["reason"])
            continue
        fid = result["fidelity"][domain.split(":")[0]]  # a standard task row `<domain>:<task>` has its domain's
        log.info("evaluate %s %-12s %s %.3f (%d items)  KL mean %.5f  same top-1 %.1f%%", name, domain,
                 row["metric"], row["score"], row["items"], fid["kl"]["mean"], 100 * fid["same_top1"])


def cmd_baseline(args: argparse.Namespace) -> int:
    """fp16 answers every look of every probe pool, and its next-token distributions are stored once.

    In its own process; a crash or a run past evaluate.timeout_seconds stops the pipeline with the cause."""
    from pipelines import compare, evaluate
    from pipelines.io import write_json, write_jsonl
    from pipelines.isolation import run_isolated
    from pipelines.models import VARIANTS_DIR, resolve_device
    from pipelines.params import load_params

    params = load_params()
    p = params.evaluate
    plans = compare.probe_plans(p.domains, p)
    staged = FIDELITY_BASE.with_name(f".{FIDELITY_BASE.name}.new")  # in place only together with the records
    with logs.progress(total=1, desc="baseline fp16 (every look)", bar_format="{desc}: {elapsed}") as bar:
        done, error = run_isolated(evaluate.evaluate_variant,
                                   (str(VARIANTS_DIR / BASELINE), plans, p, resolve_device(params.device), staged, None, None,
                                    params.gpus.shares()),
                                   p.timeout_seconds, f"evaluate {BASELINE}", logs.current_log_file)
        bar.update()
    result, items = done or ({"error": error}, [])
    if error or result["status"] != "ok":  # no baseline, no A/B: stop here rather than judge against nothing
        for leftover in (staged, staged.with_name(f".{staged.name}.tmp")):  # also what a killed process left
            leftover.unlink(missing_ok=True)
        raise QuantgateError(f"the fp16 baseline could not be evaluated: {result['error']}")
    os.replace(staged, FIDELITY_BASE)
    write_jsonl(BASELINE_RESULTS / "items.jsonl", items)
    write_json(BASELINE_RESULTS / "eval.json", result)
    _log_probes(BASELINE, result)
    log.info("baseline: %s -> %s", ", ".join(f"{d} {r['items']}" for d, r in result["probes"].items()), BASELINE_RESULTS)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Probes through lm-eval (per item, look by look against fp16's answers) and fidelity against fp16, in the
    variant's own process: a crash or a run past evaluate.timeout_seconds is that variant's recorded failure."""
    from pipelines import compare, evaluate
    from pipelines.io import atomic_write_text, read_json, read_jsonl, write_json, write_jsonl
    from pipelines.isolation import run_isolated
    from pipelines.models import VARIANTS_DIR, resolve_device
    from pipelines.params import load_params

    params = load_params()
    params.model_under_test(args.variant)
    p = params.evaluate
    if args.variant == BASELINE:  # its answers are the baseline stage's: one copy under the common layout
        atomic_write_text(EVAL_RESULTS / BASELINE / "items.jsonl", (BASELINE_RESULTS / "items.jsonl").read_text("utf-8"))
        write_json(EVAL_RESULTS / f"{BASELINE}.json", read_json(BASELINE_RESULTS / "eval.json"))
        log.info("evaluate fp16: the baseline's records (%s) -> %s", BASELINE_RESULTS, EVAL_RESULTS / BASELINE)
        return 0
    if args.failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        write_jsonl(EVAL_RESULTS / args.variant / "items.jsonl", [])
        write_json(EVAL_RESULTS / f"{args.variant}.json", {"variant": args.variant, "device": resolve_device(params.device),
                                                          "batch_size": p.batch_size, "status": "failed",
                                                          "error": args.failed_because})
        log.warning("evaluate %s: recorded as FAILED (%s)", args.variant, args.failed_because)
        return 0
    plans = compare.probe_plans(p.domains, p)
    base_rows = read_jsonl(BASELINE_RESULTS / "items.jsonl")
    baseline = {d: compare.correctness(compare.by_id(base_rows, d)) for d in plans}
    with logs.progress(total=1, desc=f"evaluate {args.variant}", bar_format="{desc}: {elapsed}") as bar:
        device = resolve_device(params.device)
        done, error = run_isolated(evaluate.evaluate_variant,
                                   (str(VARIANTS_DIR / args.variant), plans, p, device, FIDELITY_BASE, baseline,
                                    params.compare, params.gpus.shares()),
                                   p.timeout_seconds, f"evaluate {args.variant}", logs.current_log_file)
        bar.update()
    result, items = ({"variant": args.variant, "device": device, "batch_size": p.batch_size, "status": "failed",
                      "error": error}, []) if error else done
    write_jsonl(EVAL_RESULTS / args.variant / "items.jsonl", items)
    write_json(EVAL_RESULTS / f"{args.variant}.json", result)
    _log_probes(args.variant, result)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Paired A/B of every variant against fp16 per domain, verdicts, table and plots."""
    import pandas as pd

    from pipelines import compare
    from pipelines.io import atomic_write_text, write_json
    from pipelines.lineage import lock_digest, stage_digests
    from pipelines.models import VARIANTS_DIR
    from pipelines.params import load_params
    from pipelines.plots import PLOTS_DIR

    params = load_params()
    plans = compare.probe_plans(params.evaluate.domains, params.evaluate)
    report = compare.compare_all(list(params.variants), list(params.candidates), plans, params.compare, RESULTS,
                                 VARIANTS_DIR)
    report["dvc_lock_sha256"] = lock_digest()  # what `gate` checks the results against
    report["dvc_lock_stages"] = stage_digests()  # and, when they differ, names the stages that changed since
    write_json(compare.REPORT, report)
    write_json(compare.SUMMARY, compare.summary(report))  # DVC's metrics: `dvc exp show`, `dvc metrics diff`
    atomic_write_text(RESULTS / "compare.csv", pd.DataFrame(compare.flat_rows(report)).to_csv(index=False))
    write_json(PLOTS_DIR / "differences.json",  # a DVC data plot: `dvc plots diff` across experiments
               [{"row": f"{r['variant']} {r['domain']}", "difference": r["difference"], "ci_low": r["ci_low"],
                 "verdict": r["verdict"]} for r in compare.flat_rows(report)])
    compare.plot_all(report, PLOTS_DIR)
    if report["fp16"]["status"] != "ok":
        log.warning("compare: baseline fp16 unusable (%s): every verdict is fail", report["fp16"]["error"])
    for name, v in report["variants"].items():
        for domain, d in v["domains"].items():
            paired = d.get("paired")
            numbers = (f"{paired['items']} items  acc {paired['accuracy']:.3f} vs {paired['accuracy_fp16']:.3f}  "
                       f"diff {paired['difference']:+.3f} [{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}]  "
                       f"flips -{paired['correct_to_wrong']}/+{paired['wrong_to_correct']}") if paired else ""
            log.info("compare %-8s %-12s %-12s %s", name, domain, d["verdict"].upper(), numbers)
            if d["verdict"] != "pass":
                log.info("    %s", "; ".join(d["reasons"]))
    log.info("compare: results/compare.json, results/summary.json, results/compare.csv, "
             "results/plots/{pareto,flips,kl_percentiles}.png")
    return 0


ROUTING_TABLE = RESULTS / "routing_table.json"
MLFLOW_RUN = RESULTS / "mlflow_run.json"  # record writes it, gate reads it (cli.py keeps the path: gate imports no mlflow)


def cmd_route(args: argparse.Namespace) -> int:
    """Build the routing table from compare.json, or look one request up in it."""
    from pipelines.params import load_params

    if args.action == "lookup":  # the serving path: nothing heavy is imported (pipelines/router.py)
        from pipelines.router import Router

        row = Router.from_file(ROUTING_TABLE).route(args.text, args.context_tokens)
        print(row["serve"])
        log.info("route: %s request, %d tokens (bucket <= %d): serve %s, fallback under memory pressure %s (%s)",
                 row["domain"], args.context_tokens, row["max_context_tokens"], row["serve"],
                 row["fallback_under_memory_pressure"], row["reason"])
        return 0
    from pipelines import compare, route
    from pipelines.io import read_json, write_json, write_yaml
    from pipelines.lineage import lock_digest
    from pipelines.models import VARIANTS_DIR

    params = load_params()
    report = read_json(compare.REPORT)
    table = route.build_table(report, params.route.context_buckets, params.compare.policy_for, VARIANTS_DIR,
                              lock_digest(), {name: rule.model_dump() for name, rule in params.coverage.classify.items()})
    write_json(ROUTING_TABLE, table)
    write_yaml(ROUTING_TABLE.with_suffix(".yaml"), table)
    for row in table["rows"]:
        log.info("route %-12s <= %6d tokens: serve %-8s fallback %-8s (%s)", row["domain"], row["max_context_tokens"],
                 row["serve"], row["fallback_under_memory_pressure"], row["reason"])
    log.info("route: %s and %s", ROUTING_TABLE, ROUTING_TABLE.with_suffix(".yaml"))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    """Everything into MLflow (parent + child runs, tables, datasets) and passing variants into the registry."""
    from pipelines import record
    from pipelines.io import write_json
    from pipelines.lineage import git_commit, results_digest
    from pipelines.params import load_params

    params = load_params()
    digest = results_digest()
    if digest is None:
        raise QuantgateError("dvc.lock not found: record runs inside `dvc repro`, after the stages it records")
    uri = tracking_uri()
    with logs.library_output("mlflow"):
        summary = record.record_pipeline(params, uri, digest, git_commit(), artifact_root=artifact_root())
    write_json(MLFLOW_RUN, {**summary, "tracking_uri": uri, "results_digest": digest,
                            "registered_model": params.registered_model_name()})
    if summary["status"] == "already recorded":
        log.info("record: results %s already recorded as run %s: nothing written", digest[:12], summary["parent_run_id"])
    else:
        log.info("record: parent run %s with %d child runs in experiment %r (%s)", summary["parent_run_id"],
                 len(summary["children"]), params.mlflow.experiment, uri)
        for row in summary["registered"]:
            log.info("record: registered %s as %s version %s", row["variant"], params.registered_model_name(), row["version"])
        if summary["registered"]:
            log.info("record: alias 'candidate' -> version %s (%s)", summary["registered"][-1]["version"],
                     summary["registered"][-1]["variant"])
        elif not summary.get("unregistered"):
            log.info("record: no variant passed every domain: nothing registered, alias 'candidate' removed")
        for row in summary.get("unregistered") or []:
            log.warning("record: %s passed but is NOT registered: %s", row["variant"], row["reason"])
    log.info("record: `quantgate ui` opens the MLflow UI")
    return 0


def cmd_fanout(args: argparse.Namespace) -> int:
    """The per-variant chains as Ray tasks on a cluster, then `dvc commit` of what ran (pipelines/fanout.py)."""
    from pipelines import fanout
    from pipelines.params import load_params

    report = fanout.run(Path(os.environ.get("DVC_ROOT", ".")).resolve(), load_params(), args.address)
    if args.report:
        from pipelines.io import write_json

        write_json(Path(args.report), report)
    for name, row in report["ran"].items():
        log.info("fanout %-16s %7.1f s on %s", name, row["seconds"], row["node"])
    for name, why in report["failed"].items():
        log.warning("fanout %-16s FAILED, recorded: %s", name, why)
    log.info("fanout: %d stages ran, %d failed (recorded), %d up to date; dvc.lock records them. Next: dvc repro "
             "(memory-report, compare, route, record)%s", len(report["ran"]), len(report["failed"]),
             len(report["skipped_up_to_date"]),
             f"; wall time {report['wall_seconds']} s" if "wall_seconds" in report else "")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download the checkpoint behind a registry alias or version and verify every file's sha256."""
    from pipelines import record
    from pipelines.params import load_params

    name = args.model or load_params().registered_model_name()
    with logs.library_output("mlflow"):
        got = record.fetch_checkpoint(tracking_uri(), name, args.ref, Path(args.dest) if args.dest else None)
    aliases = f", alias {', '.join(got['aliases'])}" if got["aliases"] else ""
    log.info("fetch: %s version %s (%s%s) %s %s: %d files verified, sha256 %s", name, got["version"], got["variant"],
             aliases, "is already in" if got["status"] == "already there" else "->", got["dest"], got["files"], got["sha256"])
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    """The release verdict: exit 0 pass, 1 fail, 2 could not decide (any exception included)."""
    from pipelines import gate
    from pipelines.io import atomic_write_text, read_json, write_json

    result = {"verdict": "undecided", "gated": args.variant or [], "results_digest": None, "reasons": []}
    report = fresh = table = None
    try:
        from pipelines import compare
        from pipelines.lineage import git_commit, lock_digest, results_digest, stage_digests, workspace_changes
        from pipelines.models import VARIANTS_DIR
        from pipelines.params import load_params

        params = load_params()
        unknown = [n for n in args.variant or [] if n not in params.variants and n not in params.candidates]
        if unknown:
            raise QuantgateError(f"--variant {unknown[0]!r} is neither a variant nor a candidate in params.yaml")
        if BASELINE in (args.variant or []):
            raise QuantgateError(f"--variant {BASELINE}: fp16 is the baseline every variant is judged against")
        changes = workspace_changes()
        compare_path, table_path = compare.REPORT, ROUTING_TABLE
        report = read_json(compare_path) if compare_path.is_file() else None
        table = read_json(table_path) if table_path.is_file() else None
        if not changes:  # recompute the comparison from the per-item records: the same function compare ran
            fresh = compare.compare_all(list(params.variants), list(params.candidates),
                                        compare.probe_plans(params.evaluate.domains, params.evaluate), params.compare,
                                        RESULTS, VARIANTS_DIR)
        result = gate.decide(report, fresh, params, changes, lock_digest(), args.variant or None, stage_digests())
        digest = results_digest()
        result["results_digest"] = digest
        result["git"] = git_commit()
        run_file = MLFLOW_RUN
        if run_file.is_file():
            run = read_json(run_file)
            if run.get("results_digest") == digest:
                result.update(mlflow_run_id=run.get("parent_run_id"), experiment=params.mlflow.experiment)
        if args.promote:
            if result["verdict"] == "pass":
                result["promotion"] = gate.promote(tracking_uri(), params.registered_model_name(), result, params, digest)
                if result["promotion"]["status"] == "refused":
                    result["verdict"] = "fail"
                    result["reasons"].append(f"promotion refused: {result['promotion']['detail']}")
            else:
                result["promotion"] = {"status": "refused", "detail": f"the gate did not pass ({result['verdict']})"}
    except Exception as err:  # noqa: BLE001 - fail closed: any error is "could not decide", exit 2
        logging.getLogger("pipelines").debug("gate error", exc_info=True)
        result["verdict"] = "undecided"
        result["reasons"].append(f"the gate could not finish: {type(err).__name__}: {err}")
    result["exit_code"] = gate.EXIT[result["verdict"]]
    try:
        write_json(RESULTS / "gate.json", result)
        atomic_write_text(RESULTS / "report.md", gate.render_report(result, fresh or report, table))
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


def artifact_root() -> Path:
    """Artifacts of the default SQLite store live beside it (DVC_ROOT in dvc runs), not in the cwd."""
    return Path(os.environ.get("DVC_ROOT", ".")).resolve() / "mlartifacts"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set, else the SQLite store at the repository root (DVC_ROOT in dvc runs)."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    root = Path(os.environ.get("DVC_ROOT", ".")).resolve()
    return f"sqlite:///{root / 'mlflow.db'}"


def cmd_ui(args: argparse.Namespace) -> int:
    """Start the MLflow UI on localhost over quantgate's tracking store (a tracking server is its own UI)."""
    uri = tracking_uri()
    if uri.split(":", 1)[0] in ("http", "https"):
        log.info("MLflow UI: MLFLOW_TRACKING_URI names a tracking server, which serves the UI itself: open %s", uri)
        return 0
    mlflow = shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow"))
    cmd = [mlflow, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(args.port)]
    log.info("MLflow UI on http://127.0.0.1:%d (Ctrl-C stops it)", args.port)
    return subprocess.call(cmd)


def cmd_doctor(args: argparse.Namespace) -> int:
    """What the configured run needs on this machine, as a table; exit 1 when the run could not give a verdict."""
    import time

    from pipelines import doctor  # here, not at the top: no stage's code (dvc.yaml deps) includes the doctor

    started = time.perf_counter()
    checks = doctor.run_checks(args.params)
    doctor.print_table(checks, time.perf_counter() - started)
    return doctor.exit_code(checks)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantgate",
        description="Validate quantized LLM checkpoints before release. `dvc repro` runs the stages in order.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug messages on the console")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<stage>")

    p = sub.add_parser("reference", help="stage 1: train the embedded reference model -> models/reference/")
    p.set_defaults(func=cmd_reference)

    p = sub.add_parser("calibrate", help="stage 2: domain calibration sets + coverage against production traffic")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("quantize", help="stage 3: quantize one variant from params.yaml -> models/variants/<variant>/")
    p.add_argument("variant")
    p.add_argument("--failed-because", metavar="CAUSE", default=None,
                   help="record this stage as failed with CAUSE, without running it (quantgate fanout uses it)")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("admit", help="stage 3b: validate a third-party checkpoint from candidates: -> models/variants/<name>/")
    p.add_argument("candidate")
    p.add_argument("--failed-because", metavar="CAUSE", default=None,
                   help="record this stage as failed with CAUSE, without running it (quantgate fanout uses it)")
    p.set_defaults(func=cmd_admit)

    p = sub.add_parser("memory", help="stage 4: memory of one variant (fresh process) -> results/memory/<variant>.json")
    p.add_argument("variant")
    p.add_argument("--failed-because", metavar="CAUSE", default=None,
                   help="record this stage as failed with CAUSE, without running it (quantgate fanout uses it)")
    p.add_argument("--inject-leak-bytes", type=int, default=0, metavar="N",
                   help="keep N extra bytes alive per soak round: checks that the leak detector fires")
    p.add_argument("--inject-leak-rounds", type=int, default=None, metavar="K",
                   help="... for the first K rounds only: a warm-up that plateaus, which must not count as a leak")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("memory-report", help="stage 4b: all variants' memory on one chart, growth vs fp16")
    p.set_defaults(func=cmd_memory_report)

    p = sub.add_parser("baseline", help="stage 5a: fp16 answers every look of every probe pool; its next-token "
                                        "distributions are stored once -> results/baseline/")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("evaluate", help="stage 5: lm-eval probes per item + fidelity vs fp16 -> results/eval/<variant>.json")
    p.add_argument("variant")
    p.add_argument("--failed-because", metavar="CAUSE", default=None,
                   help="record this stage as failed with CAUSE, without running it (quantgate fanout uses it)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("compare", help="stage 6: paired A/B of every variant vs fp16 per domain -> results/compare.json")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("route", help="stage 7: routing table -> results/routing_table.{json,yaml}; "
                                     "`route lookup TEXT --context-tokens N` prints the variant serving a request")
    p.set_defaults(func=cmd_route, action="build")
    route_sub = p.add_subparsers(dest="action", metavar="[lookup]")
    lookup = route_sub.add_parser("lookup", help="classify TEXT and print the variant that serves it")
    lookup.add_argument("text")
    lookup.add_argument("--context-tokens", type=int, required=True, metavar="N",
                        help="prompt plus expected output length, in tokens")

    p = sub.add_parser("record", help="stage 8: parent + child runs in MLflow, passing variants into the registry")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("fanout", help="run the per-variant chains (quantize/admit, memory, baseline, evaluate) as Ray "
                                      "tasks on a cluster and record them in dvc.lock; then dvc repro does the rest")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="the Ray cluster (`auto`: the one `ray start` runs here; default: RAY_ADDRESS, else a "
                        "local Ray started for this run)")
    p.add_argument("--report", metavar="FILE", help="also write what ran where, what failed and what was committed "
                                                    "as JSON")
    p.set_defaults(func=cmd_fanout)

    p = sub.add_parser("gate", help="release verdict: exit 0 pass, 1 fail, 2 could not decide; "
                                    "writes results/gate.json and results/report.md")
    p.add_argument("--variant", action="append", metavar="NAME",
                   help="gate only this variant or candidate (repeatable); default: all of them")
    p.add_argument("--promote", action="store_true",
                   help="when the gate passes, move the registry alias 'production' to 'candidate' "
                        "unless it regresses against the current production version")
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser("fetch", help="download the checkpoint behind a registry alias or version and verify its "
                                     "sha256 per file (exit 2 naming the file that differs or is missing)")
    p.add_argument("ref", metavar="ALIAS_OR_VERSION", help="production, candidate, or a version number (3 or v3)")
    p.add_argument("--model", metavar="NAME", help="registered model (default: quantgate-<model> from params.yaml)")
    p.add_argument("--dest", metavar="DIR", help="where to put it (default: models/fetched/<NAME>-v<version>); "
                                                 "an existing non-empty DIR is only accepted when it holds those bytes")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("ui", help="start the MLflow UI on 127.0.0.1 over the local tracking store")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser("doctor", help="check what the configured run needs here (sandbox, torch and devices, "
                                      "quantization backends, MLflow, disk, model, dvc); exit 1 when it could not "
                                      "give a verdict")
    p.add_argument("--params", default="params.yaml", metavar="FILE", help="the params file to check (default: %(default)s)")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # route lookup answers in front of every request: it must not pay for importing torch
    logs.setup(verbose=args.verbose, libraries=not (args.command == "route" and args.action == "lookup"))
    try:
        return args.func(args)
    except QuantgateError as err:
        print(f"quantgate {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"quantgate {args.command}: interrupted; no partial outputs were kept", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the traceback goes to the log, one line to the user
        logging.getLogger("pipelines").debug("unexpected error", exc_info=True)
        logging.getLogger().error("quantgate %s failed", args.command, exc_info=True)
        print(f"quantgate {args.command}: failed: {type(err).__name__}: {err} (traceback in {logs.LOG_FILE})",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
