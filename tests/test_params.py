"""params.yaml checks: bad input stops with file, line and key, never a traceback."""

from __future__ import annotations

import pytest

from pipelines.errors import QuantgateError
from pipelines.models import resolve_model
from pipelines.params import load_params


def write(tmp_path, text: str):
    path = tmp_path / "params.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_params_load_with_defaults():
    params = load_params("params.yaml")
    assert params.model == "reference"
    assert params.reference.hidden_size % 64 == 0 and params.reference.intermediate_size % 64 == 0


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
    path.write_text("compare:\n  policy:\n    default: {max_accuracy_drop: 0.05, max_flip_rate: 0.1, kl_percentile: p99,"
                    " max_kl: 1.0, max_growth_excess_pct: 1.0, min_memory_saving_pct: 10.0}\n"
                    "    math: {max_accuracy_drop: 0.02}\n")
    policy = load_params(path).compare.policy_for("math")
    assert (policy.max_accuracy_drop, policy.max_flip_rate) == (0.02, 0.1)
    path.write_text("compare:\n  policy:\n    default: {max_accuracy_drop: 0.05}\n")
    with pytest.raises(QuantgateError, match="params.yaml:1: key 'compare': .*policy.default must set every limit; "
                                             "missing max_flip_rate"):
        load_params(path)
    path.write_text("compare:\n  policy:\n    maths: {max_accuracy_drop: 0.05}\n")
    with pytest.raises(QuantgateError, match="policy for unknown domain 'maths'"):
        load_params(path)
    path.write_text("route:\n  context_buckets: [256, 64]\n")
    with pytest.raises(QuantgateError, match="params.yaml:1: key 'route': .*increasing order"):
        load_params(path)
