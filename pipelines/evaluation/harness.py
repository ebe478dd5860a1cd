"""Running the probes through lm-eval, per item and look by look, plus fidelity against fp16: one model at a time.

Each variant is loaded once through the shared loader and wrapped in lm-eval's HFLM; every item's
target, response and correctness is kept under its stable id (`doc.id`, with lm-eval's doc and
prompt hashes) so the A/B stage can pair items across variants. Batch size and seeds are fixed:
lm-eval scores can move with batch size. Standard lm-eval tasks listed in `requests.<name>.tasks` run in the
same calls, as rows `<domain>:<task>` with item ids `<task>:<doc_id>` (pipelines/evaluation/standard_tasks.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipelines.core.errors import ENVIRONMENT, environment_cause
from pipelines.core.logs import library_output
from pipelines.core.paths import EVAL_DIR
from pipelines.core.timing import library_call
from pipelines.evaluation import fidelity, standard_tasks
from pipelines.evaluation.plans import PLACEHOLDERS, check_items, probe_items, row_of
from pipelines.models.loading import load_variant, variant_manifest

log = logging.getLogger(__name__)



def _number(value):
    """lm-eval reports stderr as 'N/A' or 999 when it has none: record those as missing."""
    if value in PLACEHOLDERS or value is None:
        return None
    return float(value)


def run_probes(model, tokenizer, requests: dict[str, list[int]], batch_size: int, allow_unisolated_code: bool = False,
               configs: dict[str, dict] | None = None, probes: dict[str, dict] | None = None) -> tuple[dict, list[dict]]:
    """(summary per row, per-item records) of one lm_eval.simple_evaluate call over the given doc ids.

    `requests` is keyed by row: a domain (its probe task) or `<domain>:<task>`, whose lm-eval config
    (standard_tasks.task_config) is in `configs`; a domain's declared probes (task, metric, runs_code) are in
    `probes`.

    Code probes and sandboxed code tasks (humaneval, mbpp) run model-written code through the sandbox; where
    it cannot isolate and the user has not allowed unisolated runs, those rows are refused (recorded, never
    silently scored 0).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from pipelines.core import sandbox

    summary: dict = {}
    isolated = sandbox.isolation_available()
    configs, probes = configs or {}, probes or {}
    # rows that run model-written code: probes declared runs_code (code) and sandboxed standard tasks (humaneval, mbpp)
    running_code = [d for d in requests if (d in configs and standard_tasks.sandboxed(configs[d]))
                    or (d not in configs and probes[d]["runs_code"])]
    if running_code:
        if not isolated and not allow_unisolated_code:
            for d in running_code:
                summary[d] = {"task": configs[d]["task"] if d in configs else probes[d]["task"], "status": "refused",
                              "score": None, "stderr": None, "items": 0, "cause": ENVIRONMENT,
                              "reason": f"sandbox isolation unavailable here ({sandbox.isolation_level()[1] or 'no bwrap'})",
                              "remedy": "make the sandbox work here (`quantgate doctor` names what is missing; on "
                                        "Debian/Ubuntu as root: apt-get install bubblewrap) or set "
                                        "evaluate.allow_unisolated_code: true, then measure again: "
                                        "dvc repro --force --downstream baseline"}
            requests = {d: ids for d, ids in requests.items() if d not in running_code}
        os.environ["QUANTGATE_ALLOW_UNISOLATED_CODE"] = "1" if allow_unisolated_code else "0"
    tasks = {configs[d]["task"] if d in configs else probes[d]["task"]: d for d in requests}
    if not tasks:
        return summary, []
    with library_output("lm_eval"), library_call("lm-eval"):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = simple_evaluate(model=lm, tasks=[configs.get(d, t) for t, d in tasks.items()],
                              task_manager=TaskManager(include_path=str(EVAL_DIR),
                              include_defaults=False), log_samples=True,
                              samples={t: sorted(requests[d]) for t, d in tasks.items()}, random_seed=0,
                              numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                              confirm_run_unsafe_code=any(d in requests for d in running_code))
    items = []
    for task, domain in tasks.items():
        if domain in configs:
            _task_rows(domain, task, configs[domain], out, summary, items)
            if standard_tasks.sandboxed(configs[domain]):
                summary[domain]["isolation"] = sandbox.isolation_level()[0]
            continue
        metric = probes[domain]["metric"]
        res = out["results"][task]
        samples = out["samples"][task]
        summary[domain] = {"task": task, "status": "ok", "task_version": out.get("versions", {}).get(task), "metric": metric,
                           "score": _number(res.get(f"{metric},none")),
                           "stderr": _number(res.get(f"{metric}_stderr,none")), "items": len(samples)}
        for s in samples:
            items.append({"domain": domain, "task": task, "item_id": str(s["doc"]["id"]), "family": s["doc"].get("family"),
                          "doc_id": s["doc_id"], "doc_hash": s["doc_hash"], "prompt_hash": s["prompt_hash"],
                          "target": str(s["target"]), "response": str(s["filtered_resps"][0]), "correct": bool(s[metric]),
                          "chance": item_chance(out, task, s)})
        if probes[domain]["runs_code"]:
            summary[domain]["isolation"] = sandbox.isolation_level()[0]
    return summary, items


def item_chance(out: dict, task: str, sample: dict) -> float:
    """The chance that a guess scores this item: 1/choices for a multiple-choice task (lm-eval asks one loglikelihood
    per choice), 0 for generation; compare holds fp16's accuracy against it (no signal, no pass)."""
    if (out.get("configs", {}).get(task) or {}).get("output_type") == "multiple_choice" and sample.get("arguments"):
        return 1 / len(sample["arguments"])
    return 0.0


def _task_rows(key: str, task: str, cfg: dict, out: dict, summary: dict, items: list[dict]) -> None:
    """A standard task's summary and per-item records: the samples of its scoring filter, ids `<task>:<doc_id>`."""
    filt, metric = standard_tasks.scoring(cfg)
    res = out["results"][task]
    samples = [s for s in out["samples"][task] if s.get("filter") == filt]
    graded = [s[metric] for s in samples if s[metric] not in (0, 1)]  # True/False and 0.0/1.0 compare equal
    if graded:  # an f1 of 0.5 is neither right nor wrong: nothing to pair
        summary[key] = {"task": task, "status": "refused", "score": None, "stderr": None, "items": 0,
                        "reason": f"metric {metric!r} of task {task} is not 0/1 per item (e.g. {graded[0]!r}): only "
                                  "pass/fail metrics pair; choose one with requests.<name>.tasks[].metric"}
        return
    summary[key] = {"task": task, "status": "ok", "task_version": out.get("versions", {}).get(task), "metric": metric,
                    "filter": filt, "score": _number(res.get(f"{metric},{filt}")),
                    "stderr": _number(res.get(f"{metric}_stderr,{filt}")), "items": len(samples)}
    domain = key.split(standard_tasks.SEP)[0]
    for s in samples:
        items.append({"domain": domain, "task": task, "item_id": standard_tasks.item_id(task, s["doc_id"]),
                      "family": None, "doc_id": s["doc_id"], "filter": filt, "doc_hash": s["doc_hash"],
                      "prompt_hash": s["prompt_hash"], "target": str(s["target"]),
                      "response": str(s["filtered_resps"][0]), "correct": bool(s[metric]),
                      "chance": item_chance(out, task, s)})


def task_configs(plans: dict[str, dict]) -> dict[str, dict]:
    """lm-eval configs of the plans' standard-task rows (plans.probe_plans puts the task's settings in `spec`)."""
    from pipelines.core.params_requests import TaskParams

    return {key: standard_tasks.task_config(plan["domain"], TaskParams(**plan["spec"]))
            for key, plan in plans.items() if "spec" in plan}


def _merge(total: dict, block: dict) -> None:
    """Add one block's lm-eval summary to a domain's running summary (score: item-weighted mean of blocks)."""
    for domain, row in block.items():
        if row["status"] != "ok":
            total[domain] = row
            continue
        seen = total.setdefault(domain, {**row, "score": 0.0, "items": 0, "blocks": []})
        seen["blocks"].append({"items": row["items"], "score": row["score"], "stderr": row["stderr"]})
        n = seen["items"] + row["items"]
        seen["score"] = None if row["score"] is None or seen["score"] is None else \
            (seen["score"] * seen["items"] + row["score"] * row["items"]) / n
        seen["items"] = n
        seen["stderr"] = None  # a per-block lm-eval stderr does not add up; compare's interval is the paired one


def evaluate_looks(model, tokenizer, plans: dict[str, dict], batch_size: int, allow_unisolated_code: bool,
                   baseline: dict[str, dict[str, bool]] | None, policy_for, compare) -> tuple[dict, list[dict]]:
    """Probe items look by look, in each pool's evaluation order.

    The baseline (baseline=None) answers every look of every domain. A variant answers a domain's next look
    only while sequential.run_looks against the baseline's answers is still undecided: the same rule compare
    applies, so the records end exactly where the decision was made.
    """
    from pipelines.judging import sequential

    summary: dict = {}
    records: list[dict] = []
    done = {d: 0 for d in plans}
    active = [d for d in plans if plans[d]["looks"]]
    configs = task_configs(plans)
    probes = {d: plan["probe"] for d, plan in plans.items() if "probe" in plan}
    positions = {d: {standard_tasks.item_id(plans[d]["task"], n): n for n in range(plans[d]["pool"])} if d in configs
                 else {str(item.get("id")): n for n, item in enumerate(probe_items(d, plans[d]["probe"]))} for d in plans}
    for look in range(max((len(p["looks"]) for p in plans.values()), default=0)):
        requests = {d: [positions[d][i] for i in plans[d]["order"][done[d]: plans[d]["looks"][look]]]
                    for d in active if look < len(plans[d]["looks"])}
        if not requests:
            break
        block, items = run_probes(model, tokenizer, requests, batch_size, allow_unisolated_code, configs, probes)
        _merge(summary, block)
        records += items
        for d in list(requests):
            done[d] = plans[d]["looks"][look]
            if summary.get(d, {}).get("status") != "ok":
                active.remove(d)
                continue
            if baseline is None:
                continue
            mine = {r["item_id"]: r["correct"] for r in records if row_of(r) == d}
            run = sequential.run_looks(baseline.get(d, {}), mine, plans[d]["order"], plans[d]["looks"],
                                       plans[d]["families"], policy_for(plans[d].get("domain", d)).max_accuracy_drop,
                                       compare.alpha,
                                       compare.spending)
            if sequential.more_items(run) is None:
                active.remove(d)
    return summary, records


def full_text(template: str, item: dict) -> str:
    """A probe item as plain text, its prompt followed by its gold answer: the request type's `probes.text`
    Jinja template (e.g. `{{question}}{{answer}}`) rendered with the item's fields."""
    import jinja2

    env = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined, autoescape=False)
    return env.from_string(template).render(**item)


def _interleaved(families: list[str]) -> list[str]:
    """Families ordered `a-x, b-x, a-y, b-y`: spread by their kind (the part before the first `-`) first,
    so `add-1 ... add-9` (additions by tens digit) count as one kind beside `root`, `fraction`, ..."""
    groups: dict[str, list[str]] = {}
    for family in sorted(families):
        groups.setdefault(family.split("-")[0], []).append(family)
    order, queues = [], list(groups.values())
    while any(queues):
        order += [q.pop(0) for q in queues if q]
    return order


def fidelity_texts(domains: list[str], per_domain: int, probes: dict[str, dict]) -> dict[str, list[str]]:
    """Held-out text per domain: probe prompts with their gold answers, taken round-robin across the pool's
    families (item `family`, spread by kind first: math kinds, code and comment templates, chat intents),
    so KL sees every kind of item instead of the first N of one kind."""
    texts = {}
    for domain in domains:
        families: dict[str, list[dict]] = {}
        for item in probe_items(domain, probes[domain]):
            families.setdefault(str(item.get("family", "")), []).append(item)
        queues = [families[f] for f in _interleaved(list(families))]
        picked = []
        while len(picked) < per_domain and any(queues):
            for rows in queues:
                if rows and len(picked) < per_domain:
                    picked.append(rows.pop(0))
        texts[domain] = [full_text(probes[domain]["text"], r) for r in picked]
    return texts


def evaluate_variant(variant_dir: str, plans: dict[str, dict], p, device: str, fidelity_base: Path | None,
                     baseline: dict[str, dict[str, bool]] | None = None, compare=None,
                     max_memory: dict | None = None) -> tuple[dict, list[dict]]:
    """Probes (look by look) and fidelity for one model; a model that cannot load is recorded as failed.

    `p`: EvaluateParams. baseline=None means this model is the baseline: it answers every look and its
    next-token distributions are written to `fidelity_base`; a variant stops where its decision is made
    (`compare`: CompareParams, the rule's margin and alpha) and is compared against `fidelity_base`.
    `max_memory`: `gpus.max_memory` parsed, for fp16 and int8 loading across GPUs (pipelines/models/loading.py).
    """
    result: dict = {"variant": Path(variant_dir).name, "device": device, "batch_size": p.batch_size}
    domains = [d for d in plans if not standard_tasks.is_task_row(d)]
    fidelity_domains = list(dict.fromkeys(plan.get("domain", d) for d, plan in plans.items()))  # a task row's is its domain's
    if p.threads:  # evaluate.threads (the stage runs this in its own process)
        import torch

        torch.set_num_threads(p.threads)
    try:
        check_items({d: plans[d]["probe"] for d in domains})
        model, tokenizer = load_variant(variant_dir, device, max_memory)
        forward = (variant_manifest(variant_dir).get("settings") or {}).get("forward")
        if forward:  # which forward ran (compressed-tensors: load_variant checked the loaded model runs it)
            result["forward"] = forward
        if tokenizer.pad_token is None:  # HFLM batches need one; say so rather than fail deep inside
            tokenizer.pad_token = tokenizer.eos_token
            result["note"] = "tokenizer had no pad token; eos is used for padding"
        summary, items = evaluate_looks(model, tokenizer, plans, p.batch_size, p.allow_unisolated_code, baseline,
                                        compare.policy_for if compare else None, compare)
        result["probes"] = summary
        if baseline is None:  # fp16 scores itself from the forward pass that makes the base file: no second one
            texts = fidelity_texts(fidelity_domains, p.fidelity_texts, p.model_dump()["probes"])
            own: dict[str, list[dict]] = {}
            fidelity.save_base(fidelity.base_record(model, tokenizer, texts, p.top_k, device, own), fidelity_base)
            result["fidelity"] = fidelity.report({d: own.get(d, []) for d in fidelity_domains},
                                                 fidelity.load_base(fidelity_base))
        elif fidelity_base is None:  # fp16's baseline is a sample log (baseline_log.py): no distributions to compare
            from pipelines.evaluation.baseline_log import NO_DISTRIBUTIONS

            result["fidelity"], result["not_measured"] = None, {"fidelity": NO_DISTRIBUTIONS}
        else:
            result["fidelity"] = fidelity.compare(model, fidelity.load_base(fidelity_base), fidelity_domains, device)
        result["status"] = "ok"
        return result, items
    except Exception as err:  # noqa: BLE001 - one variant's failure is that variant's result
        logging.getLogger().error("evaluate %s failed", variant_dir, exc_info=True)
        result.update({"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000], **(environment_cause(err) or {})})
        return result, []
