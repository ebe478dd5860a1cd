"""benchmarks/quantizer_settings.py reads the probe tasks it counts from the project's own task files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipelines.core.params import load_params
from pipelines.evaluation.harness import full_text
from pipelines.evaluation.plans import probe_items

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quantizer_settings.py"


def load_script():
    spec = importlib.util.spec_from_file_location("quantizer_settings", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tasks_are_the_shipped_generate_until_probes(capsys):
    tasks = load_script().generated_tasks(load_params("params.yaml"))
    assert list(tasks) == ["math", "code", "code_comment"]  # chat is multiple choice: named and skipped
    assert "chat: no lost/gained count" in capsys.readouterr().err
    assert [tasks[d]["max_new_tokens"] for d in tasks] == [8, 16, 12]
    assert all(tasks[d]["until"] == ["\n", "</s>"] for d in tasks)
    item = probe_items("code")[0]
    assert full_text(tasks["code"]["prompt"], item) == item["prompt"]
    assert full_text(tasks["code"]["target"], item) == item["canonical"]


def test_a_task_that_is_not_a_template_is_skipped_not_a_crash(tmp_path, monkeypatch, capsys):
    for name in ("math", "code", "chat", "code_comment"):
        folder = tmp_path / "eval" / name
        folder.mkdir(parents=True)
        task = Path("eval", name, f"quantgate_{name}.yaml").read_text(encoding="utf-8")
        if name == "math":
            task = task.replace('doc_to_text: "{{question}}"', "doc_to_text: !function utils.prompt")
        (folder / f"quantgate_{name}.yaml").write_text(task, encoding="utf-8")
    params = load_params("params.yaml")
    monkeypatch.chdir(tmp_path)
    tasks = load_script().generated_tasks(params)
    assert list(tasks) == ["code", "code_comment"]
    assert "math: no lost/gained count" in capsys.readouterr().err
