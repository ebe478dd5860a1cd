"""judging/planning.py and doctor's `pools` row: the planned pass rate against the rule's own simulated one, at the
margin, as items grow and as families cap it; the items a pool is told it needs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.core.params import load_params
from pipelines.diagnose.check import OK, WARN
from pipelines.diagnose.pools import pools_check
from pipelines.judging import planning, sequential
from pipelines.judging.planning import pass_rate
from tests.test_doctor import write_params

RULE = dict(margin=0.05, alpha=0.025, spending="pocock")


def even(looks: list[int], groups: int | None) -> list[np.ndarray]:
    """Each look's family sizes, items spread evenly over `groups` families (None: every item its own)."""
    return [np.bincount(np.arange(n) % groups).astype(float) if groups else np.ones(n) for n in looks]


def test_the_planned_pass_rate_agrees_with_the_rule_simulated():
    """1,000 items in 36 declared families, independent items, a variant 2 points worse: the planner against 400
    runs of sequential.run_looks and verdict.judge (benchmarks/gate_operating.chunk), within 3 Monte-Carlo standard
    errors; the same planner without families declared is higher (t and the design effect's floor cost power)."""
    from benchmarks.gate_operating import chunk

    looks = sequential.plan(1000, 200, None, 3)
    counts = chunk(np.random.SeedSequence(5), 400, 1000, 36, True, 0.0, looks, -0.02, 0.025)
    simulated = counts["pass"] / 400
    planned = pass_rate(looks, even(looks, 36), drop=0.02, flip_rate=0.07, icc=0.0, **RULE)
    assert abs(planned - simulated) <= 3 * np.sqrt(simulated * (1 - simulated) / 400), (planned, simulated)
    assert pass_rate(looks, even(looks, None), drop=0.02, flip_rate=0.07, icc=0.0, **RULE) > planned + 0.02


def test_at_the_margin_the_plan_passes_about_alpha_and_more_items_pass_more():
    looks = sequential.plan(600, 200, None, 3)
    assert pass_rate(looks, even(looks, None), drop=0.05, flip_rate=0.10, icc=0.0, **RULE) == pytest.approx(0.025, abs=0.004)
    rates = [pass_rate(sequential.plan(n, 200, None, 3), even(sequential.plan(n, 200, None, 3), 36), drop=0.02,
                       flip_rate=0.07, icc=0.0, **RULE) for n in (400, 800, 1600)]
    assert rates[0] < rates[1] < rates[2] and rates[2] > 0.95
    one_family = pass_rate([600], [np.array([600.0])], drop=0.0, flip_rate=0.05, icc=0.0, **RULE)
    assert one_family == 0.0  # zero degrees of freedom: the rule cannot pass
    with pytest.raises(ValueError, match="flip rate"):
        pass_rate(looks, even(looks, None), drop=0.05, flip_rate=0.02, icc=0.0, **RULE)


def plan_of(items: int, groups: int, sizes: list[int] | None = None) -> dict:
    ids = [f"q{k}" for k in range(items)]
    labels = np.repeat(np.arange(len(sizes)), sizes) if sizes else np.arange(items) % groups
    return {"pool": items, "looks": sequential.plan(items, 200, None, 3), "order": sequential.ordered(ids, "t"),
            "families": {i: f"f{g}" for i, g in zip(ids, labels)}}


def with_icc(icc: float):
    p = load_params().compare
    return p.model_copy(update={"planning": p.planning.model_copy(update={"icc": icc, "power": 0.55})})


def test_a_pool_is_told_the_items_it_needs_or_that_it_needs_families():
    p = with_icc(0.01)
    enough = planning.pool_plan("chat", plan_of(1000, 36), p, 200, 3)
    assert enough["pass_rate"] >= 0.55 and enough["items_for_power"] == 1000 and enough["short_of"] is None
    assert enough["drop"] == pytest.approx(0.4 * 0.05) and enough["families"] == 36
    small_plan = plan_of(400, 36)
    small = planning.pool_plan("chat", small_plan, p, 200, 3)
    assert small["pass_rate"] < 0.55 < enough["pass_rate"]
    assert 400 < small["items_for_power"] <= 1000
    grown = sequential.plan(small["items_for_power"], 200, None, 3)
    whole = planning.look_family_sizes(small_plan["order"], small_plan["families"], [400])[0]
    assert pass_rate(grown, planning.scaled_sizes(whole, 400, grown), drop=0.02, flip_rate=0.07, icc=0.01,
                     **RULE) >= 0.55
    few = planning.pool_plan("math", plan_of(1000, 6), with_icc(0.08), 200, 3)
    assert few["items_for_power"] is None and few["short_of"] == "families"  # six families share their fate


def planning_params(tmp_path, icc: float, **evaluate):
    changes = {"compare": {"planning": {"drop_of_margin": 0.4, "flip_rate": 0.07, "icc": icc, "power": 0.55}}}
    return load_params(write_params(tmp_path, **changes, **({"evaluate": evaluate} if evaluate else {})))


def test_doctor_says_which_pools_are_short_and_what_would_size_them(tmp_path, monkeypatch):
    """The shipped pools are sized to the shipped plan (within-family correlation 0.025): every row reaches 0.55; the
    row warns only for the rows of the last compare whose flips crowded more (the committed run's: gptq3 code,
    0.0558). At twice the correlation the 25 math families cannot reach 0.55, and code needs about half as many items
    again; with independent flips every pool is sized; a cap of 300 items is not. Standard lm-eval task rows are never
    loaded for it (their datasets would be)."""
    from pipelines.diagnose import pools
    from pipelines.evaluation import standard_tasks

    monkeypatch.setattr(standard_tasks, "doc_count", lambda *a: pytest.fail("the doctor loaded a task's dataset"))
    shipped = pools_check(load_params())
    assert "Below" not in shipped.detail, shipped
    assert "math 2000 items/25 families" in shipped.detail and "code 1000 items/58 families" in shipped.detail
    assert "code_comment 1100 items/42 families" in shipped.detail
    rows = json.loads(pools.COMPARE_REPORT.read_text())["planning"]["rows"]  # whichever run results/ holds now
    crowded = [f"{v} {row} {icc:g}" for row, r in rows.items() for v, icc in sorted(r["observed_icc"].items())
               if icc is not None and icc > 0.025]
    assert (shipped.status == WARN) == bool(crowded) and all(c in shipped.detail for c in crowded), shipped
    assert ("set compare.planning.icc from compare.json" in shipped.remedy) == bool(crowded)
    doubled = pools_check(planning_params(tmp_path, 0.05))
    assert doubled.status == WARN, doubled
    assert "math: no number of items reaches 0.55 with its 25 families" in doubled.detail
    assert "code: about 1550 items (the pool has 1000)" in doubled.detail
    independent = pools_check(planning_params(tmp_path, 0.0))  # a judged row whose flips crowd at all is named
    assert independent.status == WARN and "Below" not in independent.detail and "awq4 math" in independent.detail
    monkeypatch.setattr(pools, "COMPARE_REPORT", tmp_path / "no-compare.json")  # a fresh run: nothing judged yet
    independent = pools_check(planning_params(tmp_path, 0.0))
    assert independent.status == OK and all(f"{row} " in independent.detail for row in ("math", "code", "chat"))
    capped = pools_check(planning_params(tmp_path, 0.0, max_items=300))
    assert capped.status == WARN and "the looks stop at 300: evaluate.max_items" in capped.detail


def test_rows_more_clustered_than_planned_are_named_from_the_last_compare(tmp_path):
    """Only judged rows of the same pools (items, families) above the plan's icc, by variant, finite numbers only; no
    compare.json, or one that is not compare's shape at any level, says nothing and never raises (the row only warns)."""
    from pipelines.diagnose.pools import more_clustered_than_planned

    now = {"math": {"items": 2000, "families": 25}, "chat": {"items": 1000, "families": 36},
           "code": {"items": 1000, "families": 58}}
    report = tmp_path / "compare.json"
    assert more_clustered_than_planned(0.025, now, report) == []
    for odd in (b"{not json", b"\xff\xfe", b"[1, 2]", b'{"planning": []}', b'{"planning": {"rows": [1]}}',
                b'{"planning": {"rows": {"math": {"items": 2000, "families": 25, "observed_icc": [0.5]}}}}',
                b'{"planning": {"rows": {"math": {"items": 2000, "families": 25, "observed_icc": 0.5}}}}'):
        report.write_bytes(odd)
        assert more_clustered_than_planned(0.025, now, report) == [], odd
    report.write_text(json.dumps({"planning": {"rows": {
        "math": {"items": 2000, "families": 25, "observed_icc": {"awq4": 0.01, "gptq3": 0.03, "int8": None,
                                                                   "x": True, "y": float("inf"), "z": "0.9"}},
        "chat": {"items": 1000, "families": 36, "observed_icc": {"gptq3": 0.025}},
        "code": {"items": 898, "families": 49, "observed_icc": {"gptq3": 0.2}},  # another pool: not this plan's evidence
        "code_comment": {"items": 1100, "families": 42, "observed_icc": {"gptq3": 0.2}}}}}))  # a row not planned now
    assert more_clustered_than_planned(0.025, now, report) == ["gptq3 math 0.03"]
    assert more_clustered_than_planned(0.005, now, report) == ["awq4 math 0.01", "gptq3 math 0.03", "gptq3 chat 0.025"]


def test_single_items_grow_in_number_and_an_empty_pool_is_named():
    p = load_params().compare
    ids = [f"q{k}" for k in range(50)]
    alone = {"pool": 50, "looks": [50], "order": ids, "families": {i: f"item:{i}" for i in ids}}
    r = planning.pool_plan("x", alone, p, 200, 3)
    assert r["pass_rate"] == r["pass_rate_independent"] and r["items_for_power"] == 500  # z, no design effect
    assert [len(s) for s in planning.scaled_sizes(np.ones(50), 50, [200, 500])] == [200, 500]
    empty = planning.pool_plan("x", {"pool": 0, "looks": [], "order": [], "families": {}}, p, 200, 3)
    assert empty["short_of"] == "empty" and empty["pass_rate"] == 0.0 and empty["items_for_power"] is None
