"""pipelines/store/layout.py in a recording: the parent run's per-type numbers, child descriptions, the saved view."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from pipelines.store import layout
from tests.store_helpers import runs_of, sqlite_store


def test_parent_run_carries_each_variants_numbers_per_request_type(recorded):
    """What MLflow's comparison of two pipeline runs (two experiments) puts side by side."""
    root, built, uri, summary = recorded
    parent = MlflowClient(uri).get_run(summary["parent_run_id"])
    m = parent.data.metrics
    assert m["math/awq4/accuracy"] == pytest.approx(240 / 400) and m["math/awq4/accuracy_fp16"] == pytest.approx(0.75)
    assert m["math/awq4/difference"] == pytest.approx(-60 / 400) and m["math/awq4/items"] == 400
    assert m["math/awq4/ci_low"] < m["math/awq4/difference"] < m["math/awq4/ci_high"]
    assert m["math/awq4/flip_rate"] == pytest.approx(60 / 400)
    assert m["code/int8/difference"] == pytest.approx(-1 / 400) and m["code/fp16/accuracy"] == pytest.approx(0.75)
    assert not any(k.startswith("math/fp16/") and k != "math/fp16/accuracy" for k in m)
    t = parent.data.tags
    assert (t["verdict.awq4"], t["verdict.awq4.math"], t["verdict.awq4.code"], t["verdict.int8.math"]) == \
        ("fail", "fail", "pass", "pass")


def test_child_description_names_the_deciding_numbers(recorded):
    root, built, uri, summary = recorded
    client, exp, runs = runs_of(uri)
    awq4 = next(r for r in runs if r.data.tags.get("quantgate.variant") == "awq4")
    text = awq4.data.tags["mlflow.note.content"]
    assert "**awq4: fail** against fp16" in text
    assert "| math | fail | -15.0 | [" in text and "| code | pass | +0.0 |" in text
    assert "- math: accuracy drops 0.150" in text


def saved_view(client, exp_id) -> tuple[dict, dict]:
    envelope = json.loads(client.get_experiment(exp_id).tags[layout.VIEW_TAG])
    return envelope, json.loads(envelope["state"])


def test_the_experiment_has_a_saved_view_of_verdicts_and_deciding_numbers(recorded):
    """MLflow 3.17's saved view (its "Views" menu, or the link `record` returns): verdict tag and deciding metric
    columns per request type, in that order; tests/test_mlflow_ui.py checks a browser shows it."""
    root, built, uri, summary = recorded
    client = MlflowClient(uri)
    envelope, state = saved_view(client, summary["experiment_id"])
    assert summary["view"] == f"#/experiments/{summary['experiment_id']}/runs?viewStateShareKey=quantgate-verdicts"
    assert envelope["name"] == layout.VIEW_NAME and isinstance(envelope["createdAt"], int)
    assert state["selectedColumns"] == [
        "tags.`verdict.math`", "tags.`verdict.code`", "metrics.`math/ci_low`", "metrics.`code/ci_low`",
        "metrics.`math/difference`", "metrics.`code/difference`", "metrics.`math/flip_rate`", "metrics.`code/flip_rate`",
        "metrics.`math/kl/p99`", "metrics.`code/kl/p99`", "metrics.`memory/growth_excess_pct`"]
    assert state["columnOrder"] == ["attributes.`Run Name`", *state["selectedColumns"]]
    # recording other results with another request type keeps the earlier ones; nothing changes when nothing is new
    envelope["state"] = json.dumps({**state, "selectedColumns": state["selectedColumns"][:1]})  # as if a person saved it
    client.set_experiment_tag(summary["experiment_id"], layout.VIEW_TAG, json.dumps(envelope))
    report = {"domains": ["sql"], "variants": {}}
    layout.write_verdict_view(client, summary["experiment_id"], report)
    assert saved_view(client, summary["experiment_id"])[1]["selectedColumns"] == state["selectedColumns"][:1]  # theirs


def test_the_saved_view_grows_with_new_request_types(tmp_path):
    uri = sqlite_store(tmp_path)
    client = MlflowClient(uri)
    exp_id = client.create_experiment("views", artifact_location=(tmp_path / "a").as_uri())
    layout.write_verdict_view(client, exp_id, {"domains": ["math", "code"], "variants": {}})
    first = client.get_experiment(exp_id).tags[layout.VIEW_TAG]
    layout.write_verdict_view(client, exp_id, {"domains": ["math", "code"], "variants": {}})
    assert client.get_experiment(exp_id).tags[layout.VIEW_TAG] == first  # unchanged: not rewritten
    report = {"domains": ["sql"], "variants": {"int8": {"domains": {"sql": {"checks": {"kl": {"percentile": "p95"}}}}}}}
    layout.write_verdict_view(client, exp_id, report)
    envelope, state = saved_view(client, exp_id)
    tags = [c for c in state["selectedColumns"] if c.startswith("tags.")]
    assert tags == ["tags.`verdict.math`", "tags.`verdict.code`", "tags.`verdict.sql`"]
    assert "metrics.`sql/kl/p95`" in state["selectedColumns"] and envelope["createdAt"] == json.loads(first)["createdAt"]


def test_a_model_replayed_through_its_endpoint_logs_its_client_side_latency():
    """shadow_metrics.json's client_ms (pipelines/shadow.py) reaches the shadow child's metrics and latency table."""
    shadow = {"models": {"fp16": {"status": "ok"}, "vendor": {"status": "ok"}}}
    measured = {"models": {
        "fp16": {"latency": {"ttft_ms": {"p50": 10.0, "p99": 40.0}, "tpot_ms": {"p50": 2.0, "p99": 7.0},
                             "tokens_per_s": 900.0}, "memory": None, "seconds": 3.0},
        "vendor": {"latency": {"client_ms": {"p50": 120.5, "p99": 480.0}}, "endpoint": "http://10.0.0.5:8000/v1",
                   "memory": None, "seconds": 9.0}}}
    metrics = layout.shadow_metrics(shadow, measured)
    assert (metrics["latency/vendor/client_ms_p50"], metrics["latency/vendor/client_ms_p99"]) == (120.5, 480.0)
    assert "latency/fp16/client_ms_p50" not in metrics and "latency/vendor/ttft_ms_p50" not in metrics
    rows = {r["model"]: r for r in layout.shadow_latency_rows(shadow, measured)}
    assert (rows["vendor"]["client_ms_p99"], rows["vendor"]["endpoint"]) == (480.0, "http://10.0.0.5:8000/v1")
    assert rows["fp16"]["client_ms_p50"] is None and rows["fp16"]["ttft_ms_p99"] == 40.0
