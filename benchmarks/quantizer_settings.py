"""Try quantizer settings without a pipeline run: what each costs against fp16, before a variant is added.

    .venv/bin/python benchmarks/quantizer_settings.py \
        '{"method": "gptq", "bits": 3, "group_size": 32, "sym": false, "desc_act": true}' \
        '{"method": "gptq", "bits": 3, "group_size": 32, "sym": false, "desc_act": true, "damp_percent": 0.01}'

Each argument is a variant's settings (params.yaml `variants.<name>`). Each is quantized by the quantize
stage's own code from params.yaml's model and calibration set, then measured two ways:
- fidelity against fp16 on the held-out fidelity texts (the baseline's record, `pipelines.fidelity.compare`);
- per probe domain whose lm-eval task generates an answer (math, code, code_comment): the pool's items
  answered greedily by fp16 and by the variant, lost / gained counted as exact matches with the task's target.
  For code that is the canonical body, not the tests the evaluate stage runs, so it is a proxy (on the shipped
  gptq3 it gives 15 lost / 2 gained where the pipeline's pass@1 gives 15 / 3).
Choose on the fidelity texts: the probe pools are what the gate judges, and picking the setting the pool
happens to like is tuning on the test items. Needs a finished `dvc repro` (models/, calibration_sets/built,
results/baseline).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402

from pipelines import fidelity, logs  # noqa: E402
from pipelines.evaluate import probe_items  # noqa: E402
from pipelines.models import load_variant, resolve_model  # noqa: E402
from pipelines.params import VariantParams, load_params  # noqa: E402
from pipelines.quantize import quantize_variant  # noqa: E402

BUILT = Path("calibration_sets/built")
FP16 = Path("models/variants/fp16")
FIDELITY_BASE = Path("results/baseline/fidelity.safetensors")


class TaskLoader(yaml.SafeLoader):
    """lm-eval task YAML: `!function module.name` tags are read as None (only the plain keys matter here)."""


TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def generated_tasks(params) -> dict[str, dict]:
    """Domain -> (prompt field, target field, max new tokens) of the project's generate_until probe tasks."""
    out = {}
    for name in params.requests:
        task = yaml.load(next(Path("eval", name).glob("*.yaml")).read_text(encoding="utf-8"), Loader=TaskLoader)
        if task.get("output_type") != "generate_until":
            continue
        field = lambda template: re.fullmatch(r"\{\{\s*(\w+)\s*\}\}", template).group(1)  # noqa: E731
        out[name] = {"prompt": field(task["doc_to_text"]), "target": field(task["doc_to_target"]),
                     "max_new_tokens": task["generation_kwargs"]["max_gen_toks"]}
    return out


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Each prompt's greedy completion up to </s> or a newline, spaces removed (the probes ignore spaces)."""
    tokenizer.padding_side, answers = "left", []
    for start in range(0, len(prompts), 64):
        batch = tokenizer(prompts[start:start + 64], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers += [tokenizer.decode(row).split("</s>")[0].split("\n")[0].replace(" ", "")
                    for row in out[:, batch["input_ids"].shape[1]:]]
    return answers


def answers_of(variant_dir: Path, tasks: dict[str, dict], items: dict[str, list[dict]]) -> dict[str, list[str]]:
    model, tokenizer = load_variant(variant_dir)
    return {d: greedy(model, tokenizer, [i[t["prompt"]] for i in items[d]], t["max_new_tokens"]) for d, t in tasks.items()}


def main() -> None:
    logs.setup(log_file=Path("logs/benchmark.log"))
    torch.manual_seed(0)
    params = load_params()
    source = resolve_model(params.model)
    tasks = generated_tasks(params)
    items = {d: probe_items(d) for d in tasks}
    targets = {d: [str(i[t["target"]]).replace(" ", "") for i in items[d]] for d, t in tasks.items()}
    base = answers_of(FP16, tasks, items)
    record = fidelity.load_base(FIDELITY_BASE)
    domains = list(params.requests)
    print("settings | " + " | ".join(f"{d}: KL mean, p99, same top-1" for d in domains) + " | "
          + " | ".join(f"{d}: lost/gained of {len(items[d])}" for d in tasks))
    for arg in sys.argv[1:]:
        settings = VariantParams(**json.loads(arg))
        with tempfile.TemporaryDirectory() as tmp:
            manifest, _ = quantize_variant("trial", settings, source, BUILT, "cpu", Path(tmp))
            if manifest["status"] != "ok":
                print(f"{arg} | failed: {manifest.get('error')}", flush=True)
                continue
            model, _ = load_variant(Path(tmp) / "trial")
            fid = fidelity.compare(model, record, domains, "cpu")
            mine = answers_of(Path(tmp) / "trial", tasks, items)
        cells = [f"{fid[d]['kl']['mean']:.4f}, {fid[d]['kl']['p99']:.3f}, {fid[d]['same_top1']:.1%}" for d in domains]
        for d in tasks:
            pairs = list(zip(base[d], mine[d], targets[d]))
            lost = sum(b == t != m for b, m, t in pairs)
            gained = sum(m == t != b for b, m, t in pairs)
            cells.append(f"{lost}/{gained}")
        print(f"{arg} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
