"""Try quantizer settings without a pipeline run: what each costs against fp16, before a variant is added.

    .venv/bin/python benchmarks/quantizer_settings.py \
        '{"method": "gptq", "bits": 3, "group_size": 32, "sym": false, "desc_act": true}' \
        '{"method": "gptq", "bits": 3, "group_size": 32, "sym": false, "desc_act": true, "damp_percent": 0.01}'

Each argument is a variant's settings (params.yaml `variants.<name>`). Each is quantized by the quantize
stage's own code from params.yaml's model and calibration set, on params.yaml's device, then measured two ways:
- fidelity against fp16: KL and same top-1 over every token of the baseline's fidelity texts (`pipelines.evaluation.fidelity`;
  `evaluate.fidelity_texts` items per domain, drawn from the probe pools across their families, prompt and answer);
- per domain whose probe task generates an answer (math, code, code_comment here): the whole pool answered greedily
  by fp16 and by the variant, lost / gained counted as exact matches with the task's target. For code that is the
  canonical body, not the tests the evaluate stage runs: a proxy (on the shipped gptq3, 15 lost / 2 gained where
  the pipeline's pass@1 gives 15 / 3).
The lost/gained counts are the statistic the gate judges, on the same items: a setting chosen because it loses
fewer of them is tuned on the test items. Prefer the fidelity columns (thousands of token-level comparisons).
Needs a finished `dvc repro` (models/, calibration_sets/built, results/baseline). In-process: meant for settings
of the project's own quantizers, not for untrusted checkpoints.

Writes every row to docs/measured/quantizer_settings.json, or `--record PATH` (docs/quantize.md renders
docs/measured/quantizer_settings_awq.json, docs/compare.md docs/measured/quantizer_settings_gptq3.json); `--label TEXT`
(once per setting, in order) names the rows; --no-record: print only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import measured  # noqa: E402
from pipelines.core import logs  # noqa: E402
from pipelines.core.params import load_params  # noqa: E402
from pipelines.core.params_sections import VariantParams  # noqa: E402
from pipelines.evaluation import fidelity
from pipelines.evaluation.harness import full_text  # noqa: E402
from pipelines.evaluation.plans import probe_items, task_yaml  # noqa: E402
from pipelines.models.loading import load_variant, resolve_device, resolve_model  # noqa: E402
from pipelines.models.skills import greedy_completions  # noqa: E402
from pipelines.quantize import quantize_variant  # noqa: E402

BUILT = Path("calibration_sets/built")
FP16 = Path("models/variants/fp16")
FIDELITY_BASE = Path("results/baseline/fidelity.safetensors")




def fewer_samples(built: Path, samples: int, out: Path) -> Path:
    """A copy of the built calibration sets with each method's file cut to its first `samples` texts."""
    import shutil

    shutil.copytree(built, out, dirs_exist_ok=True)
    for path in (out / "by_method").glob("*.jsonl"):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        path.write_text("".join(lines[:samples]), encoding="utf-8")
    return out


def generated_tasks(params) -> dict[str, dict]:
    """Domain -> its probe task's prompt and target templates, token budget and stop strings, for the domains
    whose probe task generates an answer from Jinja templates; the others are named and skipped."""
    out = {}
    for name in params.evaluate.domains:
        task_name = params.requests[name].probes.task
        found = [t for t in (task_yaml(f) for f in sorted(Path("eval", name).glob("*.yaml")))
                 if t and t.get("task") == task_name]
        task = found[0] if found else {}
        text, target = task.get("doc_to_text"), task.get("doc_to_target")
        if task.get("output_type") != "generate_until" or not isinstance(text, str) or not isinstance(target, str):
            print(f"{name}: no lost/gained count (task {task_name} in eval/{name}/ is not a generate_until task "
                  "with doc_to_text and doc_to_target templates)", file=sys.stderr)
            continue
        kwargs = task.get("generation_kwargs") or {}
        out[name] = {"prompt": text, "target": target, "max_new_tokens": kwargs.get("max_gen_toks", 256),
                     "until": list(kwargs.get("until") or [])}
    return out


def answers_of(model, tokenizer, tasks: dict[str, dict], items: dict[str, list[dict]]) -> dict[str, list[str]]:
    """Each generating domain's greedy completions, cut at the task's stop strings, spaces removed (the probes
    ignore spaces)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return {d: [c.replace(" ", "") for c in greedy_completions(model, tokenizer, [full_text(t["prompt"], i) for i in items[d]],
                                                               t["max_new_tokens"], tuple(t["until"]))]
            for d, t in tasks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", help="a variant's settings as JSON (params.yaml variants.<name>)")
    parser.add_argument("--label", action="append", default=[], help="the row's name in the docs, once per setting")
    parser.add_argument("--items", type=int, default=None, help="answer only the first N items of each generating "
                                                                "domain's pool (default: all of them)")
    parser.add_argument("--calibration-samples", type=int, default=None, metavar="N",
                        help="quantize from only the first N texts of each method's calibration set (what a smaller "
                             "calibration.samples costs, without rebuilding the sets)")
    measured.add_arguments(parser, "quantizer_settings")
    args = parser.parse_args()
    started, rows = time.perf_counter(), []
    logs.setup(log_file=Path("logs/benchmark.log"))
    torch.manual_seed(0)
    params = load_params()
    source, device = resolve_model(params.model), resolve_device(params.device)
    tasks = generated_tasks(params)
    items = {d: probe_items(d)[:args.items] for d in tasks}
    targets = {d: [full_text(t["target"], i).replace(" ", "") for i in items[d]] for d, t in tasks.items()}
    base = answers_of(*load_variant(FP16, device), tasks, items)
    record = fidelity.load_base(FIDELITY_BASE)
    domains = list(params.evaluate.domains)
    print("settings | " + " | ".join(f"{d}: KL mean, p99, same top-1" for d in domains) + " | "
          + " | ".join(f"{d}: lost/gained of {len(items[d])}" for d in tasks))
    built = fewer_samples(BUILT, args.calibration_samples, Path(tempfile.mkdtemp())) if args.calibration_samples else BUILT
    for n, arg in enumerate(args.settings):
        settings = VariantParams(**json.loads(arg))
        with tempfile.TemporaryDirectory() as tmp:
            manifest, timing = quantize_variant("trial", settings, source, built, device, Path(tmp))
            if manifest["status"] != "ok":
                print(f"{arg} | failed: {manifest.get('error')}", flush=True)
                continue
            model, tokenizer = load_variant(Path(tmp) / "trial", device)
            fid = fidelity.compare(model, record, domains, device)
            mine = answers_of(model, tokenizer, tasks, items)
            del model
        cells = [f"{fid[d]['kl']['mean']:.4f}, {fid[d]['kl']['p99']:.3f}, {fid[d]['same_top1']:.1%}" for d in domains]
        for d in tasks:
            pairs = list(zip(base[d], mine[d], targets[d]))
            lost = sum(b == t != m for b, m, t in pairs)
            gained = sum(m == t != b for b, m, t in pairs)
            cells.append(f"{lost}/{gained}")
        print(f"{arg} | " + " | ".join(cells), flush=True)
        lost_gained = {}
        for d in tasks:
            pairs = list(zip(base[d], mine[d], targets[d]))
            lost_gained[d] = [sum(b == t != m for b, m, t in pairs), sum(m == t != b for b, m, t in pairs)]
        rows.append({"label": args.label[n] if n < len(args.label) else None, "settings": json.loads(arg),
                     "quantize_seconds": timing.get("quantize_seconds"),
                     "calibration_samples": (manifest.get("calibration") or {}).get("samples"),
                     "fidelity": {d: {"kl_mean": fid[d]["kl"]["mean"], "kl_p99": fid[d]["kl"]["p99"],
                                      "same_top1": fid[d]["same_top1"]} for d in domains},
                     "lost_gained": lost_gained})
    measured.record(args.record, "quantizer_settings", {
        "domains": domains, "generating_domains": list(tasks), "pool_sizes": {d: len(items[d]) for d in tasks},
        "seconds": round(time.perf_counter() - started, 1), "rows": rows})


if __name__ == "__main__":
    main()
