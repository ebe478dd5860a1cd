"""Standard-task rows (lm-eval's gsm8k on local files) through evaluation, compare, verdict, gate and promotion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipelines import quantize
from pipelines.core.io import read_json, write_json, write_jsonl
from pipelines.core.params import Params
from pipelines.core.params_sections import DEFAULT_VARIANTS, CompareParams, EvaluateParams
from pipelines.evaluation import harness, standard_tasks
from pipelines.evaluation.plans import by_id, correctness, probe_plans
from pipelines.judging import comparison
from pipelines.judging.verdict import pairing_problems
from pipelines.models.loading import ModelSource
from tests import handmade
from tests.standard_task_helpers import PROBLEMS, params_with_tasks

P = EvaluateParams(domains=["math"], look_items=4, max_items=8, batch_size=8, fidelity_texts=4)


def params_for(data_files: dict) -> EvaluateParams:
    return P.model_copy(update={"tasks": EvaluateParams.model_validate(
        {"tasks": {"math": [{"name": "gsm8k", "data_files": data_files}]}}).tasks})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, gsm8k_files):
    """The tiny model as the pipeline's fp16 variant (a checkpoint directory with its quantgate.json) as the baseline
    (every look), then the same model evaluated again as a variant against it. Kept by content
    (tests/content_cache.py), gsm8k's files copied into the entry, so that the paths its records name stay valid."""
    from tests.content_cache import cached

    def build(folder):
        data = {split: str(shutil.copy(path, folder / f"{split}.jsonl")) for split, path in gsm8k_files.items()}
        params = params_for(data)
        plans = probe_plans(params.domains, params)
        root = folder / "variants"
        manifest, _ = quantize.quantize_variant("fp16", DEFAULT_VARIANTS["fp16"],
                                                ModelSource("local", str(tiny_model)), root / "no-calibration", "cpu",
                                                root)
        assert manifest["status"] == "ok", manifest.get("error")
        base, base_items = harness.evaluate_variant(str(root / "fp16"), plans, params, "cpu",
                                                    folder / "base.safetensors")
        answers = {key: correctness(by_id(base_items, key)) for key in plans}
        again, again_items = harness.evaluate_variant(str(root / "fp16"), plans, params, "cpu",
                                                      folder / "base.safetensors", answers, CompareParams())
        return data, (base, base_items), (again, again_items), root / "fp16"

    data, base, again, fp16 = cached(
        tmp_path_factory, "standard_task_rows", build, code=["quantize", "evaluation.harness"],
        helpers=["tests/test_standard_task_rows.py", "tests/standard_task_helpers.py"],
        inputs=[tiny_model.parent, *map(Path, gsm8k_files.values())],
        settings=[P.model_dump(), CompareParams().model_dump()])
    params = params_for(data)
    return probe_plans(params.domains, params), base, again, fp16


def test_the_plan_has_a_row_per_task_with_stable_ids(runs):
    plans, _, _, _ = runs
    assert list(plans) == ["math", "math:gsm8k"]
    plan = plans["math:gsm8k"]
    assert plan["pool"] == len(PROBLEMS)
    assert sorted(plan["order"]) == sorted(f"gsm8k:{n}" for n in range(len(PROBLEMS)))
    assert plan["looks"] == [4, 6, 8]
    assert (plan["domain"], plan["task"]) == ("math", "gsm8k")


def test_gsm8k_is_recorded_per_item_from_the_local_file(runs):
    _, (base, items), _, _ = runs
    assert base["status"] == "ok", base.get("error")
    summary = base["probes"]["math:gsm8k"]
    assert (summary["task"], summary["metric"], summary["filter"], summary["items"]) == \
        ("gsm8k", "exact_match", "strict-match", len(PROBLEMS))
    assert summary["task_version"] == 3.0  # the installed definition's version, not a copy's
    mine = [r for r in items if r["task"] == "gsm8k"]
    assert all(r["domain"] == "math" and r["filter"] == "strict-match" for r in mine)
    by_doc = {r["item_id"]: r for r in mine}
    assert set(by_doc) == {f"gsm8k:{n}" for n in range(len(PROBLEMS))}
    for n, (_, work, answer) in enumerate(PROBLEMS):  # the id is the doc's position in the file
        assert by_doc[f"gsm8k:{n}"]["target"] == f"{work}\n#### {answer}"
        assert by_doc[f"gsm8k:{n}"]["doc_id"] == n
    assert summary["score"] == pytest.approx(sum(r["correct"] for r in mine) / len(mine))
    assert len({r["prompt_hash"] for r in mine}) == len(PROBLEMS)
    # the probe rows are the domain's own, untouched by the task's
    assert {r["task"] for r in items if r["domain"] == "math"} == {"quantgate_math", "gsm8k"}
    assert set(by_id(items, "math")) == {r["item_id"] for r in items if r["task"] == "quantgate_math"}


def test_the_same_model_pairs_with_zero_flips(runs):
    plans, (_, base_items), (again, items), _ = runs
    assert again["status"] == "ok", again.get("error")
    base, mine = by_id(base_items, "math:gsm8k"), by_id(items, "math:gsm8k")
    assert set(mine) and set(mine) <= set(base)
    assert pairing_problems(base, mine, sorted(mine)) == []
    row = comparison.compare_domain(base, mine, again["probes"]["math:gsm8k"], again["fidelity"]["math"], None,
                                 plans["math:gsm8k"], CompareParams().policy_for("math"), CompareParams())
    assert row["paired"]["items"] == len(mine)
    assert (row["paired"]["correct_to_wrong"], row["paired"]["wrong_to_correct"]) == (0, 0)
    assert row["paired"]["difference"] == 0
    assert row["identical_to_fp16"]  # the same model: a check that every verdict path sees
    assert row["verdict"] == "fail"


def test_another_prompt_does_not_pair(runs):
    _, (_, base_items), (_, items), _ = runs
    base = by_id(base_items, "math:gsm8k")
    mine = {i: {**r, "prompt_hash": "x"} if i == "gsm8k:0" else r for i, r in by_id(items, "math:gsm8k").items()}
    assert any("other prompts" in p for p in pairing_problems(base, mine, sorted(mine)))
    mine = {i: {**r, "filter": "flexible-extract"} for i, r in by_id(items, "math:gsm8k").items()}
    assert any("another lm-eval filter" in p for p in pairing_problems(base, mine, sorted(mine)))


def test_compare_judges_the_task_as_its_own_row(tmp_path, runs):
    plans, (base, base_items), (again, items), fp16 = runs
    for name, result, records in (("fp16", base, base_items), ("again", again, items)):
        write_json(tmp_path / "models/variants" / name / "quantgate.json", read_json(fp16 / "quantgate.json"))
        write_json(tmp_path / "results/eval" / f"{name}.json", result)
        write_jsonl(tmp_path / "results/eval" / name / "items.jsonl", records)
    handmade.write_memory(tmp_path, {"fp16": handmade.memory_row("fp16"), "again": handmade.memory_row("int8")})
    report = comparison.compare_all(["fp16", "again"], [], plans, CompareParams(), tmp_path / "results",
                                 tmp_path / "models/variants")
    assert report["domains"] == ["math"]  # what gate and route read: the domains
    assert report["plans"]["math:gsm8k"] == {"pool": 8, "looks": [4, 6, 8]}
    rows = report["variants"]["again"]["domains"]
    assert list(rows) == ["math", "math:gsm8k"]
    task = rows["math:gsm8k"]
    assert task["paired"]["correct_to_wrong"] == task["paired"]["wrong_to_correct"] == 0
    assert task["metric"] == "exact_match" and task["task_version"] == 3.0
    assert report["fp16"]["accuracy"]["math:gsm8k"] == pytest.approx(
        sum(r["correct"] for r in base_items if r["task"] == "gsm8k") / 8)
    assert [r["domain"] for r in comparison.flat_rows(report)] == ["math", "math:gsm8k"]
    json.dumps(report)  # compare.json stays plain JSON


def _task_records(name: str, correct: list[bool]) -> list[dict]:
    return [{"domain": "math", "task": "gsm8k", "item_id": f"gsm8k:{i}", "family": None, "doc_id": i,
             "filter": "strict-match", "doc_hash": f"d{i}", "prompt_hash": f"p{i}", "target": "#### 1",
             "response": f"{name}-{i}", "correct": c, "chance": 0.0} for i, c in enumerate(correct)]


def _handmade_report(root, probe_lose: int, task_lose: int, n: int = 400) -> dict:
    """compare.json over hand-made records: fp16 and int8 answer the math probes and gsm8k (240 of `n` right
    for fp16); int8 loses `probe_lose` probe answers and `task_lose` gsm8k answers."""
    from pipelines.judging import sequential

    handmade.write_model(root, "fp16", {"math": handmade.correctness(n, 240)})
    handmade.write_model(root, "int8", {"math": handmade.correctness(n, 240, lose=probe_lose)})
    handmade.write_eval_items(root, {"math": n})
    handmade.write_memory(root, {m: handmade.memory_row(m) for m in ("fp16", "int8")})
    plans = handmade.plans(root, ("math",))
    ids = [standard_tasks.item_id("gsm8k", i) for i in range(n)]
    plans["math:gsm8k"] = {"pool": n, "looks": [n], "order": sequential.ordered(ids, "math:gsm8k"),
                           "families": {i: f"item:{i}" for i in ids}, "domain": "math", "task": "gsm8k",
                           "spec": {"name": "gsm8k"}}
    answers = {"fp16": handmade.correctness(n, 240), "int8": handmade.correctness(n, 240, lose=task_lose)}
    for name, correct in answers.items():
        path = root / "results/eval" / name / "items.jsonl"
        write_jsonl(path, [r for r in read_json_lines(path) if r["task"] != "gsm8k"] + _task_records(name, correct))
        result = read_json(root / "results/eval" / f"{name}.json")
        result["probes"]["math:gsm8k"] = {"task": "gsm8k", "status": "ok", "task_version": 3.0, "metric": "exact_match",
                                          "filter": "strict-match", "score": sum(correct) / n, "stderr": None, "items": n}
        write_json(root / "results/eval" / f"{name}.json", result)
    return comparison.compare_all(["fp16", "int8"], [], plans, CompareParams(), root / "results", root / "models/variants")


def _gate_view(report: dict) -> tuple[list[str], tuple[str, list[str]]]:
    """What the gate makes of int8's math row: its inconsistencies (re-derived with verdict.judge) and its verdict."""
    from pipelines.judging.verdict import check_row, inconsistencies

    rows = report["variants"]["int8"]["domains"]
    return (inconsistencies("int8", "math", rows["math"], rows["math"], report["variants"]["int8"]["memory"], Params()),
            check_row("int8", "math", rows["math"], Params()))


def test_a_failing_task_row_fails_its_domain_and_the_gate_re_derives_it(tmp_path):
    """Hand-made records: the probe row passes on its own, gsm8k loses 60 of 400 items: the domain fails."""
    report = _handmade_report(tmp_path, probe_lose=0, task_lose=60)
    rows = report["variants"]["int8"]["domains"]
    assert rows["math:gsm8k"]["verdict"] == "fail"
    assert rows["math:gsm8k"]["paired"]["correct_to_wrong"] == 60
    assert rows["math"]["paired"]["correct_to_wrong"] == 0  # the probes alone would pass ...
    assert rows["math"]["verdict"] == "fail"  # ... but the domain needs every row
    assert rows["math"]["record_problems"] == []  # a task's verdict is judge's input, not a record problem
    assert rows["math"]["tasks"] == {"math:gsm8k": {"verdict": "fail", "reasons": rows["math:gsm8k"]["reasons"]}}
    assert any(r.startswith("task row math:gsm8k did not pass (fail)") for r in rows["math"]["reasons"])
    assert report["variants"]["int8"]["verdict"] == "fail"
    # the gate re-derives the domain's row from its own numbers and task verdicts, agrees, and fails it (exit 1)
    broken, (verdict, _) = _gate_view(report)
    assert broken == [] and verdict == "fail"
    # with gsm8k as good as fp16's, the domain passes
    report = _handmade_report(tmp_path, probe_lose=0, task_lose=0)
    assert {k: r["verdict"] for k, r in report["variants"]["int8"]["domains"].items()} == \
        {"math": "pass", "math:gsm8k": "pass"}
    assert _gate_view(report) == ([], ("pass", []))


def test_an_inconclusive_task_row_leaves_its_domain_undecided(tmp_path):
    """gsm8k loses 15 of 400 (interval straddles -0.05 after the last look): the domain, which passes on its own,
    is inconclusive and the gate says "could not decide" (exit 2), not fail; a domain failing on its own stays failed."""
    from pipelines.gate import EXIT
    from pipelines.judging.verdict import inconsistencies

    report = _handmade_report(tmp_path, probe_lose=0, task_lose=15)
    rows = report["variants"]["int8"]["domains"]
    assert rows["math:gsm8k"]["verdict"] == "inconclusive"
    assert rows["math:gsm8k"]["paired"]["ci_low"] < -0.05 < rows["math:gsm8k"]["paired"]["difference"]
    assert rows["math"]["checks"]["accuracy_drop"]["decision"] == "pass"  # its own probes decide ...
    assert rows["math"]["verdict"] == "inconclusive"  # ... the task row does not
    assert [r for r in rows["math"]["reasons"] if r.startswith("task row math:gsm8k did not pass (inconclusive)")]
    assert "items_to_decide" not in rows["math"]  # more probe items would not decide a task row
    assert "items_to_decide" in rows["math:gsm8k"]
    assert report["variants"]["int8"]["verdict"] == "inconclusive"
    broken, (verdict, why) = _gate_view(report)
    assert broken == [] and verdict == "undecided" and EXIT[verdict] == 2
    assert "task row math:gsm8k did not pass (inconclusive)" in why[0]
    # a compare.json whose domain row keeps other task verdicts than it was judged on does not re-derive
    tampered = {**rows["math"], "tasks": {"math:gsm8k": {"verdict": "pass", "reasons": []}}}
    assert inconsistencies("int8", "math", tampered, rows["math"], report["variants"]["int8"]["memory"], Params()) == \
        ["int8 math: compare.json says 'inconclusive' but its own numbers give 'pass'"]
    # the probes losing 60 fail the domain whatever its task rows say
    report = _handmade_report(tmp_path, probe_lose=60, task_lose=15)
    rows = report["variants"]["int8"]["domains"]
    assert (rows["math"]["verdict"], rows["math:gsm8k"]["verdict"]) == ("fail", "inconclusive")
    broken, (verdict, _) = _gate_view(report)
    assert broken == [] and verdict == "fail"


def read_json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_promotion_refuses_a_regression_on_a_standard_task_alone():
    """The candidate matches production on the probes but loses 60 of 400 gsm8k items: promotion is refused."""
    from pipelines.judging.verdict import regression_against

    def probes(tag):
        return [{"domain": "math", "task": "quantgate_math", "item_id": f"math-{i}", "family": f"f{i % 20}",
                 "doc_hash": f"d{i}", "prompt_hash": f"p{i}", "correct": i % 3 != 0} for i in range(400)]

    production = probes("prod") + _task_records("prod", [True] * 300 + [False] * 100)
    candidate = probes("cand") + _task_records("cand", [True] * 240 + [False] * 160)
    params = params_with_tasks({"math": ["gsm8k"]}, domains=["math"])
    reasons = regression_against(candidate, production, params)
    assert len(reasons) == 1 and reasons[0].startswith("math:gsm8k: accuracy 0.600 vs production 0.750 on 400")
    # without the task configured the same items pass: the regression is the task row's alone
    assert regression_against(candidate, production, Params(evaluate={"domains": ["math"]})) == []


def test_a_graded_metric_is_refused_not_read_as_right_or_wrong(gsm8k_files):
    """An f1-like per-item value (0.5) is neither correct nor wrong: the row is refused, naming the metric."""
    from pipelines.core.params_requests import TaskParams

    cfg = standard_tasks.task_config("math", TaskParams(name="gsm8k", data_files=gsm8k_files))
    filt, metric = standard_tasks.scoring(cfg)

    def out(values):
        return {"results": {"gsm8k": {f"{metric},{filt}": 0.5}}, "versions": {"gsm8k": 3.0},
                "samples": {"gsm8k": [{"filter": filt, metric: v, "doc_id": i, "doc_hash": "d", "prompt_hash": "p",
                                       "target": "1", "filtered_resps": ["1"]} for i, v in enumerate(values)]}}

    summary, items = {}, []
    harness._task_rows("math:gsm8k", "gsm8k", cfg, out([1.0, 0.5]), summary, items)
    assert summary["math:gsm8k"]["status"] == "refused" and items == []
    assert summary["math:gsm8k"]["reason"].startswith(f"metric {metric!r} of task gsm8k is not 0/1 per item (e.g. 0.5)")
    harness._task_rows("math:gsm8k", "gsm8k", cfg, out([1.0, 0.0, True]), summary, items)
    assert summary["math:gsm8k"]["status"] == "ok" and [r["correct"] for r in items] == [True, False, True]
