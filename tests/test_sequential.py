"""judging/sequential.py: the look plan and each domain's fixed evaluation order (the looks' decisions
through compare are in test_compare.py)."""

from __future__ import annotations

from pipelines.judging import sequential


def test_look_plan_and_order():
    assert sequential.plan(1000, 200, None) == [200, 600, 1000]
    assert sequential.plan(800, 200, None, max_looks=4) == [200, 400, 600, 800]
    assert sequential.plan(700, 200, 500) == [200, 350, 500]
    assert sequential.plan(150, 200, None) == [150] and sequential.plan(900, 200, None, max_looks=1) == [900]
    assert sequential.plan(0, 200, None) == []
    ids = [f"x-{i}" for i in range(50)]
    order = sequential.ordered(ids, "math")
    assert sorted(order) == sorted(ids) and order != ids  # a fixed shuffle, whatever the file's order
    assert order == sequential.ordered(list(reversed(ids)), "math")
    assert sequential.ordered(ids, "code") != order  # each domain has its own
