"""Probe throughput through quantgate against bare lm-eval, and the cost of fidelity against one forward pass.

    .venv/bin/python benchmarks/evaluate_overhead.py [--variant gptq3] [--repeats 2]

Needs `dvc repro` up to the evaluate stage (a built variant and results/eval/fidelity_base.safetensors).
Prints: items/s through `evaluation.harness.run_probes` vs a bare `lm_eval.simple_evaluate` on the same tasks,
model object and batch size (goal: ratio >= 0.95), and seconds of `fidelity.compare` vs one plain
forward pass over the same token sequences (goal: <= 1.2x). Best of `repeats`, alternating. Writes the numbers to
docs/measured/evaluate_overhead.json (docs/evaluate.md renders them; --no-record: print only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import measured  # noqa: E402
from pipelines.core import logs  # noqa: E402
from pipelines.core.params_requests import DEFAULT_PROBES as PROBES  # noqa: E402
from pipelines.evaluation import fidelity, harness, plans  # noqa: E402
from pipelines.models.loading import load_variant  # noqa: E402

DOMAINS = ["math", "chat", "code_comment"]  # code probes add sandbox time that bare lm-eval would not have


def bare_lm_eval(model, tok, batch_size: int) -> int:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with logs.library_output("bench"):
        out = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size),
                              tasks=[PROBES[d].task for d in DOMAINS],
                              task_manager=TaskManager(include_path="eval", include_defaults=False), log_samples=True)
    return sum(len(v) for v in out["samples"].values())


@torch.no_grad()
def forward_only(model, base: dict) -> None:
    for domain in DOMAINS:
        lengths, flat, start = base[f"{domain}.lengths"].tolist(), base[f"{domain}.input_ids"].tolist(), 0
        for n in lengths:
            model(torch.tensor([flat[start : start + n]]))
            start += n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="gptq3")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    measured.add_arguments(parser, "evaluate_overhead")
    args = parser.parse_args()
    logs.setup(log_file=Path("logs/benchmark.log"))
    model, tok = load_variant(Path("models/variants") / args.variant)
    base = fidelity.load_base(Path("results/eval/fidelity_base.safetensors"))
    best = {"bare": float("inf"), "quantgate": float("inf"), "forward": float("inf"), "fidelity": float("inf")}
    items = 0
    for _ in range(args.repeats):
        t = time.perf_counter()
        items = bare_lm_eval(model, tok, args.batch_size)
        best["bare"] = min(best["bare"], time.perf_counter() - t)
        t = time.perf_counter()
        harness.run_probes(model, tok, {d: list(range(len(plans.probe_items(d)))) for d in DOMAINS}, args.batch_size,
                            probes={d: PROBES[d].model_dump() for d in DOMAINS})
        best["quantgate"] = min(best["quantgate"], time.perf_counter() - t)
        t = time.perf_counter()
        forward_only(model, base)
        best["forward"] = min(best["forward"], time.perf_counter() - t)
        t = time.perf_counter()
        fidelity.compare(model, base, DOMAINS)
        best["fidelity"] = min(best["fidelity"], time.perf_counter() - t)
    print(f"variant {args.variant}, {items} probe items, best of {args.repeats}")
    print(f"probes: bare lm-eval {items / best['bare']:.1f} items/s, quantgate {items / best['quantgate']:.1f} items/s, "
          f"throughput ratio {best['bare'] / best['quantgate']:.3f} (goal >= 0.95)")
    print(f"fidelity: one forward pass {best['forward']:.2f} s, fidelity.compare {best['fidelity']:.2f} s, "
          f"ratio {best['fidelity'] / best['forward']:.3f} (goal <= 1.2)")
    measured.record(args.record, "evaluate_overhead", {
        "variant": args.variant, "items": items, "domains": DOMAINS, "repeats": args.repeats, "batch_size": args.batch_size,
        "bare_items_per_s": round(items / best["bare"], 2), "quantgate_items_per_s": round(items / best["quantgate"], 2),
        "throughput_ratio": round(best["bare"] / best["quantgate"], 4), "forward_seconds": round(best["forward"], 3),
        "fidelity_seconds": round(best["fidelity"], 3), "fidelity_ratio": round(best["fidelity"] / best["forward"], 4)})


if __name__ == "__main__":
    main()
