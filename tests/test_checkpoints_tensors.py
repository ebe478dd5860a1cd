"""Tensors against the base model and the format (names, dtypes, shapes), and their values."""

from __future__ import annotations

import torch

from pipelines.checkpoints import admission
from tests.checkpoint_helpers import broken_copy, edit_config, edit_tensors, reasons_of


def test_a_tensor_in_a_non_float_dtype_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t.update(
        {"model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.int32)}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.input_layernorm.weight: I32[64] but the base model has "
        "BF16/F16/F32/F64[64]"]


def test_compressed_tensors_weight_shape_that_lies_fails(tmp_path, ct_checkpoints, tiny_model):
    bad = broken_copy(ct_checkpoints["sym"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight_shape": torch.tensor([64, 128])}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.mlp.up_proj.weight_shape: [64, 128], but the base layer is "
        "[128, 64] (out, in)"]


def test_wrong_base_model_shapes_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t.update(
        {"model.embed_tokens.weight": t["model.embed_tokens.weight"][:-8].clone()}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.embed_tokens.weight: F16[504, 64] but the base model has BF16/F16/F32/F64[512, 64]"]


def test_unexpected_tensor_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors",
                 lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_A": torch.ones(4, 64, dtype=torch.float16)}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: unexpected tensor model.layers.0.self_attn.q_proj.lora_A F16[4, 64] "
        "(neither in the base model nor part of the gptq format)"]


def test_config_claiming_4_bits_over_3_bit_tensors_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"].update(bits=4))
    edit_config(bad, lambda c: c.update(bits=4), name="quantize_config.json")
    assert "model.safetensors: tensor model.layers.0.self_attn.q_proj.qweight: I32[6, 64] but quantization_config " \
           "(bits=4, group_size=64) and the base layer (64 -> 64) imply I32[8, 64]" in reasons_of(bad, tiny_model)


def test_inf_in_a_norm_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors",
                 lambda t: t["model.layers.0.post_attention_layernorm.weight"].__setitem__(7, float("inf")))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.post_attention_layernorm.weight: 1 NaN/inf values"]


def test_nan_scales_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors",
                 lambda t: t["model.layers.0.mlp.up_proj.scales"].__setitem__((0, 3), float("nan")))
    assert reasons_of(bad, tiny_model) == ["model.safetensors: tensor model.layers.0.mlp.up_proj.scales: 1 NaN/inf values"]


def test_out_of_range_g_idx_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")

    def corrupt(t):  # group_size 64 over 64 inputs: one group, so the only valid index is 0
        t["model.layers.0.self_attn.q_proj.g_idx"][5] = 1
        t["model.layers.0.self_attn.q_proj.g_idx"][9] = -1
    edit_tensors(bad / "model.safetensors", corrupt)
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.self_attn.q_proj.g_idx: 2 g_idx values outside [0, 1)"]


def test_g_idx_range_follows_the_group_count(tmp_path, direct_checkpoints, tiny_model):
    """group_size 32 over 128 inputs (down_proj) gives 4 groups: 3 is valid, 4 is not."""
    bad = broken_copy(direct_checkpoints["gptq_v2"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t["model.layers.0.mlp.down_proj.g_idx"].__setitem__(0, 4))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.mlp.down_proj.g_idx: 1 g_idx values outside [0, 4)"]
    edit_tensors(bad / "model.safetensors", lambda t: t["model.layers.0.mlp.down_proj.g_idx"].__setitem__(0, 3))
    assert admission.validate(bad, str(tiny_model))["admitted"]
