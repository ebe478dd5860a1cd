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
    report = reference.build(params.reference, REFERENCE_DIR, report_path)
    functions = report["function_pass_rate"]
    log.info(
        "reference: %s params, held-out addition exact match %.1f%%, held-out functions pass@1 %s, "
        "code-comment %.1f%%, chat %.1f%% (chance 25%%) -> %s",
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
    log.info("calibrate: sets in %s, coverage in %s", calibrate.BUILT_DIR, calibrate.COVERAGE_DIR / "coverage.json")
    if report["under_represented"]:
        message = (f"calibration set under-represents {', '.join(report['under_represented'])} "
                   f"against {params.coverage.traffic} ({report['rule']})")
        if params.coverage.on_gap == "fail":
            raise QuantgateError(message + "; coverage.on_gap is 'fail'")
        log.warning("calibrate: warning: %s", message)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize one variant; its failure is recorded in its manifest and the stage still succeeds."""
    from pipelines import quantize
    from pipelines.models import resolve_device, resolve_model
    from pipelines.params import load_params

    params = load_params()
    settings = params.variants.get(args.variant)
    if settings is None:
        params.model_under_test(args.variant)  # names what exists
        raise QuantgateError(f"{args.variant!r} is a candidate: use `quantgate admit {args.variant}`")
    source = resolve_model(params.model)
    device = resolve_device(params.device)
    with logs.progress(total=1, desc=f"quantize {args.variant} ({settings.method})", bar_format="{desc}: {elapsed}") as bar:
        manifest = quantize.quantize_variant(args.variant, settings, source, Path("calibration_sets/built"), device)
        bar.update()
    if manifest["status"] == "ok":
        log.info("quantize %s: %s in %.1fs, %s weight bytes on disk (theory %s) -> models/variants/%s",
                 args.variant, settings.method, manifest["quantize_seconds"],
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
    with logs.progress(total=1, desc=f"memory {args.variant} ({device})", bar_format="{desc}: {elapsed}") as bar:
        result = memory.measure_isolated(str(VARIANTS_DIR / args.variant), params.memory, device, args.inject_leak_bytes)
        bar.update()
    if args.inject_leak_bytes:
        result["injected_leak_bytes_per_round"] = args.inject_leak_bytes
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
    from pipelines import memory
    from pipelines.io import read_json, write_json
    from pipelines.params import load_params

    params = load_params()
    results = {}
    for name in [*params.variants, *params.candidates]:
        path = MEMORY_DIR / f"{name}.json"
        results[name] = read_json(path) if path.is_file() else {"status": "failed", "error": f"{path} missing"}
    summary = memory.summarize(results)
    write_json(RESULTS / "memory_summary.json", summary)
    memory.plot_all(results, RESULTS / "plots")
    for name, row in summary["variants"].items():
        if row["status"] == "ok":
            excess = row["growth_excess_pct"]
            log.info("memory-report %-10s footprint %10s B  growth excess vs fp16 %s  leak %s", name,
                     f"{row['footprint_bytes']:,}", "n/a" if excess is None else f"{excess:+.3f} %", row["leak"])
        else:
            log.info("memory-report %-10s FAILED: %s", name, row["error"])
    return 0


EVAL_RESULTS = RESULTS / "eval"
FIDELITY_BASE = EVAL_RESULTS / "fidelity_base.safetensors"


def cmd_fidelity_base(args: argparse.Namespace) -> int:
    """The fp16 baseline's next-token distributions over held-out text, computed once for every variant."""
    from pipelines import evaluate, fidelity
    from pipelines.models import VARIANTS_DIR, load_variant, resolve_device
    from pipelines.params import load_params

    params = load_params()
    device = resolve_device(params.device)
    model, tokenizer = load_variant(VARIANTS_DIR / "fp16", device)  # a failed fp16 stops here: no baseline, no A/B
    texts = evaluate.fidelity_texts(params.evaluate.domains, params.evaluate.fidelity_texts)
    fidelity.save_base(fidelity.base_record(model, tokenizer, texts, params.evaluate.top_k, device), FIDELITY_BASE)
    log.info("fidelity-base: fp16 top-%d log-probs over %d texts per domain -> %s", params.evaluate.top_k,
             params.evaluate.fidelity_texts, FIDELITY_BASE)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Probes through lm-eval (per item) and fidelity against the stored fp16 distributions."""
    from pipelines import evaluate
    from pipelines.io import write_json, write_jsonl
    from pipelines.models import VARIANTS_DIR, resolve_device
    from pipelines.params import load_params

    params = load_params()
    params.model_under_test(args.variant)
    p = params.evaluate
    with logs.progress(total=1, desc=f"evaluate {args.variant}", bar_format="{desc}: {elapsed}") as bar:
        result, items = evaluate.evaluate_variant(str(VARIANTS_DIR / args.variant), FIDELITY_BASE, p.domains,
                                                  p.batch_size, resolve_device(params.device), p.limit,
                                                  p.allow_unisolated_code)
        bar.update()
    write_jsonl(EVAL_RESULTS / args.variant / "items.jsonl", items)
    write_json(EVAL_RESULTS / f"{args.variant}.json", result)
    if result["status"] == "ok":
        for domain, row in result["probes"].items():
            if row["status"] != "ok":
                log.warning("evaluate %s %-12s REFUSED: %s", args.variant, domain, row["reason"])
                continue
            fid = result["fidelity"][domain]
            log.info("evaluate %s %-12s %s %.3f (%d items)  KL mean %.5f  same top-1 %.1f%%", args.variant, domain,
                     row["metric"], row["score"], row["items"], fid["kl"]["mean"], 100 * fid["same_top1"])
    else:
        log.warning("evaluate %s: FAILED (%s)", args.variant, result["error"])
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Paired A/B of every variant against fp16 per domain, verdicts, table and plots."""
    import pandas as pd

    from pipelines import compare
    from pipelines.io import atomic_write_text, write_json
    from pipelines.lineage import lock_digest
    from pipelines.models import VARIANTS_DIR
    from pipelines.params import load_params

    params = load_params()
    domains = params.evaluate.domains
    expected = compare.expected_items(domains, params.evaluate.limit)
    report = compare.compare_all(list(params.variants), list(params.candidates), domains, expected, params.compare,
                                 RESULTS, VARIANTS_DIR)
    report["dvc_lock_sha256"] = lock_digest()  # what `gate` checks the results against
    write_json(RESULTS / "compare.json", report)
    atomic_write_text(RESULTS / "compare.csv", pd.DataFrame(compare.flat_rows(report)).to_csv(index=False))
    compare.plot_all(report, RESULTS / "plots")
    if report["fp16"]["status"] != "ok":
        log.warning("compare: baseline fp16 unusable (%s): every verdict is fail", report["fp16"]["error"])
    for name, v in report["variants"].items():
        for domain, d in v["domains"].items():
            paired = d.get("paired")
            numbers = (f"acc {paired['accuracy']:.3f} vs {paired['accuracy_fp16']:.3f}  diff {paired['difference']:+.3f} "
                       f"[{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}]  flips -{paired['correct_to_wrong']}/"
                       f"+{paired['wrong_to_correct']}  McNemar p {paired['mcnemar_p']:.3f}") if paired else ""
            log.info("compare %-8s %-12s %-12s %s", name, domain, d["verdict"].upper(), numbers)
            if d["verdict"] != "pass":
                log.info("    %s", "; ".join(d["reasons"]))
    log.info("compare: results/compare.json, results/compare.csv, results/plots/{pareto,flips,kl_percentiles}.png")
    return 0


ROUTING_TABLE = RESULTS / "routing_table.json"


def cmd_route(args: argparse.Namespace) -> int:
    """Build the routing table from compare.json, or look one request up in it."""
    from pipelines import route
    from pipelines.io import read_json, write_json, write_yaml
    from pipelines.lineage import lock_digest
    from pipelines.params import load_params

    if args.action == "lookup":
        from pipelines.classify import classify

        if not ROUTING_TABLE.is_file():
            raise QuantgateError(f"{ROUTING_TABLE} not found: run `dvc repro` (or `quantgate route`) first")
        domain = classify(args.text)
        row = route.lookup(read_json(ROUTING_TABLE), domain, args.context_tokens)
        print(row["serve"])
        log.info("route: %s request, %d tokens (bucket <= %d): serve %s, fallback under memory pressure %s (%s)",
                 domain, args.context_tokens, row["max_context_tokens"], row["serve"],
                 row["fallback_under_memory_pressure"], row["reason"])
        return 0
    from pipelines.models import VARIANTS_DIR

    params = load_params()
    report = read_json(RESULTS / "compare.json")
    table = route.build_table(report, params.route.context_buckets, params.compare.policy_for, VARIANTS_DIR,
                              lock_digest())
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
    from pipelines.lineage import git_commit, lock_digest
    from pipelines.params import load_params

    params = load_params()
    digest = lock_digest()
    if digest is None:
        raise QuantgateError("dvc.lock not found: record runs inside `dvc repro`, after the stages it records")
    uri = tracking_uri()
    with logs.library_output("mlflow"):
        summary = record.record_pipeline(params, uri, digest, git_commit(), artifact_root=artifact_root())
    write_json(RESULTS / "mlflow_run.json", {**summary, "tracking_uri": uri, "dvc_lock_sha256": digest,
                                              "registered_model": params.registered_model_name()})
    if summary["status"] == "already recorded":
        log.info("record: dvc.lock %s already recorded as run %s: nothing written", digest[:12], summary["parent_run_id"])
    else:
        log.info("record: parent run %s with %d child runs in experiment %r (%s)", summary["parent_run_id"],
                 len(summary["children"]), params.mlflow.experiment, uri)
        for row in summary["registered"]:
            log.info("record: registered %s as %s version %s", row["variant"], params.registered_model_name(), row["version"])
        if summary["registered"]:
            log.info("record: alias 'candidate' -> version %s (%s)", summary["registered"][-1]["version"],
                     summary["registered"][-1]["variant"])
        else:
            log.info("record: no variant passed every domain: nothing registered")
    log.info("record: `quantgate ui` opens the MLflow UI")
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    """The release verdict: exit 0 pass, 1 fail, 2 could not decide (any exception included)."""
    from pipelines import gate
    from pipelines.io import atomic_write_text, read_json, write_json

    result = {"verdict": "undecided", "gated": args.variant or [], "dvc_lock_sha256": None, "reasons": []}
    report = table = None
    try:
        from pipelines import compare
        from pipelines.lineage import git_commit, lock_digest
        from pipelines.params import load_params

        params = load_params()
        digest = lock_digest()
        compare_path, table_path = RESULTS / "compare.json", ROUTING_TABLE
        report = read_json(compare_path) if compare_path.is_file() else None
        table = read_json(table_path) if table_path.is_file() else None
        unknown = [n for n in args.variant or [] if n not in params.variants and n not in params.candidates]
        if unknown:
            raise QuantgateError(f"--variant {unknown[0]!r} is neither a variant nor a candidate in params.yaml")
        expected = compare.expected_items(params.evaluate.domains, params.evaluate.limit)
        result = gate.decide(report, params, expected, digest, args.variant or None)
        result["git"] = git_commit()
        run_file = RESULTS / "mlflow_run.json"
        if run_file.is_file():
            run = read_json(run_file)
            if run.get("dvc_lock_sha256") == digest:
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
        atomic_write_text(RESULTS / "report.md", gate.render_report(result, report, table))
    except Exception as err:  # noqa: BLE001
        print(f"quantgate gate: could not write results/gate.json: {err}", file=sys.stderr)
        return 2
    print(f"quantgate gate: {result['verdict'].upper()} (exit {result['exit_code']}) for "
          f"{', '.join(result['gated']) or 'nothing'}")
    for reason in result["reasons"][:12]:
        print(f"  - {reason}")
    if len(result["reasons"]) > 12:
        print(f"  ... {len(result['reasons']) - 12} more in results/gate.json")
    if result.get("promotion"):
        print(f"  promotion: {result['promotion']['status']}: {result['promotion']['detail']}")
    print("  results/gate.json, results/report.md")
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
    """Start the MLflow UI on localhost over quantgate's tracking store."""
    mlflow = shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow"))
    cmd = [mlflow, "ui", "--backend-store-uri", tracking_uri(), "--host", "127.0.0.1", "--port", str(args.port)]
    log.info("MLflow UI on http://127.0.0.1:%d (Ctrl-C stops it)", args.port)
    return subprocess.call(cmd)


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
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("admit", help="stage 3b: validate a third-party checkpoint from candidates: -> models/variants/<name>/")
    p.add_argument("candidate")
    p.set_defaults(func=cmd_admit)

    p = sub.add_parser("memory", help="stage 4: memory of one variant (fresh process) -> results/memory/<variant>.json")
    p.add_argument("variant")
    p.add_argument("--inject-leak-bytes", type=int, default=0, metavar="N",
                   help="keep N extra bytes alive per soak round: checks that the leak detector fires")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("memory-report", help="stage 4b: all variants' memory on one chart, growth vs fp16")
    p.set_defaults(func=cmd_memory_report)

    p = sub.add_parser("fidelity-base", help="stage 5a: fp16 next-token distributions over held-out text, stored once")
    p.set_defaults(func=cmd_fidelity_base)

    p = sub.add_parser("evaluate", help="stage 5: lm-eval probes per item + fidelity vs fp16 -> results/eval/<variant>.json")
    p.add_argument("variant")
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

    p = sub.add_parser("gate", help="release verdict: exit 0 pass, 1 fail, 2 could not decide; "
                                    "writes results/gate.json and results/report.md")
    p.add_argument("--variant", action="append", metavar="NAME",
                   help="gate only this variant or candidate (repeatable); default: all of them")
    p.add_argument("--promote", action="store_true",
                   help="when the gate passes, move the registry alias 'production' to 'candidate' "
                        "unless it regresses against the current production version")
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser("ui", help="start the MLflow UI on 127.0.0.1 over the local tracking store")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=cmd_ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(verbose=args.verbose)
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
