"""The temporary repository copy, dvc runner and added `sql` request type of the end-to-end pipeline run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT


def repo_copy(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files, as a clean clone would have them."""
    from pipelines.core.lineage import checkout_files

    for name in checkout_files(ROOT):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def dvc(args, cwd):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the copy records into its own store
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)


# a statement keyword and a line that ends a statement: "can you update me on where ..." stays chat
SQL_RULE = {"patterns": {"statement": r"(?i)\b(select|insert\s+into|update|delete\s+from)\b",
                         "terminator": r"(?m);\s*(--.*)?$"},
            "when": "statement >= 1 and terminator >= 1", "priority": 25}


def add_sql_request_type(repo: Path, params: dict) -> None:
    """A fifth request type, added the way a team would (docs/request-types.md): probe items and their lm-eval
    task in eval/sql/, calibration text, labelled production requests, and its declaration in params.yaml.
    No code changes. The probes end in an addition the reference model can answer, so the type can pass."""
    import random

    rng = random.Random(7)
    (repo / "eval" / "sql").mkdir()
    items = []
    for n in range(40):  # no `family`: each item is its own (four tens-digit families would leave t with 3 df)
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        items.append({"id": f"sql-{n:03d}", "prompt": f"SELECT {a}+{b} AS total; -- total: {a}+{b}=",
                      "answer": str(a + b)})
    (repo / "eval" / "sql" / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    task = yaml.safe_load((repo / "eval" / "code_comment" / "quantgate_code_comment.yaml").read_text())
    task.update(task="quantgate_sql", dataset_kwargs={"data_files": {"test": "eval/sql/items.jsonl"}})
    (repo / "eval" / "sql" / "quantgate_sql.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    tables, columns = ["orders", "users", "invoices", "shipments", "refunds", "carts"], ["id", "total", "email", "city",
                                                                                        "status", "created_at"]
    texts = []
    for n in range(60):
        t, c1, c2 = rng.choice(tables), rng.choice(columns), rng.choice(columns)
        texts.append(rng.choice([
            f"SELECT {c1}, {c2} FROM {t} WHERE {c1} > {rng.randint(1, 999)} ORDER BY {c2} DESC LIMIT {rng.randint(2, 90)};",
            f"UPDATE {t} SET {c1} = '{rng.choice(['open', 'paid', 'lost'])}{n}' WHERE {c2} = {rng.randint(1, 9999)};",
            f"INSERT INTO {t} ({c1}, {c2}) VALUES ({rng.randint(1, 999)}, 'row {n} of {rng.randint(1, 99)}');",
            f"DELETE FROM {t} WHERE {c1} < {rng.randint(1, 500)} AND {c2} IS NULL; -- cleanup {n}"]))
    source = repo / "calibration_sets" / "sources" / "sql" / "queries.jsonl"
    source.parent.mkdir(parents=True)
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    traffic = repo / "calibration_sets" / "traffic" / "production_sample.jsonl"
    extra = [{"id": f"req-sql-{n:02d}", "text": f"why is this slow?\n{t}", "label": "sql"} for n, t in enumerate(texts[:20])]
    traffic.write_text(traffic.read_text() + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in extra))
    params["requests"]["sql"] = {
        "classify": SQL_RULE,
        "calibration": [{"kind": "jsonl", "path": "calibration_sets/sources/sql/queries.jsonl", "text_field": "text"}],
        "probes": {"task": "quantgate_sql", "metric": "exact_match", "fields": ["id", "prompt", "answer"],
                   "text": "{{prompt}}{{answer}}"},
        "policy": {"max_accuracy_drop": 0.3}}
    params["calibration"]["weights"]["sql"] = 0.5  # a small share of traffic; chat (43 %) keeps enough samples


def shadow_sample(repo: Path, params: dict) -> None:
    """The shadow replay (a whole stage's slowest part: every request through fp16 and each routed variant, one
    process and one model load each) on the first few requests of each type of its log, still enough for route to
    listen to a type's agreement (shadow.min_requests). Written at the repository's root, not in calibrate's traffic
    folder (calibrate reads every file there)."""
    from collections import Counter

    per_type, taken, kept = params["shadow"]["min_requests"] + 4, Counter(), []
    for line in (repo / params["shadow"]["traffic"]).read_text().splitlines():
        taken[label := json.loads(line)[params["shadow"]["label_field"]]] += 1
        if taken[label] <= per_type:
            kept.append(line)
    (repo / "shadow_sample.jsonl").write_text("\n".join(kept) + "\n")
    params["shadow"]["traffic"] = "shadow_sample.jsonl"
