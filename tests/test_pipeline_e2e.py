"""End to end: `dvc repro` in a temporary copy of the repository, on a small reference model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.core import sandbox
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def repo_copy(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files, as a clean clone would have them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
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


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    repo = repo_copy(tmp_path_factory.mktemp("repo"))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    add_sql_request_type(repo, params)
    # the shipped reference model (copied, not trained): a model that answers the probes, so the verdicts
    # judge something (a model that scores 0 everywhere cannot pass) and the loop runs to promotion
    params["calibration"].update(samples=64, max_tokens=96)
    params["evaluate"].update(look_items=20, max_items=40, fidelity_texts=16)
    # 40 items cannot show a 5-point margin: 0 flips of 40 in ~12 families still leave an interval of about
    # +-0.2 (t with 11 df). A 0.25 margin lets the nearly lossless int8 pass, so registration and promotion
    # run end to end; 16 fidelity texts give KL the 100 tokens it needs
    params["compare"]["policy"]["default"]["max_accuracy_drop"] = 0.25
    # int8 (bitsandbytes on a CPU) grows ~2 KB a round for up to ~20 rounds before it settles on this tiny model,
    # longer on a loaded machine: 24 rounds let it settle instead of projecting warm-up as a leak
    params["memory"].update(seq_fractions=[0.5, 1.0], warmup_rounds=1, rounds=10, max_rounds=24, tail_rounds=6,
                            alternations=2, burst_size=2)
    broken = repo / "third_party" / "vendor-gptq"  # a candidate that must be rejected, not crash the pipeline
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (broken / "pytorch_model.bin").write_bytes(b"\x80\x04")
    params["candidates"] = {"vendor-gptq": {"path": "third_party/vendor-gptq"}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    first = dvc(["repro"], repo)
    assert first.returncode == 0, first.stdout + first.stderr
    second = dvc(["repro"], repo)
    return repo, first, second


def test_reference_stage_outputs(pipeline_run):
    repo, first, _ = pipeline_run
    report = json.loads((repo / "results" / "reference.json").read_text())
    assert report["status"] == "built" and report["source"] == "shipped"
    # the shipped model sums 0.887 of the 1,000 held-out two-digit additions (docs/reference-model.md); chance is ~0
    assert report["addition_items"] == 1000 and report["addition_exact_match"] > 0.85
    assert (repo / "models" / "reference" / "model.safetensors").is_file()
    assert (repo / "models" / "reference" / "tokenizer.json").is_file()
    assert "Running stage 'reference'" in first.stdout


def test_calibrate_stage_outputs(pipeline_run):
    repo, first, _ = pipeline_run
    manifest = json.loads((repo / "calibration_sets" / "built" / "manifest.json").read_text())
    assert {d: v["count"] for d, v in manifest["domains"].items()} == {
        "chat": 15, "code": 14, "code_comment": 14, "math": 14, "sql": 7}
    mixed = (repo / "calibration_sets" / "built" / "mixed.jsonl").read_text().splitlines()
    assert len(mixed) == 64
    coverage = json.loads((repo / "results" / "calibration" / "coverage.json").read_text())
    assert coverage["covered"] and coverage["calibration_sha256"] == manifest["mixed_sha256"]
    # the fifth request type, added by configuration only: the classifier finds its 20 production requests
    assert coverage["domains"]["sql"]["production_requests"] == 20
    assert coverage["domains"]["sql"]["calibration_samples"] == 7
    assert coverage["classifier"]["types"]["sql"] == {"requests": 20, "correct": 20, "accuracy": 1.0,
                                                      "below_threshold": False, "unknown": 0, "ambiguous": 0}
    assert "calibrate: code_comment production" in first.stderr + first.stdout


def test_every_default_variant_is_built_and_the_bad_candidate_recorded(pipeline_run):
    repo, first, _ = pipeline_run
    calib = json.loads((repo / "calibration_sets" / "built" / "manifest.json").read_text())["mixed_sha256"]
    for variant in ("fp16", "int8", "awq4", "gptq3"):
        manifest = json.loads((repo / "models" / "variants" / variant / "quantgate.json").read_text())
        assert manifest["status"] == "ok", manifest.get("error")
        assert (manifest.get("calibration") or {}).get("sha256") == (calib if variant in ("awq4", "gptq3") else None)
        assert json.loads((repo / "results" / "quantize" / f"{variant}.json").read_text())["quantize_seconds"] > 0
        assert (repo / "models" / "variants" / variant / "model.safetensors").is_file()
    rejected = json.loads((repo / "models" / "variants" / "vendor-gptq" / "quantgate.json").read_text())
    assert rejected["status"] == "failed"
    assert "pytorch_model.bin: pickle-based file refused" in rejected["error"]
    assert "admit vendor-gptq: REJECTED" in first.stderr + first.stdout


def test_memory_stage_per_variant_and_summary(pipeline_run):
    repo, _, _ = pipeline_run
    summary = json.loads((repo / "results" / "memory_summary.json").read_text())
    rows = summary["variants"]
    assert summary["baseline_ok"] and rows["fp16"]["growth_excess_pct"] == 0
    for variant in ("int8", "awq4", "gptq3"):
        assert rows[variant]["status"] == "ok" and rows[variant]["footprint_bytes"] < rows["fp16"]["footprint_bytes"]
        assert rows[variant]["leak"] is False and rows[variant]["oom"] is None
    assert rows["vendor-gptq"]["status"] == "failed" and "not usable" in rows["vendor-gptq"]["error"]
    assert (repo / "results" / "plots" / "memory_over_rounds.png").is_file()


def test_evaluate_stage_per_variant(pipeline_run):
    repo, _, _ = pipeline_run
    ids = {}
    for variant in ("fp16", "int8", "awq4", "gptq3"):
        result = json.loads((repo / "results" / "eval" / f"{variant}.json").read_text())
        assert result["status"] == "ok", result.get("error")
        counts = {d: r["items"] for d, r in result["probes"].items()}
        if variant == "fp16":  # the baseline answers every look: 40 items, in looks of 20, 30 and 40
            assert counts == {"math": 40, "code": 40 if sandbox.isolation_available() else 0, "chat": 40,
                              "code_comment": 40, "sql": 40}
        else:  # a variant stops at the look that decided: 20, 30 or 40
            assert all(n in (20, 30, 40) for d, n in counts.items() if d != "code" or sandbox.isolation_available())
        items = [json.loads(line) for line in (repo / "results" / "eval" / variant / "items.jsonl").read_text().splitlines()]
        ids[variant] = {(i["task"], i["item_id"]): i["prompt_hash"] for i in items}
    for variant in ("int8", "awq4", "gptq3"):  # pairable by id, same prompts
        assert all(ids["fp16"][key] == prompt for key, prompt in ids[variant].items())
    fp16 = json.loads((repo / "results" / "eval" / "fp16.json").read_text())
    assert all(f["kl"]["max"] < 1e-4 and f["same_top1"] == 1.0 for f in fp16["fidelity"].values())
    rejected = json.loads((repo / "results" / "eval" / "vendor-gptq.json").read_text())
    assert rejected["status"] == "failed" and "not usable" in rejected["error"]


def test_compare_and_route_stages(pipeline_run):
    from pipelines.core import lineage

    repo, first, _ = pipeline_run
    report = json.loads((repo / "results" / "compare.json").read_text())
    pools = {d: len((repo / "eval" / d / "items.jsonl").read_text().splitlines()) for d in report["domains"]}
    assert report["plans"] == {**{d: {"pool": pools[d], "looks": [20, 30, 40]} for d in ("math", "code", "chat", "code_comment")},
                               "sql": {"pool": 40, "looks": [20, 30, 40]}}
    assert report["domains"] == ["math", "code", "chat", "code_comment", "sql"]  # declaration order
    assert set(report["variants"]) == {"int8", "awq4", "gptq3", "vendor-gptq"}
    for name, v in report["variants"].items():
        assert v["verdict"] in ("pass", "inconclusive", "fail")
        for domain, d in v["domains"].items():
            assert d["verdict"] != "pass" or d["paired"]["items"] == d["looks"]["looks"][d["looks"]["look"] - 1]
            assert d["verdict"] != "inconclusive" or d["looks"]["look"] == 3  # only after the last look
    rejected = report["variants"]["vendor-gptq"]
    assert rejected["kind"] == "candidate" and rejected["verdict"] == "fail"
    assert rejected["domains"]["math"]["reasons"][0].startswith("quantize/admit failed")
    table = json.loads((repo / "results" / "routing_table.json").read_text())
    assert len(table["rows"]) == (5 + 2) * 3  # (request types + unknown + ambiguous) x default context buckets
    assert set(table["classifier"]) == {"math", "code", "chat", "code_comment", "sql"}
    undecided = [r for r in table["rows"] if r["domain"] in ("unknown", "ambiguous")]
    assert len(undecided) == 6 and all(r["serve"] == "fp16" and "served by the baseline" in r["reason"] for r in undecided)
    for row in [r for r in table["rows"] if r not in undecided]:  # fp16 is never worse than what is routed
        assert row["cost_bytes"]["serve"] <= row["cost_bytes"]["fp16"]
        assert row["serve"] == "fp16" or report["variants"][row["serve"]]["domains"][row["domain"]]["verdict"] == "pass"
    assert table["dvc_lock_sha256"] == lineage.lock_digest(repo / "dvc.lock")  # DVC wrote the upstream stages first
    assert report["dvc_lock_stages"] == lineage.stage_digests(repo / "dvc.lock")
    assert {"reference", "calibrate", "evaluate@fp16"} <= set(report["dvc_lock_stages"]) and "compare" not in report["dvc_lock_stages"]
    assert (repo / "results" / "routing_table.yaml").is_file()
    assert all((repo / "results" / "plots" / f"{p}.png").is_file() for p in ("pareto", "flips", "kl_percentiles"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    looked_up = subprocess.run(["quantgate", "route", "lookup", "What is 12 + 30?", "--context-tokens", "50"], cwd=repo,
                               env=env, capture_output=True, text=True)
    assert looked_up.returncode == 0, looked_up.stderr
    math_row = next(r for r in table["rows"] if r["domain"] == "math" and r["max_context_tokens"] == 64)
    assert looked_up.stdout == math_row["serve"] + "\n"
    sql_text = "SELECT email FROM users WHERE id = 42;"
    looked_up = subprocess.run(["quantgate", "route", "lookup", sql_text, "--context-tokens", "50"], cwd=repo,
                               env=env, capture_output=True, text=True)
    sql_row = next(r for r in table["rows"] if r["domain"] == "sql" and r["max_context_tokens"] == 64)
    assert looked_up.returncode == 0 and looked_up.stdout == sql_row["serve"] + "\n", looked_up.stderr
    assert "sql request" in looked_up.stderr + looked_up.stdout
    # every request of the shipped production sample is served by what the table says for its domain:
    # the cheapest variant that passed it (and saves enough), fp16 where none did
    from pipelines.routing.router import Router

    router = Router.from_file(repo / "results" / "routing_table.json")
    footprint = {n: (v.get("memory") or {}).get("footprint_bytes") for n, v in report["variants"].items()}
    for line in (repo / "calibration_sets" / "traffic" / "production_sample.jsonl").read_text().splitlines():
        row = router.route(json.loads(line)["text"], 40)
        assert row["domain"] == json.loads(line)["label"] or row["domain"] in ("unknown", "ambiguous") \
            or json.loads(line)["label"] != "sql"  # the 20 sql requests are recognised
        if row["domain"] in ("unknown", "ambiguous"):
            assert row["serve"] == "fp16"
            continue
        passing = [n for n, v in report["variants"].items() if v["domains"][row["domain"]]["verdict"] == "pass"]
        assert row["serve"] in passing + ["fp16"]
        if row["serve"] == "fp16":
            assert not passing or row["reason"].startswith("passing variants save less than")
        else:
            assert footprint[row["serve"]] == min(footprint[n] for n in passing)


def test_record_stage_and_gate(pipeline_run):
    from mlflow import MlflowClient

    from pipelines.core import lineage

    repo, _, _ = pipeline_run
    run = json.loads((repo / "results" / "mlflow_run.json").read_text())
    assert run["status"] == "recorded" and run["tracking_uri"] == f"sqlite:///{repo / 'mlflow.db'}"
    client = MlflowClient(run["tracking_uri"])
    runs = client.search_runs([run["experiment_id"]])
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == run["parent_run_id"]]
    children = {r.data.tags["quantgate.variant"] for r in kids}
    assert children == {"fp16", "int8", "awq4", "gptq3", "vendor-gptq"} and len(runs) == 6
    assert next(r for r in kids if r.data.tags["quantgate.variant"] == "vendor-gptq").info.run_name.startswith(
        "vendor-gptq · fail: ")  # the runs table shows each child's verdicts in its name
    int8 = next(r for r in runs if r.data.tags.get("quantgate.variant") == "int8")
    assert "sql/accuracy" in int8.data.metrics, sorted(int8.data.metrics)  # the fifth request type too
    parent = client.get_run(run["parent_run_id"])
    assert parent.data.metrics["classifier_accuracy.sql"] == 1.0
    assert (repo / "mlartifacts").is_dir() and not (repo / "mlruns").exists()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    gated = subprocess.run(["quantgate", "gate"], cwd=repo, env=env, capture_output=True, text=True)
    assert gated.returncode == 1, gated.stdout + gated.stderr  # the rejected vendor-gptq candidate fails the release
    result = json.loads((repo / "results" / "gate.json").read_text())
    assert result["verdict"] == "fail" and result["mlflow_run_id"] == run["parent_run_id"]
    assert any(r.startswith("vendor-gptq math: quantize/admit failed") for r in result["reasons"])
    assert (repo / "results" / "report.md").read_text().startswith("## quantgate release gate: FAIL")
    assert run["results_digest"] == lineage.results_digest(repo / "dvc.lock")
    # the whole loop: int8 (nearly lossless) passed every domain and was registered; the candidate, the
    # cheapest variant that passed, is gated and promoted to production
    registered = [r["variant"] for r in run["registered"]]
    assert "int8" in registered
    candidate = registered[-1]
    promoted = subprocess.run(["quantgate", "gate", "--variant", candidate, "--promote"], cwd=repo, env=env,
                              capture_output=True, text=True)
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    version = client.get_model_version_by_alias("quantgate-reference", "production")
    assert version.tags["variant"] == candidate and version.tags["quantgate.results_digest"] == run["results_digest"]


def test_the_gate_refuses_a_workspace_that_changed_after_the_run(pipeline_run):
    repo, _, _ = pipeline_run
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    weights = repo / "models" / "variants" / "int8" / "model.safetensors"
    saved = weights.read_bytes()
    try:
        weights.write_bytes(saved[:-8] + bytes(b ^ 0xFF for b in saved[-8:]))  # the checkpoint changed after dvc repro
        gated = subprocess.run(["quantgate", "gate", "--variant", "int8"], cwd=repo, env=env, capture_output=True, text=True)
        assert gated.returncode == 2 and "quantize@int8: changed outs" in gated.stdout, gated.stdout
    finally:
        weights.write_bytes(saved)
    status = dvc(["status"], repo)
    assert "up to date" in status.stdout, status.stdout


def test_second_repro_does_nothing_and_says_so(pipeline_run):
    _, _, second = pipeline_run
    assert second.returncode == 0
    assert "Running stage" not in second.stdout
    assert "Data and pipelines are up to date." in second.stdout


def test_dvc_metrics_are_the_small_summary(pipeline_run):
    """DVC's metrics are results/summary.json alone (what `dvc exp show` and `dvc metrics diff` print), and it
    says what compare.json says: each row's verdict and numbers, the gate's verdict."""
    repo, _, _ = pipeline_run
    shown = dvc(["metrics", "show", "--json"], repo)
    assert shown.returncode == 0, shown.stderr
    files = json.loads(shown.stdout)[""]["data"]
    assert list(files) == ["results/summary.json"]
    assert files["results/summary.json"]["data"]["verdict"] == json.loads((repo / "results/summary.json").read_text())["verdict"]
    summary = json.loads((repo / "results/summary.json").read_text())  # DVC's view drops the nulls of a failed row
    report = json.loads((repo / "results/compare.json").read_text())
    assert summary["verdict"] == {n: {d: r["verdict"] for d, r in v["domains"].items() if d in report["domains"]}
                                  for n, v in report["variants"].items()}
    row = report["variants"]["int8"]["domains"]["math"]["paired"]
    assert summary["difference"]["int8"]["math"] == round(row["difference"], 3)
    assert summary["items"]["int8"]["math"] == row["items"]
    verdicts = {r["verdict"] for v in report["variants"].values() for r in v["domains"].values()}
    assert summary["gate"] == ("fail" if "fail" in verdicts else "undecided" if "inconclusive" in verdicts else "pass")
    leaves = sum(len(per) for key in ("verdict", "difference", "ci_low", "items") for per in summary[key].values())
    assert leaves == 4 * len(report["variants"]) * len(report["domains"])  # nothing else grew into it


def readme_ci_steps() -> list[dict]:
    """The steps of the GitHub Actions job README.md prints ("Experiments"), read from the README as text."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"```yaml\n(# \.github/workflows/[^\n]*\n.*?)```", text, re.S)
    assert found, "README.md has no ```yaml block starting with '# .github/workflows/...'"
    (job,) = yaml.safe_load(found.group(1))["jobs"].values()
    return job["steps"]


def test_the_readme_ci_example_runs_as_printed(pipeline_run, tmp_path):
    """The README's CI job, step by step as GitHub Actions runs it (bash -eo pipefail per `run:`, `$GITHUB_PATH`
    prepended to PATH for the later steps, `if: always()` after a failure), in the finished copy, with the secret
    MLFLOW_TRACKING_URI set to the copy's SQLite store and PATH as a runner has it: without the virtual environment."""
    import hashlib
    import re

    repo, _, _ = pipeline_run
    steps = readme_ci_steps()
    assert steps[0].get("uses", "").startswith("actions/checkout@")  # the copy is the checkout
    venv = Path(sys.executable).parent.parent
    # `bash scripts/setup.sh` must not install a second environment (minutes, and the network): the copy's .venv
    # points at the one running this test, whose stamp says it was installed from these pyproject.toml and
    # constraints.txt, so setup.sh finds nothing to do (scripts/test.sh runs setup.sh before the tests).
    want = hashlib.sha256((repo / "pyproject.toml").read_bytes() + (repo / "constraints.txt").read_bytes()).hexdigest()
    have = (venv / ".quantgate-installed").read_text().strip() if (venv / ".quantgate-installed").is_file() else None
    if have != want[:16]:
        pytest.fail(f"{venv} was not installed from this pyproject.toml/constraints.txt (stamp {have}); run "
                    "`bash scripts/setup.sh` first: this test must not install into it")
    (repo / ".venv").symlink_to(venv, target_is_directory=True)
    # a finished copy has nothing left to run; without its record output `dvc repro` runs the record stage's
    # `quantgate record` (which finds this run already in MLflow and writes nothing), so the step shows whether
    # the stages' commands are found
    (repo / "results" / "mlflow_run.json").unlink()
    bin_dir = str(venv / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != Path(bin_dir).resolve())
    assert shutil.which("quantgate", path=path) is None  # a runner's PATH: quantgate only where setup put it
    github_path, summary = tmp_path / "github_path", tmp_path / "step_summary.md"
    github_path.touch()
    secrets = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}"}
    base = {"PATH": path, "HOME": os.environ.get("HOME", str(tmp_path)), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(repo),
            "GITHUB_PATH": str(github_path), "GITHUB_STEP_SUMMARY": str(summary)}
    results, failed = [], False
    try:
        for step in steps[1:]:
            if failed and step.get("if") != "always()":
                results.append((step["run"], None, "skipped"))
                continue
            added = [line for line in github_path.read_text().splitlines() if line.strip()]
            env = {**base, "PATH": os.pathsep.join([*reversed(added), path])}
            for key, value in (step.get("env") or {}).items():
                env[key] = re.sub(r"\$\{\{\s*secrets\.(\w+)\s*\}\}", lambda m: secrets[m.group(1)], str(value))
            done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=repo,
                                  env=env, capture_output=True, text=True, timeout=1800)
            results.append((step["run"], done.returncode, done.stdout + done.stderr))
            failed = failed or done.returncode != 0
    finally:
        (repo / ".venv").unlink()
    log = "\n".join(f"$ {run}\n(exit {rc})\n{out[-3000:]}" for run, rc, out in results)
    by_command = {run.split("#")[0].strip(): (rc, out) for run, rc, out in results}
    setup = by_command["bash scripts/setup.sh"]
    assert setup[0] == 0 and "installing quantgate" not in setup[1], log
    doctor = by_command["quantgate doctor"]
    assert doctor[0] == 0 and "the run can give a verdict" in doctor[1], log
    repro = next(v for k, v in by_command.items() if re.search(r"\bdvc repro\b", k))
    assert repro[0] == 0 and "Running stage 'record'" in repro[1], log
    assert "command not found" not in log, log
    # the gate's exit code is the job's: 0 when compare.json passes gptq3 on every request type (and it was promoted)
    report = json.loads((repo / "results" / "compare.json").read_text())
    verdicts = {r["verdict"] for r in report["variants"]["gptq3"]["domains"].values()}
    expected = 1 if "fail" in verdicts else 2 if "inconclusive" in verdicts else 0
    gate = next(v for k, v in by_command.items() if "quantgate gate" in k)
    assert gate[0] == expected, log
    assert summary.read_text() == (repo / "results" / "report.md").read_text()  # the `if: always()` step ran
    assert json.loads((repo / "results" / "mlflow_run.json").read_text())["status"] == "already recorded"
