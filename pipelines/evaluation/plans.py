"""What to evaluate: each request type's probe pool, its looks and order, and which row a record belongs to.

baseline, evaluate, compare and the gate all read the same plan (probe_plans), so every stage agrees on
the pools, the look sizes and the order in which items are asked.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_jsonl
from pipelines.core.params_sections import EvaluateParams
from pipelines.core.paths import EVAL_DIR
from pipelines.evaluation import standard_tasks
from pipelines.judging import sequential

PROBE_TASK_PREFIX = "quantgate_"  # probe tasks are named so; standard lm-eval tasks never are (params.py checks)
PLACEHOLDERS = (999, "N/A")


def pool_path(domain: str, probe: dict | None = None, eval_dir: Path | None = None) -> Path:
    """A request type's probe pool: eval/<domain>/<probes.items> (items.jsonl by default)."""
    return (eval_dir or EVAL_DIR) / domain / ((probe or {}).get("items") or "items.jsonl")


def task_yaml(path: Path) -> dict:
    """An lm-eval task YAML's plain keys; `!function module.name` tags are read as None (not imported here)."""
    import yaml

    class TaskLoader(yaml.SafeLoader):
        pass

    TaskLoader.add_multi_constructor("!", lambda _loader, _suffix, _node: None)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=TaskLoader) or {}


def check_task_reads_pool(domain: str, probe: dict) -> None:
    """The task YAML's `dataset_kwargs.data_files.test` is the pool the plan orders: lm-eval's doc ids are positions
    in the file it reads, so another file would pair every answer with the wrong item. The YAML is found by its
    `task:` key among every YAML under eval/, as lm-eval (given all of eval/) finds it; a task that reads no declared
    file here, or that two YAMLs declare, is refused, not assumed right."""
    folder = EVAL_DIR / domain
    found = [(f, task_yaml(f)) for f in sorted(EVAL_DIR.glob("**/*.yaml"))] if EVAL_DIR.is_dir() else []
    found = [(f, c) for f, c in found if isinstance(c, dict) and c.get("task") == probe["task"]]
    if not found:
        raise QuantgateError(f"{folder}/: no task YAML has `task: {probe['task']}` (requests.{domain}.probes.task)")
    if len(found) > 1:  # lm-eval keeps one of them and skips the rest: never guess which file answered
        raise QuantgateError(f"{', '.join(str(f) for f, _ in found)} all declare `task: {probe['task']}`: "
                             "one task, one YAML")
    task_file, config = found[0]
    files = (config.get("dataset_kwargs") or {}).get("data_files") if isinstance(config.get("dataset_kwargs"), dict) \
        else None
    split = config.get("test_split") or "test"  # lm-eval reads data_files[test_split]
    reads = files.get(split) if isinstance(files, dict) else files
    reads = reads[0] if isinstance(reads, list) and len(reads) == 1 else reads
    pool = pool_path(domain, probe)
    # lm-eval resolves a relative data file against the working directory, the repository root
    if not isinstance(reads, str) or Path(reads).resolve() != pool.resolve():
        raise QuantgateError(f"{task_file}: dataset_kwargs.data_files.{split} is {reads!r}, but requests.{domain}.probes "
                             f"names the pool {pool.name} (eval/{domain}/{pool.name}): make them the same file")


def check_items(probes: dict[str, dict]) -> None:
    """Every probe file exists, its task reads it, and every item has the fields its request type declares; errors
    name file, line and field. `probes`: request type -> its declared probes (params.ProbeParams as a dict)."""
    for domain, probe in probes.items():
        path = pool_path(domain, probe)
        for number, item in enumerate(read_jsonl(path), start=1):
            missing = [f for f in probe["fields"] if item.get(f) in (None, "")]
            if missing:
                raise QuantgateError(f"{path}:{number}: item {item.get('id', '?')} has no {', '.join(missing)}")
        check_task_reads_pool(domain, probe)


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


def probe_items(domain: str, probe: dict | None = None) -> list[dict]:
    """A domain's probe pool, in file order (lm-eval's doc ids are positions in this file)."""
    return read_jsonl(pool_path(domain, probe))


def probe_plans(domains: list[str], p: EvaluateParams, eval_dir: Path = EVAL_DIR) -> dict[str, dict]:
    """Per row: the pool size, the look sizes, the pool's evaluation order and each item's family.

    Rows are the domains, then each domain's standard tasks (`<domain>:<task>`, items `<task>:<doc_id>`, each
    its own family; the plan also keeps the row's domain, task and settings).
    """
    plans = {}
    for domain in domains:
        path = pool_path(domain, p.probes[domain].model_dump(), eval_dir)
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


def lm_eval_samples(plans: dict[str, dict], eval_dir: Path) -> dict[str, list[int]]:
    """lm-eval's `--samples`: per task, the positions in its pool of every item the look plan can ask (the whole pool
    is never needed), so a log written with it pairs with fp16's records item for item."""
    out = {}
    for row, plan in plans.items():
        asked = plan["order"][: plan["looks"][-1]] if plan["looks"] else []
        if "spec" in plan:  # a standard task: its items are `<task>:<doc_id>`
            out[plan["task"]] = sorted(int(i.rsplit(standard_tasks.SEP, 1)[1]) for i in asked)
            continue
        lines = pool_path(row, plan["probe"], eval_dir).read_text("utf-8").splitlines()
        pool = [str(json.loads(line)["id"]) for line in lines if line.strip()]
        out[plan["probe"]["task"]] = sorted(pool.index(i) for i in asked)
    return out
