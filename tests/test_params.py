"""params.yaml checks: bad input stops with file, line and key, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.core.errors import QuantgateError
from pipelines.core.params import load_params
from pipelines.core.params_sections import DEFAULT_VARIANTS
from pipelines.models.loading import resolve_model


def write(tmp_path, text: str):
    path = tmp_path / "params.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_params_load_with_defaults():
    params = load_params("params.yaml")
    assert params.model == "reference"
    assert params.reference.hidden_size % 64 == 0 and params.reference.intermediate_size % 64 == 0


def test_shipped_variants_are_the_defaults_the_tests_quantize():
    assert load_params(Path("params.yaml")).variants == DEFAULT_VARIANTS


def test_misspelled_key_names_key_and_line(tmp_path):
    path = write(tmp_path, "model: reference\nreference:\n  seed: 1\n  stpes: 10\n")
    with pytest.raises(QuantgateError) as err:
        load_params(path)
    assert str(err.value) == f"{path}:4: unknown key 'reference.stpes' (misspelled? see docs/params.md)"


def test_wrong_type_names_key_line_and_value(tmp_path):
    path = write(tmp_path, "reference:\n  steps: many\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:2: key 'reference.steps': .*integer.*'many'"):
        load_params(path)


def test_out_of_range_value_is_refused(tmp_path):
    path = write(tmp_path, "reference:\n  hidden_size: 100\n")
    with pytest.raises(QuantgateError, match=r"reference.hidden_size.*multiple of 32"):
        load_params(path)


def test_invalid_yaml_reports_line(tmp_path):
    path = write(tmp_path, "model: reference\nreference: [1, 2\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:\d+: not valid YAML"):
        load_params(path)


def test_missing_params_file(tmp_path):
    with pytest.raises(QuantgateError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


def test_model_reference_local_and_hub(tmp_path):
    assert resolve_model("reference").kind == "reference"
    assert resolve_model("Qwen/Qwen2.5-0.5B").kind == "hub"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "ckpt")).location == str(tmp_path / "ckpt")


def test_unknown_model_value_is_one_clear_line():
    with pytest.raises(QuantgateError, match=r"model: 'refrence' is not 'reference', an existing checkpoint"):
        resolve_model("refrence")


def test_checkpoint_directory_without_config(tmp_path):
    with pytest.raises(QuantgateError, match=r"has no config.json"):
        resolve_model(str(tmp_path))


def test_gate_policy_overrides_and_bad_policy(tmp_path):
    path = tmp_path / "params.yaml"
    shipped = yaml.safe_load(Path("params.yaml").read_text())
    shipped["compare"]["policy"]["default"]["max_flip_rate"] = 0.1
    shipped["requests"]["math"]["policy"] = {"max_accuracy_drop": 0.02}  # declared with the request type
    path.write_text(yaml.safe_dump(shipped, allow_unicode=True))
    params = load_params(path)
    assert (params.compare.policy_for("math").max_accuracy_drop, params.compare.policy_for("math").max_flip_rate) == (0.02, 0.1)
    assert params.compare.policy_for("code").max_accuracy_drop == 0.05
    path.write_text("compare:\n  policy:\n    default: {max_accuracy_drop: 0.05}\n")
    with pytest.raises(QuantgateError, match="params.yaml:1: key 'compare': .*policy.default must set every limit; "
                                             "missing max_flip_rate"):
        load_params(path)
    path.write_text("compare:\n  policy:\n    maths: {max_accuracy_drop: 0.05}\n")
    with pytest.raises(QuantgateError, match=r"compare.policy.maths: declare a request type's limits under "
                                             r"requests.<name>.policy"):
        load_params(path)
    path.write_text("route:\n  context_buckets: [256, 64]\n")
    with pytest.raises(QuantgateError, match="params.yaml:1: key 'route': .*increasing order"):
        load_params(path)


def shipped_params() -> dict:
    return yaml.safe_load(Path("params.yaml").read_text())


def write_params(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False))
    return path


def test_a_request_type_is_declared_once_and_every_section_receives_it(tmp_path):
    data = shipped_params()
    data["requests"]["sql"] = {
        "classify": {"patterns": {"kw": "(?i)\\bselect\\b"}, "when": "kw >= 1", "priority": 25},
        "calibration": [{"kind": "jsonl", "path": "sql.jsonl"}],
        "probes": {"task": "quantgate_sql"},
        "tasks": ["gsm8k"],
        "policy": {"max_accuracy_drop": 0.02}}
    params = load_params(write_params(tmp_path / "params.yaml", data))
    assert params.evaluate.domains == ["math", "code", "chat", "code_comment", "sql"]  # declaration order
    assert [(s.domain, s.path) for s in params.calibration.sources if s.domain == "sql"] == [("sql", "sql.jsonl")]
    assert params.calibration.domains == ["chat", "code", "code_comment", "math", "sql"]  # name order, weight 1.0
    assert params.coverage.classify["sql"].when == "kw >= 1"
    assert params.evaluate.probes["sql"].fields == ["id", "prompt", "answer"]
    assert [t.name for t in params.evaluate.tasks["sql"]] == ["gsm8k"]
    assert params.compare.policy_for("sql").max_accuracy_drop == 0.02
    assert params.compare.policy_for("math").max_accuracy_drop == 0.05
    # the shipped params.yaml declares exactly the request types Params() uses without a file
    from pipelines.core.params import Params

    shipped, default = load_params(write_params(tmp_path / "shipped.yaml", shipped_params())), Params()
    assert shipped.requests == default.requests and shipped.calibration.sources == default.calibration.sources
    assert shipped.coverage.classify == default.coverage.classify and shipped.evaluate.probes == default.evaluate.probes


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["calibration"].update(sources=[{"domain": "math", "kind": "math"}]),
     r"params.yaml:\d+: key 'calibration': value error, calibration.sources: declare a request type's sources under "
     r"requests.<name>.calibration"),
    (lambda d: d["evaluate"].update(tasks={"math": ["gsm8k"]}), r"key 'evaluate': .*evaluate.tasks: declare them under "
                                                                 r"requests.<name>.tasks"),
    (lambda d: d["calibration"].update(exclude=["sql"]), r"unknown request type 'sql' in calibration.exclude"),
    (lambda d: d["evaluate"].update(domains=["math", "sql"]), r"unknown request type 'sql' in evaluate"),
    (lambda d: d["requests"]["math"]["classify"].update(when="__import__('os').system('true') > 0"),
     r"requests.math.classify': value error, when .*: Call is not allowed"),
    (lambda d: d["requests"]["math"]["classify"].update(when="symbol >= 1 and answer > 2"),
     r"requests.math.classify': .*unknown name 'answer'; use a pattern name \(arithmetic, ask, symbol\)"),
    (lambda d: d["requests"]["math"]["classify"]["patterns"].update(ask="(unclosed"),
     r"requests.math.classify': .*pattern 'ask': not a regular expression"),
    (lambda d: d["requests"]["math"]["probes"].update(task="gsm8k"),
     r"requests.math.probes': .*probe task 'gsm8k': name it quantgate_<something>"),
    (lambda d: d["requests"].update(unknown=d["requests"]["math"]), r"request type name 'unknown'"),
])
def test_a_bad_request_declaration_names_the_key(tmp_path, edit, message):
    data = shipped_params()
    edit(data)
    with pytest.raises(QuantgateError, match=message):
        load_params(write_params(tmp_path / "params.yaml", data))
