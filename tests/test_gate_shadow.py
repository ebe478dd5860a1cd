"""`quantgate gate` and the models as served: report.md shows the shadow replay's agreement behind each routed row, a
variant whose replay failed, or that the replay refused for every request type, fails the release, and a served model
whose server answers otherwise than when it was evaluated leaves it undecided."""

from __future__ import annotations

import pytest

from pipelines import gate
from pipelines.core.io import read_json, write_json
from tests.handmade import rerun_compare, write_pipeline, write_shadow
from tests.store_helpers import answers, run_gate


def test_the_report_shows_the_shadow_replay_behind_the_routing(repo):
    write_pipeline(repo, answers())
    write_shadow(repo, {"int8": {"math": 0.9, "code": 0.8}, "awq4": {"code": 0.3}})
    rerun_compare(repo)  # route listens: awq4 passed code but agrees too rarely with fp16 there
    code, _, report = run_gate("--variant", "int8")
    assert code == 0 and "### Shadow replay" in report
    assert "| math | 64 | int8 | 40 (64) | 0.900 [0.800, 1.000] | met (0.50) |" in report
    assert "| code | 256 | int8 | 40 (all) | 0.800 [0.700, 0.900] | met (0.50) |" in report  # no 256 bucket replayed
    assert ("- refused by the replay: awq4 for code (≤ 64, 256 tokens): shadow agreement 0.30 [0.20, 0.40] on 40 "
            "replayed code requests: its low end is below 0.50") in report


def test_a_variant_whose_replay_failed_or_was_refused_everywhere_fails(repo):
    """compare passed int8 on both types, but its shadow replay crashed: that is int8's failure, not a pass. A variant
    the replay refused for every type compare passed it for fails too; one that only lost to a cheaper one does not."""
    write_pipeline(repo, answers())
    write_shadow(repo, {"int8": {"math": 0.9, "code": 0.8}})
    shadow = read_json(repo / "results/shadow.json")
    shadow["models"]["int8"] = {"status": "failed", "error": "replay int8: killed by signal 9"}
    write_json(repo / "results/shadow.json", shadow)
    rerun_compare(repo)
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["verdict"]) == (1, "fail")
    assert "int8: shadow replay failed: replay int8: killed by signal 9" in result["reasons"]
    write_shadow(repo, {"int8": {"math": 0.3, "code": 0.2}})
    rerun_compare(repo)
    code, result, _ = run_gate("--variant", "int8")
    assert (code, result["verdict"]) == (1, "fail")
    assert any(r.startswith("int8: the shadow replay refused it for every request type compare passed it for")
               for r in result["reasons"])
    write_shadow(repo, {"int8": {"math": 0.9, "code": 0.8}})
    rerun_compare(repo)
    assert run_gate("--variant", "int8")[0] == 0


def test_a_served_model_that_changed_since_it_was_evaluated_cannot_pass(repo, monkeypatch):
    """The gate asks each gated endpoint's server again (pipelines/evaluation/redeploy.py, against a real server in
    tests/test_endpoints.py): what it reports makes the verdict undecided, and the audit is not run on top."""
    from pipelines.evaluation import redeploy

    write_pipeline(repo, answers())
    asked = []
    said = "candidate int8: http://10.0.0.5:8000/v1 (int8) now serves another model than was evaluated"
    monkeypatch.setattr(redeploy, "stale_endpoints", lambda params, names: asked.append(names) or [said])
    monkeypatch.setattr(gate, "_audit", lambda *a: pytest.fail("audited a result the server already made undecided"))
    code, result, report = run_gate("--variant", "int8", "--audit")
    assert (code, result["verdict"]) == (2, "undecided") and asked == [["int8"]]
    assert result["reasons"][1] == f"  {said}" and "DVC hashes its deployment spec" in result["reasons"][0]
    monkeypatch.setattr(redeploy, "stale_endpoints", lambda params, names: asked.append(names) or [])
    assert run_gate("--variant", "int8")[0] == 0
    run_gate("--variant", "int8", "--variant", "awq4")  # awq4 fails in compare.json: its server cannot change that
    assert asked[-1] == ["int8"]
