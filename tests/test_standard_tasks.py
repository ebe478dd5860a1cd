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
from pathlib import Path

import pytest

from pipelines.core import sandbox
from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, write_json, write_jsonl
from pipelines.core.params_sections import EvaluateParams
from pipelines.evaluation import harness, standard_tasks
from pipelines.evaluation.plans import probe_plans
from tests.standard_task_helpers import PROBLEMS, params_with_tasks


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

    from tests.content_cache import cached

    params = code_params(code_files, allow_unisolated_code=True)  # isolated where it can be; it runs either way
    plans = probe_plans(params.domains, params)
    configs = harness.task_configs(plans)
    requests = {"code:humaneval": list(range(len(HUMANEVAL))), "code:mbpp": list(range(len(MBPP)))}

    def build(folder) -> list:
        model_dir = folder / "model"
        shutil.copytree(tiny_model, model_dir)
        config = read_json(model_dir / "config.json")
        write_json(model_dir / "config.json", {**config, "max_position_embeddings": 2048})
        model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return harness.run_probes(model, tokenizer, requests, params.batch_size, True, configs)

    # kept by content (tests/content_cache.py): the local files by their bytes, not the folder they are in this run
    runs = cached(tmp_path_factory, "code_task_runs", build, code=["evaluation.harness"],
                  helpers=["tests/test_standard_tasks.py"], inputs=[tiny_model.parent, *map(Path, code_files.values())],
                  settings=[requests, params.batch_size])
    return plans, configs, runs


def test_code_tasks_are_recorded_per_item_and_scored_in_the_sandbox(code_runs):
    plans, configs, (summary, items) = code_runs
    assert {k: (p["pool"], p["task"]) for k, p in plans.items() if k != "code"} == \
        {"code:humaneval": (len(HUMANEVAL), "humaneval"), "code:mbpp": (len(MBPP), "mbpp")}
    isolation = sandbox.isolation_level()[0]  # the strongest level that works here: run_python runs at it
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
