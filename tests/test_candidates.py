"""Third-party checkpoints: real autoawq and GPTQModel outputs pass; each kind of broken one fails precisely."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipelines import candidates, logs
from pipelines.models import VariantFailed, load_variant


@pytest.fixture(scope="module")
def direct_checkpoints(tmp_path_factory, tiny_model, tiny_calibration):
    """Checkpoints written by the libraries themselves, not through quantgate."""
    from awq import AutoAWQForCausalLM
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    texts = [json.loads(line)["text"] for line in (tiny_calibration / "mixed.jsonl").read_text().splitlines()]
    root = tmp_path_factory.mktemp("direct")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with logs.library_output("test"):
        awq = AutoAWQForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float16)
        awq.quantize(tok, quant_config={"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"},
                     calib_data=texts, max_calib_seq_len=96)
        awq.save_quantized(str(root / "awq"))
        tok.save_pretrained(root / "awq")
        gptq = GPTQModel.load(str(tiny_model), QuantizeConfig(bits=3, group_size=64), device="cpu")
        gptq.quantize(texts)
        gptq.save(str(root / "gptq"))
    return {"awq": root / "awq", "gptq": root / "gptq"}


def broken_copy(src, dest):
    shutil.copytree(src, dest)
    return dest


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_library_written_checkpoints_pass(direct_checkpoints, tiny_model, kind):
    report = candidates.validate(direct_checkpoints[kind], str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert report["method"] == kind and report["quantized_layers"] == 7  # q k v o gate up down of one layer
    assert set(report["files"]) >= {"config.json", "model.safetensors"}


def test_admitted_candidate_loads_like_a_variant(tmp_path, direct_checkpoints, tiny_model):
    manifest = candidates.admit("vendor-gptq", str(direct_checkpoints["gptq"]), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["method"] == "gptq" and manifest["settings"]["bits"] == 3
    model, tok = load_variant(tmp_path / "vendor-gptq")
    ids = tok("12+30=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_truncated_weights_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    report = candidates.validate(bad, str(tiny_model))
    assert not report["admitted"]
    assert any("model.safetensors: tensors end at byte" in r and "truncated" in r for r in report["reasons"])


def test_config_claiming_4_bits_over_3_bit_tensors_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"].update(bits=4))
    reasons = candidates.validate(bad, str(tiny_model))["reasons"]
    assert "model.layers.0.self_attn.q_proj.qweight: I32[6, 64] but quantization_config (bits=4, group_size=64) " \
           "and the base layer (64 -> 64) imply I32[8, 64]" in reasons


def test_nan_scales_fail(tmp_path, direct_checkpoints, tiny_model):
    from safetensors.torch import load_file, save_file

    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.scales"][0, 3] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    reasons = candidates.validate(bad, str(tiny_model))["reasons"]
    assert reasons == ["model.layers.0.mlp.up_proj.scales: 1 non-finite scale values (NaN/inf)"]


def test_pickle_file_beside_weights_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    torch.save({"x": 1}, bad / "optimizer.pt")
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x04")
    reasons = candidates.validate(bad, str(tiny_model))["reasons"]
    assert "optimizer.pt: pickle-based file refused (loading it can run code); only safetensors weights" in reasons
    assert any(r.startswith("pytorch_model.bin: pickle-based file refused") for r in reasons)


def test_auto_map_and_python_files_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}))
    (bad / "modeling_evil.py").write_text("import os\n")
    reasons = candidates.validate(bad, str(tiny_model))["reasons"]
    assert "config.json: auto_map ['AutoModelForCausalLM'] asks to run remote code; refused" in reasons
    assert "modeling_evil.py: Python file refused (remote code)" in reasons


def test_wrong_base_model_shapes_fail(tmp_path, direct_checkpoints, tiny_model):
    from safetensors.torch import load_file, save_file

    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:-8].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    reasons = candidates.validate(bad, str(tiny_model))["reasons"]
    assert reasons == ["model.embed_tokens.weight: shape [504, 64] but the base model has [512, 64]"]


def test_rejected_candidate_is_a_recorded_failure_not_a_crash(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    (bad / "extra.pkl").write_bytes(b"\x80")
    manifest = candidates.admit("vendor-awq", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed" and "extra.pkl: pickle-based file refused" in manifest["error"]
    assert [p.name for p in (tmp_path / "variants" / "vendor-awq").iterdir()] == ["quantgate.json"]
    with pytest.raises(VariantFailed, match="vendor-awq is not usable: validation failed: extra.pkl"):
        load_variant(tmp_path / "variants" / "vendor-awq")
