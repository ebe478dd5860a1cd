"""What an admission records: a refused candidate's manifest, with nothing of its bytes left, and a failure
recorded from outside the stage."""

from __future__ import annotations

import json

import pytest

from pipelines.checkpoints import admission
from pipelines.checkpoints.manifest import record_failure
from pipelines.core.paths import MANIFEST
from pipelines.models.loading import VariantFailed, load_variant
from tests.checkpoint_helpers import broken_copy, edit_tensors


def test_rejected_candidate_is_a_recorded_failure_not_a_crash(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors",
                 lambda t: t["model.norm.weight"].__setitem__(0, float("nan")))
    manifest = admission.admit("vendor-awq", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed"
    assert manifest["error"] == "validation failed: model.safetensors: tensor model.norm.weight: 1 NaN/inf values"
    # the copy was written during the one read; a rejection removes it
    assert [p.name for p in (tmp_path / "variants" / "vendor-awq").iterdir()] == ["quantgate.json"]
    with pytest.raises(VariantFailed, match="vendor-awq is not usable: validation failed: model.safetensors"):
        load_variant(tmp_path / "variants" / "vendor-awq")


def test_an_admission_that_died_outside_the_stage_is_recorded_as_failed(tmp_path):
    """`quantgate fanout` records a killed admission: the manifest says why, the killed run's temp folder goes."""
    (tmp_path / ".vendor.x1y2.tmp").mkdir()  # atomic_dir's temp folder of a killed process
    manifest = record_failure("vendor", "/nowhere/vendor", "/base", "admit@vendor died (exit 137)", tmp_path)
    assert manifest == {"variant": "vendor", "candidate": True, "source_path": "/nowhere/vendor", "base_model": "/base",
                        "status": "failed", "reasons": ["admit@vendor died (exit 137)"],
                        "validation": {"admitted": False, "reasons": ["admit@vendor died (exit 137)"]},
                        "error": "admit@vendor died (exit 137)"}
    assert json.loads((tmp_path / "vendor" / MANIFEST).read_text()) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vendor"]
