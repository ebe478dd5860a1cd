"""Stage `evaluate@<variant>`: the probes through lm-eval, per item, plus fidelity against fp16.

Each variant is loaded once through the shared loader and wrapped in lm-eval's HFLM; every item's
target, response and correctness is kept under its stable id (`doc.id`, with lm-eval's doc and
prompt hashes) so the A/B stage can pair items across variants. Batch size and seeds are fixed:
lm-eval scores can move with batch size.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipelines import fidelity
from pipelines.logs import library_output
from pipelines.models import load_variant

log = logging.getLogger(__name__)

EVAL_DIR = Path("eval")
# domain -> (lm-eval task, the metric that scores an item correct)
PROBES = {"math": ("quantgate_math", "exact_match"), "code": ("quantgate_code", "pass@1"),
          "chat": ("quantgate_chat", "acc"), "code_comment": ("quantgate_code_comment", "acc")}
PLACEHOLDERS = (999, "N/A")
REQUIRED_FIELDS = {"math": ("id", "question", "answer"), "code": ("id", "prompt", "canonical", "tests"),
                   "chat": ("id", "context", "choices", "gold"), "code_comment": ("id", "context", "choices", "gold")}


def check_items(domains: list[str]) -> None:
    """Every probe file exists and every item has what its task needs; errors name file, line and field."""
    from pipelines.errors import QuantgateError
    from pipelines.io import read_jsonl

    for domain in domains:
        path = EVAL_DIR / domain / "items.jsonl"
        for number, item in enumerate(read_jsonl(path), start=1):
            missing = [f for f in REQUIRED_FIELDS[domain] if item.get(f) in (None, "")]
            if missing:
                raise QuantgateError(f"{path}:{number}: item {item.get('id', '?')} has no {', '.join(missing)}")


def _number(value):
    """lm-eval reports stderr as 'N/A' or 999 when it has none: record those as missing."""
    if value in PLACEHOLDERS or value is None:
        return None
    return float(value)


def run_probes(model, tokenizer, domains: list[str], batch_size: int, limit: int | None = None,
               allow_unisolated_code: bool = False) -> tuple[dict, list[dict]]:
    """(summary per domain, per-item records) from one lm_eval.simple_evaluate call.

    Code probes run model-written code through the sandbox; where it cannot isolate and the user has
    not allowed unisolated runs, the code domain is refused (recorded, never silently scored 0).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from pipelines import sandbox

    summary: dict = {}
    isolated = sandbox.isolation_available()
    if "code" in domains:
        if not isolated and not allow_unisolated_code:
            summary["code"] = {"task": PROBES["code"][0], "status": "refused", "score": None, "stderr": None,
                               "items": 0, "reason": "sandbox isolation unavailable; set "
                               "evaluate.allow_unisolated_code: true to run code probes anyway"}
            domains = [d for d in domains if d != "code"]
        os.environ["QUANTGATE_ALLOW_UNISOLATED_CODE"] = "1" if allow_unisolated_code else "0"
    tasks = {PROBES[d][0]: d for d in domains}
    with library_output("lm_eval"):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = simple_evaluate(model=lm, tasks=list(tasks), task_manager=TaskManager(include_path=str(EVAL_DIR),
                              include_defaults=False), log_samples=True, limit=limit, random_seed=0,
                              numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                              confirm_run_unsafe_code="code" in domains)
    items = []
    for task, domain in tasks.items():
        metric = PROBES[domain][1]
        res = out["results"][task]
        samples = out["samples"][task]
        summary[domain] = {"task": task, "status": "ok", "task_version": out.get("versions", {}).get(task), "metric": metric,
                           "score": _number(res.get(f"{metric},none")),
                           "stderr": _number(res.get(f"{metric}_stderr,none")), "items": len(samples)}
        for s in samples:
            items.append({"domain": domain, "task": task, "item_id": s["doc"]["id"], "doc_id": s["doc_id"],
                          "doc_hash": s["doc_hash"], "prompt_hash": s["prompt_hash"], "target": str(s["target"]),
                          "response": str(s["filtered_resps"][0]), "correct": bool(s[metric])})
        if domain == "code":
            summary[domain]["isolation"] = sandbox.FULL if isolated else sandbox.WEAK
    return summary, items


def fidelity_texts(domains: list[str], per_domain: int) -> dict[str, list[str]]:
    """Held-out text per domain: the probe items' prompts with their gold answers."""
    from pipelines.io import read_jsonl

    texts = {}
    for domain in domains:
        rows = read_jsonl(EVAL_DIR / domain / "items.jsonl")[:per_domain]
        if domain == "math":
            texts[domain] = [r["question"] + r["answer"] for r in rows]
        elif domain == "code":
            texts[domain] = [r["prompt"] + r["canonical"] for r in rows]
        else:
            texts[domain] = [r["context"] + r["choices"][r["gold"]] for r in rows]
    return texts


def evaluate_variant(variant_dir: str, base_path: Path, domains: list[str], batch_size: int, device: str,
                     limit: int | None = None, allow_unisolated_code: bool = False) -> tuple[dict, list[dict]]:
    """Probes and fidelity for one variant; a variant that cannot load is recorded as failed."""
    result: dict = {"variant": Path(variant_dir).name, "device": device, "batch_size": batch_size}
    try:
        check_items(domains)
        model, tokenizer = load_variant(variant_dir, device)
        if tokenizer.pad_token is None:  # HFLM batches need one; say so rather than fail deep inside
            tokenizer.pad_token = tokenizer.eos_token
            result["note"] = "tokenizer had no pad token; eos is used for padding"
        summary, items = run_probes(model, tokenizer, domains, batch_size, limit, allow_unisolated_code)
        result["probes"] = summary
        result["fidelity"] = fidelity.compare(model, fidelity.load_base(base_path), domains, device)
        result["status"] = "ok"
        return result, items
    except Exception as err:  # noqa: BLE001 - one variant's failure is that variant's result
        logging.getLogger().error("evaluate %s failed", variant_dir, exc_info=True)
        result.update({"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]})
        return result, []
