"""Shared fixtures: the tests' tiny model, built once per session, offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

# Small enough to train in seconds, shaped like the reference model: every linear width a multiple of 64
# (the default GPTQ/AWQ group size 32 divides it; autoawq's clip search also needs output widths divisible by 64).
TINY_REFERENCE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "layers": 1, "heads": 2, "kv_heads": 2,
    "max_position_embeddings": 512, "seq_len": 32, "batch_size": 8, "steps": 30, "held_out_additions": 50,
    "math_lines": 200, "dialogues": 48, "code_repeats": 1, "function_repeats": 1, "addition_repeats": 1, "eval_items": 20, "threads": 1,
    "commented_functions": 200, "commented_repeats": 1, "comment_channels": 8,
}


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Stages resolve shipped sources relative to the repository root, as `dvc repro` runs them."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="session")
def tiny_params():
    from pipelines.core.params import ReferenceParams

    return ReferenceParams(**TINY_REFERENCE)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tiny_params) -> Path:
    """A tiny Llama checkpoint (safetensors + tokenizer) trained by the reference stage's own code."""
    from pipelines import reference

    os.chdir(ROOT)
    out = tmp_path_factory.mktemp("tiny") / "model"
    reference.build(tiny_params, out, out.parent / "reference.json")
    return out


@pytest.fixture(scope="session")
def tiny_calibration(tmp_path_factory, tiny_model) -> Path:
    """A small mixed calibration set built by the calibrate stage's code with the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    from pipelines import calibrate
    from pipelines.core.params import CalibrationParams, CoverageParams

    os.chdir(ROOT)
    out = tmp_path_factory.mktemp("calib")
    calibrate.run(CalibrationParams(samples=32, max_tokens=96), CoverageParams(),
                  AutoTokenizer.from_pretrained(tiny_model), "tiny", out / "built", out / "coverage")
    return out / "built"


@pytest.fixture(scope="session")
def tiny_variants(tmp_path_factory, tiny_model, tiny_calibration) -> dict[str, Path]:
    """The four default variants of the tiny model, made by the quantize stage's code."""
    from pipelines.core import logs
    from pipelines import quantize
    from pipelines.models.loading import ModelSource
    from pipelines.core.params import DEFAULT_VARIANTS

    logs.setup(log_file=tmp_path_factory.mktemp("logs") / "quantgate.log")
    root = tmp_path_factory.mktemp("variants")
    source = ModelSource("local", str(tiny_model))
    for name, settings in DEFAULT_VARIANTS.items():
        manifest, _ = quantize.quantize_variant(name, settings, source, tiny_calibration, "cpu", root)
        assert manifest["status"] == "ok", manifest.get("error")
    return {name: root / name for name in DEFAULT_VARIANTS}
