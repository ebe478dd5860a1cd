"""`quantgate <verb>`: parse the command line and hand it to the verb's entry function. Nothing else.

Each verb is a `"module:function"` name, imported only when that verb runs (so `route lookup` and
`doctor` pay for no torch import), and no stage depends on this file: editing it re-runs nothing.
Bad input ends with one line on stderr naming the file, line or key (exit 2); unexpected errors
keep their traceback in logs/quantgate.log and print one line here (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pipelines.core import lineage, logs, timing
from pipelines.core.errors import QuantgateError

VERBS = {  # verb -> entry function; the stages are also dvc.yaml stages of the same name
    "reference": "pipelines.reference:main",
    "calibrate": "pipelines.calibrate:main",
    "quantize": "pipelines.quantize:main",
    "admit": "pipelines.admit:main",
    "memory": "pipelines.memory:main",
    "memory-report": "pipelines.memory_report:main",
    "baseline": "pipelines.baseline:main",
    "evaluate": "pipelines.evaluate:main",
    "compare": "pipelines.compare:main",
    "shadow": "pipelines.shadow:main",
    "route": "pipelines.route:main",
    "route lookup": "pipelines.routing.router:print_route",
    "record": "pipelines.record:main",
    "fanout": "pipelines.fanout:main",
    "repro": "pipelines.repro:main",
    "gate": "pipelines.gate:main",
    "audit": "pipelines.audit:main",
    "fetch": "pipelines.fetch:main",
    "ui": "pipelines.store.tracking:ui",
    "doctor": "pipelines.doctor:main",
    "profile": "pipelines.profile:main",
}
FAILED_BECAUSE = "record this stage as failed with CAUSE, without running it (quantgate fanout uses it)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantgate", description="Validate quantized LLM checkpoints before release. "
                                                                   "`dvc repro` runs the stages in order.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug messages on the console")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<stage>")

    def verb(name: str, help: str, *positional: str, failed_because: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        for arg in positional:
            p.add_argument(arg)
        if failed_because:
            p.add_argument("--failed-because", metavar="CAUSE", default=None, help=FAILED_BECAUSE)
        return p

    verb("reference", "stage 1: train the embedded reference model -> models/reference/")
    verb("calibrate", "stage 2: domain calibration sets + coverage against production traffic")
    verb("quantize", "stage 3: quantize one variant from params.yaml -> models/variants/<variant>/", "variant",
         failed_because=True)
    verb("admit", "stage 3b: validate a third-party checkpoint from candidates: -> models/variants/<name>/",
         "candidate", failed_because=True)
    p = verb("memory", "stage 4: memory of one variant (fresh process) -> results/memory/<variant>.json", "variant",
             failed_because=True)
    p.add_argument("--inject-leak-bytes", type=int, default=0, metavar="N",
                   help="keep N extra bytes alive per soak round: checks that the leak detector fires")
    p.add_argument("--inject-leak-rounds", type=int, default=None, metavar="K",
                   help="... for the first K rounds only: a warm-up that plateaus, which must not count as a leak")
    verb("memory-report", "stage 4b: all variants' memory on one chart, growth vs fp16")
    verb("baseline", "stage 5a: fp16 answers every look of every probe pool -> results/baseline/")
    verb("evaluate", "stage 5: lm-eval probes per item + fidelity vs fp16 -> results/eval/<variant>.json", "variant",
         failed_because=True)
    verb("compare", "stage 6: paired A/B of every variant vs fp16 per domain -> results/compare.json")
    verb("shadow", "stage 6b: replay a traffic log through fp16 and the passing variants -> results/shadow.json")
    p = verb("route", "stage 7: routing table -> results/routing_table.{json,yaml}; `route lookup TEXT` serves one")
    lookup = p.add_subparsers(dest="action", metavar="[lookup]").add_parser(
        "lookup", help="classify TEXT and print the variant that serves it")
    lookup.add_argument("text")
    lookup.add_argument("--context-tokens", type=int, required=True, metavar="N", help="prompt + output tokens")
    lookup.add_argument("--json", action="store_true", dest="as_json", help="the row and its router metadata as JSON")
    verb("record", "stage 8: parent + child runs in MLflow, passing variants into the registry")
    p = verb("fanout", "run the per-variant chains (quantize/admit, memory, baseline, evaluate) as Ray tasks on a "
                       "cluster and record them in dvc.lock; then dvc repro does the rest")
    p.add_argument("--address", default=None, metavar="ADDR", help="the Ray cluster (`auto`: the one `ray start` "
                   "runs here; default: RAY_ADDRESS, else a local Ray started for this run)")
    p.add_argument("--report", metavar="FILE", help="also write what ran where, failed and was committed, as JSON")
    p.add_argument("--insecure", action="store_true", help="use a Ray cluster without token auth (docs/fanout.md)")
    verb("repro", "the whole pipeline (scripts/run.sh runs it): the per-variant chains side by side on a local Ray "
                  "cluster (2+ cores), then dvc repro").add_argument("--sequential", action="store_true",
                                                                     help="plain dvc repro")
    p = verb("gate", "release verdict: exit 0 pass, 1 fail, 2 could not decide -> results/gate.json, report.md")
    p.add_argument("--variant", action="append", metavar="NAME",
                   help="gate only this variant or candidate (repeatable); default: all of them")
    p.add_argument("--promote", action="store_true", help="when the gate passes, move the registry alias "
                   "'production' to 'candidate' unless it regresses against the current production version")
    p.add_argument("--audit", action="store_true", help="first `quantgate audit`: records that disagree exit 2")
    p.add_argument("--audit-seed", type=int, default=None, metavar="N", help="repeat the audit sample of seed N")
    p = verb("audit", "re-measure a fresh random sample of the recorded items and fidelity texts through each "
                      "checkpoint; exit 2 naming the records that disagree (results/audit.json)")
    p.add_argument("--variant", action="append", metavar="NAME", help="only this variant (repeatable), and fp16")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="repeat seed N's sample (default: os.urandom)")
    p = verb("fetch", "download the checkpoint behind a registry alias or version, each file's sha256 checked")
    p.add_argument("ref", metavar="ALIAS_OR_VERSION", help="production, candidate, or a version number (3 or v3)")
    p.add_argument("--model", metavar="NAME", help="registered model (default: quantgate-<model> from params.yaml)")
    p.add_argument("--dest", metavar="DIR", help="where to put it (default: models/fetched/<NAME>-v<version>); "
                                                 "an existing non-empty DIR is only accepted when it holds those bytes")
    verb("ui", "start the MLflow UI on 127.0.0.1 over the local tracking store").add_argument("--port", type=int, default=5000)
    p = verb("doctor", "check what the configured run needs here (sandbox, torch and devices, quantization backends, "
                       "MLflow, disk, model, dvc); exit 1 when it could not give a verdict")
    p.add_argument("--params", default="params.yaml", metavar="FILE", help="the params file to check (default: %(default)s)")
    verb("profile", "another model's run in workspaces/NAME (profiles/NAME.yaml); no NAME: list").add_argument("name", nargs="?")
    return parser


def entry(args: argparse.Namespace):
    """The verb's entry function and its keyword arguments (every option but the global ones)."""
    verb = "route lookup" if getattr(args, "action", None) == "lookup" else args.command
    module, function = VERBS[verb].split(":")
    kwargs = {k: v for k, v in vars(args).items() if k not in ("command", "verbose", "action")}
    return getattr(importlib.import_module(module), function), kwargs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verb = "route lookup" if getattr(args, "action", None) == "lookup" else args.command
    logs.setup(verbose=args.verbose, libraries=verb not in logs.NO_TORCH_COMMANDS)  # their torch import: 2 s
    timing.start(timing.stage_of(vars(args)))  # benchmarks/pipeline_speed.py reads where its time went
    try:
        function, kwargs = entry(args)
        return lineage.refuse_foreign_code(verb) or function(**kwargs)
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
    finally:
        timing.flush()


if __name__ == "__main__":
    sys.exit(main())
