"""What to evaluate: each request type's probe pool, its looks and order, and which row a record belongs to.

baseline, evaluate, compare and the gate all read the same plan (probe_plans), so every stage agrees on
the pools, the look sizes and the order in which items are asked.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_jsonl
from pipelines.core.params_sections import EvaluateParams
from pipelines.core.paths import EVAL_DIR
from pipelines.evaluation import standard_tasks
from pipelines.judging import sequential

PROBE_TASK_PREFIX = "quantgate_"  # probe tasks are named so; standard lm-eval tasks never are (params.py checks)
PLACEHOLDERS = (999, "N/A")


def check_items(probes: dict[str, dict]) -> None:
    """Every probe file exists and every item has the fields its request type declares; errors name file, line
    and field. `probes`: request type -> its declared probes (params.ProbeParams as a dict)."""
    for domain, probe in probes.items():
        path = EVAL_DIR / domain / "items.jsonl"
        for number, item in enumerate(read_jsonl(path), start=1):
            missing = [f for f in probe["fields"] if item.get(f) in (None, "")]
            if missing:
                raise QuantgateError(f"{path}:{number}: item {item.get('id', '?')} has no {', '.join(missing)}")


def row_of(record: dict) -> str:
    """The row a per-item record is judged in: its domain for the domain's probe task, else `<domain>:<task>`."""
    domain, task = record.get("domain"), record.get("task")
    if task is None or str(task).startswith(PROBE_TASK_PREFIX):
        return domain
    return standard_tasks.row_key(domain, task)


def by_id(items: list[dict], domain: str) -> dict[str, dict]:
    """One row's per-item records keyed by their stable item id: a domain's probe items, or `<domain>:<task>`'s."""
    return {str(row.get("item_id")): row for row in items if row_of(row) == domain}


def correctness(rows: dict[str, dict]) -> dict[str, bool]:
    """Each item's true/false; anything but True counts as wrong."""
    return {i: row.get("correct") is True for i, row in rows.items()}


def probe_items(domain: str) -> list[dict]:
    """A domain's probe pool, in file order (lm-eval's doc ids are positions in this file)."""
    return read_jsonl(EVAL_DIR / domain / "items.jsonl")


def probe_plans(domains: list[str], p: EvaluateParams, eval_dir: Path = EVAL_DIR) -> dict[str, dict]:
    """Per row: the pool size, the look sizes, the pool's evaluation order and each item's family.

    Rows are the domains, then each domain's standard tasks (`<domain>:<task>`, items `<task>:<doc_id>`, each
    its own family; the plan also keeps the row's domain, task and settings).
    """
    plans = {}
    for domain in domains:
        path = eval_dir / domain / "items.jsonl"
        items = read_jsonl(path) if path.is_file() else []
        ids = [str(item.get("id")) for item in items]
        seen: dict[str, int] = {}
        for line, item_id in enumerate(ids, start=1):
            if item_id in seen:  # lm-eval would score one of them twice and the looks would count it twice
                raise QuantgateError(f"{path}:{line}: duplicate item id {item_id!r} (first on line {seen[item_id]})")
            seen[item_id] = line
        plans[domain] = {"pool": len(ids), "looks": sequential.plan(len(ids), p.look_items, p.max_items, p.max_looks),
                         "order": sequential.ordered(ids, domain), "probe": p.probes[domain].model_dump(),
                         # an item without a family (missing or null) is a family of its own
                         "families": {str(item.get("id")): f"item:{item.get('id')}" if item.get("family") is None
                                      else str(item["family"]) for item in items}}
    for domain in domains:
        for spec in p.tasks.get(domain, []):
            key = standard_tasks.row_key(domain, spec.name)
            ids = [standard_tasks.item_id(spec.name, n) for n in range(standard_tasks.doc_count(domain, spec, str(eval_dir)))]
            plans[key] = {"pool": len(ids), "looks": sequential.plan(len(ids), p.look_items, p.max_items, p.max_looks),
                          "order": sequential.ordered(ids, key), "families": {i: f"item:{i}" for i in ids},
                          "domain": domain, "task": spec.name, "spec": spec.model_dump()}
    return plans


def plan_summary(plans: dict[str, dict]) -> dict[str, dict]:
    """What compare.json keeps of a plan: pool size and look sizes (the order is recomputed from the items)."""
    return {d: {"pool": plan["pool"], "looks": plan["looks"]} for d, plan in plans.items()}
