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


def test_in_a_profiles_workspace_a_bad_key_also_names_the_profile_file(tmp_path):
    import json

    from pipelines.core.paths import PROFILE_MARKER

    path = write(tmp_path, "model: reference\nreference:\n  seed: 1\n  stpes: 10\n")
    (tmp_path / PROFILE_MARKER).write_text(json.dumps({"profile": "smollm2", "store_root": "/the/checkout"}))
    with pytest.raises(QuantgateError) as err:
        load_params(path)
    assert str(err.value) == (f"{path}:4: unknown key 'reference.stpes' (misspelled? see docs/params.md) (this "
                              "workspace's params.yaml is written from /the/checkout/params.yaml with profiles/smollm2.yaml "
                              "merged over it: edit those, then `bash scripts/run.sh --model smollm2` there)")


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
    with pytest.raises(QuantgateError, match="params.yaml:2: key 'route.context_buckets': .*increasing order"):
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
     r"requests.math.classify': .*unknown name 'answer'; use a pattern name \(arithmetic, ask, [a-z, ]*symbol\)"),
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


def with_setting(key: str, value) -> dict:
    """The shipped params.yaml with one key (dotted, created where missing) set to `value`."""
    data = shipped_params()
    *parents, last = key.split(".")
    node = data
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return data


# Each value switches a check off, makes it vacuous or cannot be honoured: refused, naming the key and its range
RANGE_POLICY = r"must be in \[0, 100\)"
REFUSED = [
    ("compare.policy.default.min_memory_saving_pct", -5.0, RANGE_POLICY),
    ("compare.policy.default.min_memory_saving_pct", 100.0, RANGE_POLICY),
    ("compare.policy.default.max_growth_excess_pct", -1.0, RANGE_POLICY),
    ("compare.policy.default.max_accuracy_drop", 0.0, r"must be in \(0, 0.5\)"),
    ("compare.policy.default.max_accuracy_drop", 0.5, r"must be in \(0, 0.5\)"),
    ("compare.policy.default.max_flip_rate", 0.0, r"must be in \(0, 1\)"),
    ("compare.policy.default.max_flip_rate", 1.5, r"must be in \(0, 1\)"),
    ("compare.policy.default.max_flip_rate", 1.0, r"1 never fails one"),
    ("audit.items", 2, r"greater than or equal to 4"),
    ("audit.kl_tolerance", 1.0, r"less than or equal to 0.1"),
    ("compare.policy.default.max_kl", 0.0, r"must be in \(0, 5\]"),
    ("compare.policy.default.max_kl", 50.0, r"must be in \(0, 5\]"),
    ("compare.policy.default.max_kl", float("inf"), "finite number"),
    ("compare.policy.default.max_kl", float("nan"), "finite number"),
    ("compare.policy.default.kl_percentile", "p50", "mean"),
    ("requests.math.policy.max_accuracy_drop", 0.6, r"must be in \(0, 0.5\)"),  # a type's own limits: same bounds
    ("requests.code.policy.min_memory_saving_pct", -1.0, RANGE_POLICY),
    ("compare.confidence", 0.7, r"must be in \[0.8, 1\)"),
    ("compare.confidence", 1.0, r"must be in \[0.8, 1\)"),
    ("compare.power", 0.3, "greater than 0.5"),
    ("compare.planning.drop_of_margin", 0.0, "greater than 0"),
    ("compare.planning.drop_of_margin", 1.0, "less than 1"),
    ("compare.planning.flip_rate", 0.0, "greater than 0"),
    ("compare.planning.flip_rate", 1.5, "less than or equal to 1"),
    ("compare.planning.icc", -0.1, "greater than or equal to 0"),
    ("compare.planning.icc", 1.0, "less than 1"),
    ("compare.planning.power", 0.5, "greater than 0.5"),
    ("compare.planning.power", 1.0, "less than 1"),
    ("compare.planning.icc", float("nan"), "finite number"),
    ("memory.leak_tolerance_pct", 0.0, r"must be in \(0, 5\]"),
    ("memory.leak_tolerance_pct", 1000.0, r"must be in \(0, 5\]"),
    ("memory.noise_floor_bytes", 10**9, r"must be in \[0, 16384\]"),
    ("memory.noise_floor_bytes", -1, r"must be in \[0, 16384\]"),
    ("memory.timeout_seconds", 0, "greater than 0"),
    ("quantize.timeout_seconds", -1, "greater than 0"),
    ("evaluate.timeout_seconds", 0, "greater than 0"),
    ("fanout.timeout_margin_seconds", 0, "greater than 0"),
    ("evaluate.domains", [], "empty: evaluating nothing would let the gate decide on nothing"),
    ("evaluate.domains", ["math", "code", "math"], "'math' is listed twice"),
    ("evaluate.look_items", 0, "greater than 0"),
    ("evaluate.max_looks", 0, "greater than or equal to 1"),
    ("evaluate.fidelity_texts", 0, "greater than 0"),
    ("evaluate.allow_unisolated_code", "yes", "valid boolean"),
    ("calibration.exclude", ["code", "code"], "'code' is listed twice"),
    ("calibration.samples", 0, "greater than 0"),
    ("coverage.on_gap", "ignore", "'warn' or 'fail'"),
    ("coverage.min_classifier_accuracy", 0.0, r"must be in \(0, 1\]"),
    ("coverage.min_classifier_accuracy", 1.5, r"must be in \(0, 1\]"),
    ("coverage.min_share_ratio", 0.0, r"must be in \(0, 1\]"),
    ("route.context_buckets", [64, 64, 256], "strictly increasing"),
    ("route.context_buckets", [0, 64], "positive"),
    ("mlflow.experiment", "", "at least 1 character"),
]


@pytest.mark.parametrize("key, value, message", REFUSED, ids=[f"{k}={v!r}" for k, v, _ in REFUSED])
def test_a_limit_out_of_range_is_refused_naming_key_and_range(tmp_path, key, value, message):
    path = write_params(tmp_path / "params.yaml", with_setting(key, value))
    with pytest.raises(QuantgateError, match=rf"params.yaml:\d+: key '{key}': .*{message}"):
        load_params(path)


# Checks across keys: the section is named, the message names the keys (a type's policy is merged under compare)
ACROSS = [
    ("compare.policy.default.max_growth_excess_pct", 20.0, "compare.policy.default: max_growth_excess_pct 20 must be "
                                                           "at most min_memory_saving_pct 10"),
    ("requests.math.policy.max_growth_excess_pct", 50.0, "requests.math.policy: max_growth_excess_pct 50 must be at "
                                                         "most min_memory_saving_pct 10"),
    ("memory.tail_rounds", 20, r"need memory.tail_rounds <= memory.rounds <= memory.max_rounds, got 20, 12, 48"),
    ("memory.max_rounds", 11, r"need memory.tail_rounds <= memory.rounds <= memory.max_rounds, got 8, 12, 11"),
    ("memory.short_fraction", 0.95, "memory.short_fraction 0.95 must be below long_fraction 0.9"),
    ("calibration.samples", 3, r"calibration.samples 3 gives 'chat' \(weight 1\) no sample"),
    ("calibration.weights", {"math": -1.0}, "calibration.weights.math: must be >= 0"),
    ("calibration.min_tokens", 200, "calibration.min_tokens 200 is above calibration.max_tokens 192"),
    ("calibration.exclude", ["maths"], "unknown request type 'maths' in calibration.exclude"),
    ("evaluate.domains", ["math", "sql"], "unknown request type 'sql' in evaluate.domains"),
    ("audit", {"items": 4, "max_mismatched_items": 2}, r"audit.max_mismatched_items \(2\) must be under half of "
                                                        r"audit.items \(4\)"),
]


@pytest.mark.parametrize("key, value, message", ACROSS, ids=[f"{k}={v!r}" for k, v, _ in ACROSS])
def test_limits_that_contradict_each_other_are_refused_naming_the_keys(tmp_path, key, value, message):
    path = write_params(tmp_path / "params.yaml", with_setting(key, value))
    section = "compare" if key.startswith("requests.") else key.split(".")[0]
    with pytest.raises(QuantgateError, match=rf"params.yaml:\d+: key '{section}': value error, {message}"):
        load_params(path)


def test_the_edges_of_every_range_are_accepted(tmp_path):
    """The bounds refuse only what disables a check: each allowed extreme loads and is kept as written."""
    edges = {"compare.policy.default.min_memory_saving_pct": 0.0, "compare.policy.default.max_growth_excess_pct": 0.0,
             "compare.policy.default.max_flip_rate": 0.999, "compare.policy.default.max_kl": 5.0,
             "compare.policy.default.max_accuracy_drop": 0.499, "compare.confidence": 0.8,
             "memory.leak_tolerance_pct": 5.0, "memory.noise_floor_bytes": 16384, "coverage.min_share_ratio": 1.0,
             "coverage.min_classifier_accuracy": 1.0, "evaluate.allow_unisolated_code": True,
             "evaluate.domains": ["code"], "calibration.samples": 4, "route.context_buckets": [1, 2],
             "compare.planning.flip_rate": 1.0, "compare.planning.icc": 0.0}
    data = shipped_params()
    for key, value in edges.items():
        *parents, last = key.split(".")
        node = data
        for name in parents:
            node = node[name]
        node[last] = value
    params = load_params(write_params(tmp_path / "params.yaml", data))
    for key, value in edges.items():
        got = params
        for name in key.split("."):
            got = got[name] if isinstance(got, dict) else getattr(got, name)
        assert got == value, key
    # a request type's growth allowance may rise with its own saving floor
    data["requests"]["math"]["policy"] = {"max_growth_excess_pct": 40.0, "min_memory_saving_pct": 40.0}
    assert load_params(write_params(tmp_path / "params.yaml", data)).compare.policy_for("math").max_growth_excess_pct == 40


@pytest.mark.parametrize("key, value, named", [
    ("evaluate.domains", [], r"key 'evaluate.domains': value error, empty: evaluating nothing"),
    ("compare.policy.default.min_memory_saving_pct", -10.0,
     r"key 'compare.policy.default.min_memory_saving_pct': value error, must be in \[0, 100\)"),
])
def test_the_gate_refuses_bad_params_before_deciding(tmp_path, key, value, named):
    """`quantgate gate` on a params.yaml that would switch a check off: exit 2 naming the key, never a pass."""
    import json
    import re
    import subprocess
    import sys

    write_params(tmp_path / "params.yaml", with_setting(key, value))
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "gate"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(r"params.yaml:\d+: " + named, out.stdout + out.stderr), out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    result = json.loads((tmp_path / "results" / "gate.json").read_text())
    assert result["verdict"] == "undecided" and result["exit_code"] == 2
    assert any(re.search(named, reason) for reason in result["reasons"])
