"""Standard lm-eval tasks beside the probes: lm-eval's own gsm8k, humaneval and mbpp definitions on local
files, offline.

The task YAMLs are the ones the installed lm_eval ships (lm_eval/tasks/gsm8k/gsm8k.yaml, humaneval/humaneval.yaml,
mbpp/mbpp.yaml); only their data comes from files written here in the datasets' real formats (gsm8k: `question`,
`answer` ending in `#### N`; openai_humaneval: task_id, prompt, canonical_solution, test, entry_point; mbpp:
task_id, text, code, test_list, test_setup_code, challenge_test_list). Code tasks run in quantgate's sandbox.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipelines import quantize
from pipelines.core import sandbox
from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, write_json, write_jsonl
from pipelines.core.params import Params
from pipelines.core.params_sections import DEFAULT_VARIANTS, CompareParams, EvaluateParams
from pipelines.evaluation import harness, standard_tasks
from pipelines.evaluation.plans import by_id, correctness, probe_plans
from pipelines.judging import comparison
from pipelines.judging.verdict import pairing_problems
from pipelines.models.loading import ModelSource
from tests import handmade

# (question, worked answer, final number): the shape of openai/gsm8k's rows
PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7", 7),
    ("A box holds 6 eggs. How many eggs are in 2 boxes?", "6 * 2 = <<6*2=12>>12", 12),
    ("Sara had 10 pens and gave away 3. How many pens are left?", "10 - 3 = <<10-3=7>>7", 7),
    ("A bus has 20 seats and 5 are empty. How many people sit on the bus?", "20 - 5 = <<20-5=15>>15", 15),
    ("Ann reads 5 pages a day for 4 days. How many pages does she read?", "5 * 4 = <<5*4=20>>20", 20),
    ("There are 9 birds and 2 fly away. How many birds stay?", "9 - 2 = <<9-2=7>>7", 7),
    ("A pack has 8 cards. How many cards are in 3 packs?", "8 * 3 = <<8*3=24>>24", 24),
    ("Ben saves 2 dollars a week for 6 weeks. How much does he save?", "2 * 6 = <<2*6=12>>12", 12),
]
SHOTS = [
    ("Mia has 2 cats and gets 1 more. How many cats does she have?", "2 + 1 = <<2+1=3>>3", 3),
    ("A pencil costs 2 dollars. How much do 5 pencils cost?", "2 * 5 = <<2*5=10>>10", 10),
    ("Leo had 7 balls and lost 4. How many balls are left?", "7 - 4 = <<7-4=3>>3", 3),
    ("A tree has 4 branches with 3 birds each. How many birds?", "4 * 3 = <<4*3=12>>12", 12),
    ("Kim ran 3 km on Monday and 5 km on Tuesday. How far did she run?", "3 + 5 = <<3+5=8>>8", 8),
]
P = EvaluateParams(domains=["math"], look_items=4, max_items=8, batch_size=8, fidelity_texts=4)


def rows(problems):
    return [{"question": q, "answer": f"{work}\n#### {n}"} for q, work, n in problems]


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gsm8k")
    write_jsonl(root / "test.jsonl", rows(PROBLEMS))
    write_jsonl(root / "train.jsonl", rows(SHOTS))
    return {"test": str(root / "test.jsonl"), "train": str(root / "train.jsonl")}


@pytest.fixture(scope="module")
def params(gsm8k_files):
    return P.model_copy(update={"tasks": EvaluateParams.model_validate(
        {"tasks": {"math": [{"name": "gsm8k", "data_files": gsm8k_files}]}}).tasks})


@pytest.fixture(scope="module")
def fp16(tmp_path_factory, tiny_model):
    """The tiny model as the pipeline's fp16 variant (a checkpoint directory with its quantgate.json)."""
    root = tmp_path_factory.mktemp("variants")
    manifest, _ = quantize.quantize_variant("fp16", DEFAULT_VARIANTS["fp16"], ModelSource("local", str(tiny_model)),
                                            root / "no-calibration", "cpu", root)
    assert manifest["status"] == "ok", manifest.get("error")
    return root / "fp16"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fp16, params):
    """fp16 as the baseline (every look), then the same model evaluated again as a variant against it."""
    plans = probe_plans(params.domains, params)
    base_path = tmp_path_factory.mktemp("fid") / "base.safetensors"
    base, base_items = harness.evaluate_variant(str(fp16), plans, params, "cpu", base_path)
    answers = {key: correctness(by_id(base_items, key)) for key in plans}
    again, again_items = harness.evaluate_variant(str(fp16), plans, params, "cpu", base_path, answers, CompareParams())
    return plans, (base, base_items), (again, again_items)


def test_the_plan_has_a_row_per_task_with_stable_ids(runs):
    plans, _, _ = runs
    assert list(plans) == ["math", "math:gsm8k"]
    plan = plans["math:gsm8k"]
    assert plan["pool"] == len(PROBLEMS)
    assert sorted(plan["order"]) == sorted(f"gsm8k:{n}" for n in range(len(PROBLEMS)))
    assert plan["looks"] == [4, 6, 8]
    assert (plan["domain"], plan["task"]) == ("math", "gsm8k")


def test_gsm8k_is_recorded_per_item_from_the_local_file(runs):
    _, (base, items), _ = runs
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
    plans, (_, base_items), (again, items) = runs
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
    _, (_, base_items), (_, items) = runs
    base = by_id(base_items, "math:gsm8k")
    mine = {i: {**r, "prompt_hash": "x"} if i == "gsm8k:0" else r for i, r in by_id(items, "math:gsm8k").items()}
    assert any("other prompts" in p for p in pairing_problems(base, mine, sorted(mine)))
    mine = {i: {**r, "filter": "flexible-extract"} for i, r in by_id(items, "math:gsm8k").items()}
    assert any("another lm-eval filter" in p for p in pairing_problems(base, mine, sorted(mine)))


def test_compare_judges_the_task_as_its_own_row(tmp_path, runs, fp16):
    plans, (base, base_items), (again, items) = runs
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
             "response": f"{name}-{i}", "correct": c} for i, c in enumerate(correct)]


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


def test_unknown_task_missing_file_and_code_tasks_are_named(tmp_path, gsm8k_files):
    with pytest.raises(QuantgateError, match=r"requests\.math\.tasks: task 'gsm9k' is not an lm-eval task"):
        probe_plans(["math"], EvaluateParams.model_validate({"tasks": {"math": ["gsm9k"]}}))
    missing = tmp_path / "nowhere" / "test.jsonl"
    with pytest.raises(QuantgateError, match=rf"task 'gsm8k': data file {missing} \(split 'test'\) does not exist"):
        probe_plans(["math"], EvaluateParams.model_validate(
            {"tasks": {"math": [{"name": "gsm8k", "data_files": {"test": str(missing), "train": gsm8k_files["train"]}}]}}))
    with pytest.raises(QuantgateError, match=r"5-shot prompts draw from the 'train' split"):
        probe_plans(["math"], EvaluateParams.model_validate(
            {"tasks": {"math": [{"name": "gsm8k", "data_files": {"test": gsm8k_files["test"]}}]}}))
    with pytest.raises(QuantgateError, match=r"task 'mbpp_plus' executes model-written code .* outside quantgate's "
                                             r"sandbox: of the code tasks only humaneval, mbpp are scored in the sandbox"):
        probe_plans(["code"], EvaluateParams.model_validate({"tasks": {"code": ["mbpp_plus"]}}))
    with pytest.raises(QuantgateError, match=r"no filter 'loose'; the task's filters are strict-match, flexible-extract"):
        probe_plans(["math"], EvaluateParams.model_validate(
            {"tasks": {"math": [{"name": "gsm8k", "data_files": gsm8k_files, "filter": "loose"}]}}))


def test_the_default_params_add_no_task_rows():
    assert EvaluateParams().tasks == {}
    assert list(probe_plans(["math"], EvaluateParams())) == ["math"]


# --- code tasks: humaneval and mbpp scored in the sandbox --------------------------------------------------

# The prompt leaves the completion inside a raw string, so whatever the tiny model writes compiles (the test
# checks it wrote no closing quotes) and each item's correctness follows from its test alone.
INERT = 'def f():\n    return 1\n\n\n_ = r"""'
# (prompt, test, entry_point, correct as HF code_eval would score it)
HUMANEVAL = [
    (INERT, '"""\n\n\ndef check(candidate):\n    assert candidate() == 1\n', "f", True),  # any completion passes
    (INERT, '"""\n\n\ndef check(candidate):\n    assert False\n', "f", False),  # no completion passes
    ('def g():\n    return 2\n\n\n_ = r"""',  # check() is called with the entry point
     '"""\n\n\ndef check(candidate):\n    assert candidate.__name__ == "g" and candidate() == 2\n', "g", True),
    # code_eval exec()s the program: no __main__ block runs, and SystemExit, even exit(0), is a failure
    (INERT, '"""\n\nif __name__ == "__main__":\n    raise SystemExit(3)\n\n\ndef check(candidate):\n    pass\n', "f", True),
    (INERT, '"""\n\nimport sys\nsys.exit(0)\n', "f", False),
    (INERT, '"""\n\nwhile True:\n    pass\n', "f", False),  # a hang times out
]
MBPP = [  # no completion passes `assert False`; the few-shot prompt comes from lm-eval's own three samples
    {"task_id": 901, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert False", "assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": "",
     "challenge_test_list": []},
    {"task_id": 902, "text": "Write a function to negate a number.", "code": "def neg(a):\n    return -a",
     "test_list": ["assert neg(1) == -1", "assert False", "assert neg(0) == 0"], "test_setup_code": "",
     "challenge_test_list": []},
]


@pytest.fixture(scope="module")
def code_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("code-tasks")
    write_jsonl(root / "humaneval.jsonl", [{"task_id": f"Local/{n}", "prompt": prompt, "canonical_solution": "\n",
                                            "test": test, "entry_point": entry}
                                           for n, (prompt, test, entry, _) in enumerate(HUMANEVAL)])
    write_jsonl(root / "mbpp.jsonl", MBPP)
    return {"humaneval": str(root / "humaneval.jsonl"), "mbpp": str(root / "mbpp.jsonl")}


def code_params(code_files, allow_unisolated_code=False):
    return EvaluateParams.model_validate({
        "domains": ["code"], "look_items": 4, "batch_size": 8, "allow_unisolated_code": allow_unisolated_code,
        "tasks": {"code": [{"name": name, "data_files": {"test": path}} for name, path in code_files.items()]}})


@pytest.fixture(scope="module")
def code_runs(tmp_path_factory, tiny_model, code_files):
    """lm-eval's humaneval and mbpp on the local files, with the tiny model, in one run_probes call.

    humaneval asks for up to 1024 new tokens, and lm-eval refuses a model whose context is not longer: the tiny
    model (rotary positions, nothing learnt per position) is given a 2048-token window in its config.
    """
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path_factory.mktemp("code-model") / "model"
    shutil.copytree(tiny_model, model_dir)
    config = read_json(model_dir / "config.json")
    write_json(model_dir / "config.json", {**config, "max_position_embeddings": 2048})
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    params = code_params(code_files, allow_unisolated_code=True)  # isolated where it can be; it runs either way
    plans = probe_plans(params.domains, params)
    configs = harness.task_configs(plans)
    requests = {"code:humaneval": list(range(len(HUMANEVAL))), "code:mbpp": list(range(len(MBPP)))}
    return plans, configs, harness.run_probes(model, tokenizer, requests, params.batch_size, True, configs)


def test_code_tasks_are_recorded_per_item_and_scored_in_the_sandbox(code_runs):
    plans, configs, (summary, items) = code_runs
    assert {k: (p["pool"], p["task"]) for k, p in plans.items() if k != "code"} == \
        {"code:humaneval": (len(HUMANEVAL), "humaneval"), "code:mbpp": (len(MBPP), "mbpp")}
    isolation = sandbox.FULL if sandbox.isolation_available() else sandbox.WEAK
    for key, task, n in (("code:humaneval", "humaneval", len(HUMANEVAL)), ("code:mbpp", "mbpp", len(MBPP))):
        assert {k: summary[key][k] for k in ("task", "status", "metric", "filter", "items", "isolation")} == \
            {"task": task, "status": "ok", "metric": "pass@1", "filter": "none", "items": n, "isolation": isolation}
        assert summary[key]["task_version"] == 1.0  # the installed definition's
    records = {r["item_id"]: r for r in items}
    assert set(records) == {f"humaneval:{n}" for n in range(len(HUMANEVAL))} | {f"mbpp:{n}" for n in range(len(MBPP))}
    for n, (prompt, test, entry, correct) in enumerate(HUMANEVAL):
        record = records[f"humaneval:{n}"]
        assert '"""' not in record["response"], "the completion closed the prompt's string: the item no longer decides"
        assert record["target"] == f"{test}\ncheck({entry})"  # lm-eval's doc_to_target, what code_eval appends
        assert (record["domain"], record["task"], record["doc_id"], record["filter"]) == ("code", "humaneval", n, "none")
        assert record["correct"] is correct, (n, record["response"][:200])
    for n, doc in enumerate(MBPP):
        record = records[f"mbpp:{n}"]
        assert record["target"] == "\n".join(doc["test_list"])
        assert record["correct"] is False
    assert summary["code:humaneval"]["score"] == pytest.approx(3 / 6)
    assert configs["code:mbpp"]["fewshot_config"]["samples"][0]["code"] == (  # lm_eval/tasks/mbpp/utils.py's first
        "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) ")
    assert [s["task_id"] for s in configs["code:mbpp"]["fewshot_config"]["samples"]] == [2, 3, 4]


def test_the_scorers_build_code_evals_programs(monkeypatch):
    """humaneval: prompt + completion, then test and check(entry_point); mbpp: completion, then the first three
    asserts (lm-eval's target), run in the sandbox."""
    monkeypatch.setenv("QUANTGATE_ALLOW_UNISOLATED_CODE", "1")  # isolated where it can be; it runs either way
    doc = {"prompt": "def add(a, b):\n", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
           "entry_point": "add"}
    assert standard_tasks.humaneval_results(doc, ["    return a + b\n"]) == {"pass@1": 1.0}
    assert standard_tasks.humaneval_results(doc, ["    return a * b\n"]) == {"pass@1": 0.0}
    assert standard_tasks.humaneval_results(doc, ["    return (\n"]) == {"pass@1": 0.0}  # a syntax error fails
    doc = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0", "assert False"]}
    assert standard_tasks.mbpp_results(doc, ["def add(a, b):\n    return a + b\n"]) == {"pass@1": 1.0}
    assert standard_tasks.mbpp_results(doc, ["def add(a, b):\n    return a - b\n"]) == {"pass@1": 0.0}


def test_code_tasks_never_import_hf_evaluate(code_files):
    """The task definitions build and load their data without lm-eval's utils modules (which import HF evaluate
    and load code_eval from the hub); lm-eval's own way of reading the YAML would import it."""
    script = f"""
import json, sys
from pipelines.evaluation import standard_tasks
from pipelines.core.params_requests import TaskParams
specs = [TaskParams(name=n, data_files={{"test": p}}) for n, p in {code_files!r}.items()]
counts = [standard_tasks.doc_count("code", s) for s in specs]
cfgs = [standard_tasks.task_config("code", s) for s in specs]
before = sorted(m for m in sys.modules if m.split(".")[0] == "evaluate" or m.endswith(("humaneval.utils", "mbpp.utils")))
from lm_eval.tasks._yaml_loader import load_yaml
entry = standard_tasks.task_manager(True, "eval").task_index["humaneval"]
try:
    load_yaml(entry.yaml_path, resolve_func=True)
except Exception:
    pass
print(json.dumps({{"counts": counts, "before": before, "after": "evaluate" in sys.modules}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"counts": [len(HUMANEVAL), len(MBPP)], "before": [], "after": True}


def test_code_tasks_are_refused_without_isolation_unless_allowed(monkeypatch, code_files):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    params = code_params(code_files)
    configs = harness.task_configs(probe_plans(params.domains, params))
    summary, items = harness.run_probes(None, None, {"code:humaneval": [0], "code:mbpp": [0]}, 8, False, configs)
    assert items == []
    assert {k: (r["task"], r["status"]) for k, r in summary.items()} == \
        {"code:humaneval": ("humaneval", "refused"), "code:mbpp": ("mbpp", "refused")}
    assert summary["code:mbpp"]["cause"] == "environment"  # this machine's, not the model's: the row is inconclusive
    assert "allow_unisolated_code" in summary["code:mbpp"]["remedy"]


def test_a_changed_code_task_definition_is_refused():
    """quantgate reproduces lm_eval 0.4.13's humaneval scoring: pass@k for another k is not what it scores."""
    from pathlib import Path

    from lm_eval.tasks._yaml_loader import load_yaml

    entry = standard_tasks.task_manager(True, "eval").task_index["humaneval"]
    raw = load_yaml(entry.yaml_path, resolve_func=False)
    raw["metric_list"][0]["k"] = [1, 10]
    with pytest.raises(QuantgateError, match=r"differs from the definition quantgate scores in its sandbox"):
        standard_tasks._sandboxed("requests.code.tasks: task 'humaneval'", "humaneval", raw, Path(entry.yaml_path))


def params_with_tasks(tasks: dict, **evaluate):
    """The default params with standard tasks declared where params.yaml declares them: requests.<name>.tasks."""
    requests = {name: r.model_dump(exclude_none=True) for name, r in Params().requests.items()}
    for name, specs in tasks.items():
        requests[name]["tasks"] = specs
    return Params(requests=requests, evaluate=evaluate)


def test_the_gate_will_not_decide_on_task_data_dvc_does_not_track(tmp_path):
    """A task's local data outside eval/ (what the stages depend on in dvc.yaml) could change unseen: undecided."""
    from pipelines.gate import decide

    outside = tmp_path / "gsm8k_test.jsonl"
    outside.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    params = params_with_tasks({"math": [{"name": "gsm8k", "data_files": {"test": str(outside)}}]})
    result = decide({}, {}, params, [], "digest")
    assert result["verdict"] == "undecided"
    assert result["reasons"] == [f"requests.math.tasks: task gsm8k's test data {outside} is outside eval/, which DVC "
                                 "does not track for it: move it under eval/ (e.g. eval/math/gsm8k/gsm8k_test.jsonl)"]
    inside = params_with_tasks({"math": [{"name": "gsm8k", "data_files": {"test": "eval/math/gsm8k/test.jsonl"}}]})
    assert decide({}, {}, inside, [], "digest")["reasons"] != result["reasons"]  # it goes on to the next check


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


def test_local_data_is_read_by_the_builder_its_suffix_names(tmp_path, gsm8k_files):
    """parquet and csv files work as well as JSON lines; an unknown suffix or mixed formats are named."""
    import pandas as pd

    from pipelines.core.params_requests import TaskParams

    for split, path in gsm8k_files.items():
        pd.read_json(path, lines=True).to_parquet(tmp_path / f"{split}.parquet")
    spec = TaskParams(name="gsm8k", data_files={s: str(tmp_path / f"{s}.parquet") for s in gsm8k_files})
    cfg = standard_tasks.task_config("math", spec)
    assert cfg["dataset_path"] == "parquet"
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str((tmp_path / "test.parquet").resolve())
    assert standard_tasks.doc_count("math", spec) == len(PROBLEMS)  # lm-eval really reads the parquet
    with pytest.raises(QuantgateError, match=r"test.txt \(split 'test'\): only .csv, .json, .jsonl, .parquet"):
        standard_tasks.data_loader({"test": "eval/math/test.txt"}, "requests.math.tasks: task gsm8k")
    with pytest.raises(QuantgateError, match="mixes formats"):
        standard_tasks.data_loader({"test": "a.parquet", "train": "b.jsonl"}, "requests.math.tasks: task gsm8k")


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
