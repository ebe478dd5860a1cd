"""Shared fixtures: the tests' tiny model, built once per session, offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

# Small enough to train in seconds, shaped like the reference model (multiples of 64 for GPTQ/AWQ groups).
TINY_REFERENCE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "layers": 1, "heads": 2, "kv_heads": 1,
    "max_position_embeddings": 128, "seq_len": 32, "batch_size": 8, "steps": 30, "held_out_additions": 50,
    "math_lines": 200, "dialogues": 48, "code_repeats": 1, "addition_repeats": 1, "eval_items": 20, "threads": 1,
}


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Stages resolve shipped sources relative to the repository root, as `dvc repro` runs them."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="session")
def tiny_params():
    from pipelines.params import ReferenceParams

    return ReferenceParams(**TINY_REFERENCE)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tiny_params) -> Path:
    """A tiny Llama checkpoint (safetensors + tokenizer) trained by the reference stage's own code."""
    from pipelines import reference

    os.chdir(ROOT)
    out = tmp_path_factory.mktemp("tiny") / "model"
    reference.build(tiny_params, out, out.parent / "reference.json")
    return out
