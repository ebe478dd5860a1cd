"""The tests' tiny model and what is built from it (tests/conftest.py imports these fixtures, which is how pytest finds
them): trained, calibrated, quantized and evaluated by the stages' own code, offline, and kept by content
(tests/content_cache.py). Their entries are keyed by this file, not by conftest.py: a change to the tiers, hooks or
other fixtures there does not train the model again and rebuild everything made from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # (conftest's; not imported from it: conftest imports this module)
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # what the entries below are keyed by (`helpers`)


# Small enough to train in seconds, shaped like the reference model: every linear width a multiple of 64
# (the default GPTQ/AWQ group size 32 divides it; autoawq's clip search also needs output widths divisible by 64).
TINY_REFERENCE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "layers": 1, "heads": 2, "kv_heads": 2,
    "max_position_embeddings": 512, "seq_len": 32, "batch_size": 8, "steps": 30, "held_out_additions": 50,
    "math_lines": 200, "dialogues": 48, "code_repeats": 1, "function_repeats": 1, "addition_repeats": 1,
    "eval_items": 20, "threads": 1,
    "commented_functions": 200, "commented_repeats": 1, "comment_channels": 8,
}


@pytest.fixture(scope="session")
def tiny_params():
    from pipelines.core.params_sections import ReferenceParams

    return ReferenceParams(**TINY_REFERENCE)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tiny_params) -> Path:
    """A tiny Llama checkpoint (safetensors + tokenizer) trained by the reference stage's own code."""
    from pipelines import reference
    from tests.content_cache import cached

    def build(folder: Path) -> Path:
        reference.build(tiny_params, folder / "model", folder / "reference.json")
        return folder / "model"

    os.chdir(ROOT)
    return cached(tmp_path_factory, "tiny_model", build, code=["reference"], helpers=[HERE],
                  settings=tiny_params.model_dump(), source=True)


@pytest.fixture(scope="session")
def tiny_calibration(tmp_path_factory, tiny_model) -> Path:
    """A small mixed calibration set built by the calibrate stage's code with the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    from pipelines import calibrate
    from pipelines.core.params_sections import CalibrationParams, CoverageParams
    from tests.content_cache import cached

    def build(folder: Path) -> Path:
        calibrate.run(CalibrationParams(samples=32, max_tokens=96), CoverageParams(),
                      AutoTokenizer.from_pretrained(tiny_model), "tiny", folder / "built", folder / "coverage")
        return folder / "built"

    os.chdir(ROOT)
    return cached(tmp_path_factory, "tiny_calibration", build, code=["calibrate"], helpers=[HERE],
                  inputs=[tiny_model.parent], source=True)


@pytest.fixture(scope="session")
def tiny_variants(tmp_path_factory, tiny_model, tiny_calibration) -> dict[str, Path]:
    """The four default variants of the tiny model, made by the quantize stage's code."""
    from pipelines import quantize
    from pipelines.core import logs
    from pipelines.core.params_sections import DEFAULT_VARIANTS
    from pipelines.models.loading import ModelSource
    from tests.content_cache import cached

    def build(folder: Path) -> dict[str, Path]:
        source = ModelSource("local", str(tiny_model))
        for name, settings in DEFAULT_VARIANTS.items():
            manifest, _ = quantize.quantize_variant(name, settings, source, tiny_calibration, "cpu", folder)
            assert manifest["status"] == "ok", manifest.get("error")
        return {name: folder / name for name in DEFAULT_VARIANTS}

    logs.setup(log_file=tmp_path_factory.mktemp("logs") / "quantgate.log")
    return cached(tmp_path_factory, "tiny_variants", build, code=["quantize"], helpers=[HERE],
                  inputs=[tiny_model.parent, tiny_calibration.parent], settings=DEFAULT_VARIANTS, source=True)


@pytest.fixture(scope="session")
def log_evidence(tmp_path_factory, tiny_variants):
    """fp16's baseline and int8 evaluated here, and int8's and fp16's lm-eval sample logs written by the real
    `lm_eval` command (tests/test_sample_logs.py, tests/test_baseline_log.py); kept by content (tests/content_cache.py).
    `tmp` is this session's own folder, for edited copies of the logs."""
    from pipelines.evaluation import harness
    from pipelines.evaluation.plans import by_id, correctness, probe_plans
    from tests.content_cache import cached
    from tests.sample_log_helpers import COMPARE, DOMAINS, P, lm_eval_log

    plan = probe_plans(DOMAINS, P)

    def build(folder: Path) -> dict:
        base_result, base_items = harness.evaluate_variant(str(tiny_variants["fp16"]), plan, P, "cpu",
                                                           folder / "base.st")
        answers = {d: correctness(by_id(base_items, d)) for d in DOMAINS}
        int8 = harness.evaluate_variant(str(tiny_variants["int8"]), plan, P, "cpu", folder / "base.st", answers,
                                        COMPARE)
        logs = {name: lm_eval_log(tiny_variants[name], folder / f"{name}-log", plan, ROOT, P.batch_size)
                for name in ("int8", "fp16")}
        return {"base": (base_result, base_items), "int8": int8, "logs": logs}

    evidence = cached(tmp_path_factory, "log_evidence", build, code=["evaluation.harness", "evaluation.plans"],
                      helpers=[HERE, "tests/sample_log_helpers.py"],
                      inputs=[next(iter(tiny_variants.values())).parent],
                      settings=[DOMAINS, P.model_dump(), COMPARE.model_dump()])
    return {**evidence, "plan": plan, "tmp": tmp_path_factory.mktemp("sample_logs")}
