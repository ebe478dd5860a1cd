"""What tracing a growing soak costs: the same rounds with and without memray, on a real checkpoint.

    .venv/bin/python benchmarks/trace_overhead.py [--variant DIR] [--rounds 9] [--leak-bytes 1740000]

Loads one variant (default: the SmolLM2 profile's int8, workspaces/smollm2/models/variants/int8, else the default
run's models/variants/int8) on the CPU, runs two warm-up rounds of the memory stage's soak traffic, then `--rounds`
rounds untraced and `--rounds` rounds under the tracer (pipelines/measure/attribution.py's `explain`, as the stage
runs it), both keeping `--leak-bytes` alive per round (default: the int8 growth seen on an Intel Xeon, 1.74 MB).
Prints seconds per round each way, their ratio (the overhead inside the rounds), the seconds spent reading the
capture and drawing the flame graph, and what the tracer named. Then traces the variant once more with nothing
injected: what grows in it on this CPU, and where (no class: the stage traces only a soak that grew). Written to docs/measured/trace_overhead.json
(docs/memory.md quotes it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import measured  # noqa: E402
from pipelines.core.params_sections import MemoryParams  # noqa: E402
from pipelines.measure import attribution, phases  # noqa: E402
from pipelines.models.loading import load_variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = [ROOT / "workspaces/smollm2/models/variants/int8", ROOT / "models/variants/int8"]


def traced(model, p: MemoryParams, max_len: int, first: int, inject, out: Path, soak_rate: float) -> dict:
    """explain() as the stage calls it after a soak that grew `soak_rate` B/round."""
    soak = {"rounds_run": first, "growth_bytes_per_round": soak_rate, "growth_last_minus_first": 0}
    return attribution.explain(model, p, max_len, model.config.vocab_size, "cpu", soak, out, inject)


def summary(cause: dict, classified: bool = True) -> dict:
    """What the tracer found; the class only where the stage would have traced (a soak that grew)."""
    top = (cause.get("sites") or [{}])[0]
    series = cause.get("alive_bytes_by_round") or [0]
    grew = series[-1] - series[0]
    return {"class": cause.get("class") if classified else None, "top_site": top.get("frame"),
            "top_library": top.get("library"), "top_native": top.get("native"), "top_share": top.get("share"),
            "grew_between_round_ends": grew, "grew_per_round": grew / max(1, len(series) - 1),
            "capture_bytes": cause.get("capture_bytes"), "seconds": cause.get("seconds"),
            "seconds_in_rounds": cause.get("seconds_in_rounds"), "evidence": cause.get("evidence") if classified else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=Path, default=next((d for d in DEFAULTS if d.is_dir()), DEFAULTS[-1]))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--leak-bytes", type=int, default=1_740_000)
    ap.add_argument("--max-tokens", type=int, default=256, help="the context the soak uses (SmolLM2 profile: 256)")
    ap.add_argument("--threads", type=int, default=2)
    measured.add_arguments(ap, "trace_overhead")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="MatMul8bitLt")  # once per matmul: thousands of lines
    torch.set_num_threads(args.threads)
    p = MemoryParams(max_tokens=args.max_tokens, trace_rounds=args.rounds, tail_rounds=min(8, args.rounds - 2),
                     rounds=max(10, args.rounds), max_rounds=max(10, args.rounds))
    model, _ = load_variant(str(args.variant), "cpu")
    max_len = min(model.config.max_position_embeddings, p.max_tokens)
    print(f"{args.variant}: {args.rounds} rounds each way, {args.leak_bytes:,} B kept per round, context {max_len}",
          flush=True)
    inject = phases.Injection(args.leak_bytes)
    for r in range(2):
        phases.run_round(model, p, max_len, model.config.vocab_size, "cpu", r)
    started = time.perf_counter()
    for r in range(2, 2 + args.rounds):
        phases.run_round(model, p, max_len, model.config.vocab_size, "cpu", r)
        inject.after_round(r, "cpu")
    plain = (time.perf_counter() - started) / args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        leak = traced(model, p, max_len, 2 + args.rounds, inject, Path(tmp) / "leak", args.leak_bytes)
        html = (Path(tmp) / "leak" / "flamegraph.html")
        html_bytes = html.stat().st_size if html.is_file() else None
        own = traced(model, p, max_len, 2 + 2 * args.rounds, None, Path(tmp) / "own", 0.0)
    under = leak["seconds_in_rounds"] / args.rounds
    results = {"variant": str(args.variant.relative_to(ROOT) if args.variant.is_relative_to(ROOT) else args.variant),
               "rounds": args.rounds, "leak_bytes_per_round": args.leak_bytes, "context_tokens": max_len,
               "untraced_seconds_per_round": plain, "traced_seconds_per_round": under,
               "overhead_ratio": under / plain, "analysis_seconds": leak["seconds"] - leak["seconds_in_rounds"],
               "flamegraph_bytes": html_bytes, "injected": summary(leak), "own_growth": summary(own, classified=False)}
    print(f"untraced {plain:.2f} s/round, traced {under:.2f} s/round: x{under / plain:.2f} inside the rounds; "
          f"reading the capture and drawing the flame graph {results['analysis_seconds']:.1f} s")
    inj, mine = results["injected"], results["own_growth"]
    print(f"injected {args.leak_bytes:,} B/round: {inj['class']}, {inj['top_share']:.0%} under {inj['top_site']} "
          f"({inj['grew_per_round']:,.0f} B/round grew between round ends; capture {inj['capture_bytes']:,} B)")
    print(f"nothing injected: {mine['grew_between_round_ends']:,} B grew between the {args.rounds} round ends"
          + (f", the largest site {mine['top_site']} in {mine['top_library']}" if mine["top_site"] else ""))
    measured.record(args.record, "trace_overhead", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
