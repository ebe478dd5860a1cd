"""Does each probe set say anything about a model? fp16's accuracy on a probe's first look against the probe's chance.

    cd workspaces/smollm2 && ../../.venv/bin/python ../../benchmarks/probe_signal.py [--items 200]

Runs in a workspace whose `dvc repro` made models/variants/fp16 (the real-model profile's: `bash scripts/run.sh --model
smollm2`). Every probe set the project ships for a request type, and the ones a profile names instead
(requests.<name>.probes), answered by fp16 through the evaluate stage's own lm-eval call (pipelines/evaluation/harness.py)
on the first look's items (the plan's order), then: accuracy, the low end of its interval (Wilson at 95 %, over the
effective items of the item families, as compare's no-signal rule takes it: pipelines/judging/stats.py) and the mean
chance of the items (1/choices; 0 for generation). A probe whose low end is at or below its chance has no signal: no
variant can be shown to keep what fp16 does not show. Writes docs/measured/probe_signal.json (a ready table).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402

SHIPPED = {  # request type -> the probes the project ships for it (params_requests.DEFAULT_PROBES) and the profile's
    "math": ["quantgate_math", "quantgate_math_choice"], "code": ["quantgate_code"], "chat": ["quantgate_chat"],
    "code_comment": ["quantgate_code_comment"]}


def main() -> None:
    import numpy as np

    from pipelines.core.params import load_params
    from pipelines.core.params_requests import DEFAULT_PROBES
    from pipelines.evaluation.harness import run_probes
    from pipelines.evaluation.plans import probe_items
    from pipelines.judging import sequential
    from pipelines.judging.stats import design_effect, lower_limit
    from pipelines.models.loading import load_variant

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200, help="items per probe set (the first look's)")
    measured.add_arguments(parser, "probe_signal")
    args = parser.parse_args()
    params = load_params()
    probes = {}
    for domain, tasks in SHIPPED.items():
        declared = params.evaluate.probes[domain].model_dump()
        for task in tasks:
            probe = declared if declared["task"] == task else DEFAULT_PROBES[domain].model_dump() \
                if DEFAULT_PROBES[domain].task == task else None
            if probe is not None:
                probes[f"{domain} ({task})"] = (domain, probe)
    model, tokenizer = load_variant("models/variants/fp16", "cpu")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = []
    for key, (domain, probe) in probes.items():
        items = probe_items(domain, probe)
        order = sequential.ordered([str(i["id"]) for i in items], domain)[: args.items]
        position = {str(i["id"]): n for n, i in enumerate(items)}
        summary, records = run_probes(model, tokenizer, {key: [position[i] for i in order]},
                                      params.evaluate.batch_size, params.evaluate.allow_unisolated_code,
                                      probes={key: probe})
        correct = np.array([r["correct"] for r in records], float)
        families = [r.get("family") or f"item:{r['item_id']}" for r in records]
        accuracy = float(correct.mean())
        low = lower_limit(accuracy, len(correct) / design_effect(correct, families)[0], 0.95)
        chance = float(np.mean([r["chance"] for r in records]))
        used = "used" if params.evaluate.probes[domain].task == probe["task"] else "not used"
        rows.append([domain, f"`{probe['task']}`", used, f"{accuracy:.3f} ({int(correct.sum())}/{len(correct)})",
                     f"{low:.3f}", f"{chance:.3f}", "yes" if low > chance else "**no signal**"])
        print(" | ".join(rows[-1]), flush=True)
    measured.record(args.record, "probe_signal", {
        "header": ["request type", "probe task", "in this profile", "fp16 accuracy", "low end (95 %)", "chance",
                   "signal"], "rows": rows},
        note=f"fp16 of `{params.model}` on the first {args.items} items of each pool (the plan's order).")


if __name__ == "__main__":
    main()
