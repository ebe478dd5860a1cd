"""The quantization config: every file a loader reads must agree and hold only allow-listed keys;
only the admitted methods and formats pass."""

from __future__ import annotations

import json

import pytest

from pipelines.checkpoints import admission, quant_config
from pipelines.core import logs
from tests.checkpoint_helpers import broken_copy, edit_config, reasons_of


def test_compressed_tensors_asymmetric_is_refused_because_it_does_not_load(tmp_path, ct_checkpoints, tiny_model):
    """The library's own asymmetric checkpoint fails to load here (packed zero points, size mismatch): refused."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"), logs.library_output("test"):
        AutoModelForCausalLM.from_pretrained(ct_checkpoints["asym"], device_map="cpu")
    assert reasons_of(ct_checkpoints["asym"], tiny_model)[0].startswith(
        "config.json: compressed-tensors: config_groups.group_0: asymmetric pack-quantized weights: transformers 5.24")


def test_compressed_tensors_format_that_lies_fails(tmp_path, ct_checkpoints, tiny_model):
    """Packed int4 tensors under a config that says naive-quantized (one int8 per weight): the group's own format
    contradicts it; said in the group too, the tensors tell."""
    bad = broken_copy(ct_checkpoints["sym"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"].update(format="naive-quantized"))
    assert reasons_of(bad, tiny_model) == [
        "config.json: compressed-tensors: config_groups.group_0: format 'pack-quantized', but the config's format is "
        "'naive-quantized' (only a 'mixed-precision' config may name another per group)"]
    edit_config(bad, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="naive-quantized"))
    assert "tensor model.layers.0.self_attn.q_proj.weight: missing (its compressed-tensors scheme and the base layer " \
           "(64 -> 64) imply I8[64, 64])" in reasons_of(bad, tiny_model)


def test_other_quantization_methods_are_refused(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda c: c.update(quantization_config={"quant_method": "hqq", "nbits": 4}))
    assert reasons_of(bad, tiny_model) == [
        "config.json quantization_config: quant_method 'hqq' is not one of ['awq', 'bitsandbytes', "
        "'compressed-tensors', 'gptq']"]


def test_quantize_config_contradicting_config_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, lambda c: c.update(bits=4), name="quantize_config.json")
    assert reasons_of(bad, tiny_model) == [
        "config.json quantization_config: bits 3, but quantize_config.json says bits 4 (the loaders read different "
        "files; they must agree)"]


@pytest.mark.parametrize("name,change,reason", [
    ("quantize_config.json", lambda c: c.update(checkpoint_format="gptq_v2", format="gptq_v2"),
     "config.json quantization_config: checkpoint_format 'gptq', but quantize_config.json says checkpoint_format "
     "'gptq_v2'"),
    ("quantize_config.json", lambda c: c.update(sym=not c["sym"]), "config.json quantization_config: sym "),
    ("quantize_config.json", lambda c: c.update(quant_method="awq", method="awq"),
     "config.json quantization_config: quant_method 'gptq', but quantize_config.json says quant_method 'awq'"),
    ("quantize_config.json", lambda c: c.update(desc_act=not c["desc_act"]),
     "config.json quantization_config: desc_act "),
    ("quantize_config.json", lambda c: c.update(format="gptq_v2"),  # one file, two spellings of one key
     "quantize_config.json: checkpoint_format 'gptq' but format 'gptq_v2'"),
])
def test_quantization_configs_that_disagree_fail(tmp_path, direct_checkpoints, tiny_model, name, change, reason):
    """GPTQModel reads quantize_config.json first, transformers config.json: a difference is refused, key named."""
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, change, name=name)
    reasons = reasons_of(bad, tiny_model)
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons


def test_quant_config_json_is_read_like_gptqmodel_reads_it(tmp_path, direct_checkpoints, tiny_model):
    """quant_config.json is GPTQModel's second choice (gptqmodel/quantization/config.py): it must agree too."""
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    side = json.loads((bad / "quantize_config.json").read_text())
    (bad / "quantize_config.json").unlink()
    (bad / "quant_config.json").write_text(json.dumps({**side, "group_size": 32}))
    assert reasons_of(bad, tiny_model) == [
        "config.json quantization_config: group_size 64, but quant_config.json says group_size 32 (the loaders "
        "read different files; they must agree)"]
    (bad / "quant_config.json").write_text(json.dumps(side))
    assert admission.validate(bad, str(tiny_model))["admitted"]


def test_gptq_without_a_quantization_config_in_config_json_fails(tmp_path, direct_checkpoints, tiny_model):
    """GPTQModel would load by quantize_config.json, but transformers reads only config.json: refused like AWQ."""
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, lambda c: c.pop("quantization_config"))
    assert reasons_of(bad, tiny_model) == [
        "quantize_config.json: quant_method 'gptq', but config.json has no quantization_config (transformers would "
        "load the packed tensors as an unquantized model)"]


def test_autogptq_quantize_config_without_quant_method_is_gptq(tmp_path, direct_checkpoints, tiny_model):
    """Older AutoGPTQ writes quantize_config.json with no quant_method: it is GPTQ's file, read as GPTQ."""
    ok = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(ok, lambda c: [c.pop(k) for k in ("quant_method", "method", "format", "checkpoint_format")],
                name="quantize_config.json")
    report = admission.validate(ok, str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert (report["method"], report["bits"], report["checkpoint_format"]) == ("gptq", 3, "gptq")
    edit_config(ok, lambda c: c.update(bits=4), name="quantize_config.json")  # the message names the wrong file
    assert reasons_of(ok, tiny_model) == [
        "config.json quantization_config: bits 3, but quantize_config.json says bits 4 (the loaders read different "
        "files; they must agree)"]


@pytest.mark.parametrize("key,default", [("sym", True), ("desc_act", False), ("checkpoint_format", "gptq")])
def test_a_setting_missing_from_one_file_is_compared_as_its_readers_default(tmp_path, direct_checkpoints,
                                                                           tiny_model, key, default):
    """GPTQModel reads quantize_config.json first and fills a missing sym with True: config.json's false disagrees."""
    bad = broken_copy(direct_checkpoints["gptq_v2" if key == "checkpoint_format" else "gptq"], tmp_path / "c")
    config = json.loads((bad / "config.json").read_text())["quantization_config"]
    if config[key] == default:  # make config.json state the other value, as a real checkpoint would
        edit_config(bad, lambda c: c["quantization_config"].update({key: not default}))
        edit_config(bad, lambda c: c.update({key: not default}), name="quantize_config.json")
    edit_config(bad, lambda c: [c.pop(k, None) for k in (key, "format" if key == "checkpoint_format" else key)],
                name="quantize_config.json")
    reasons = reasons_of(bad, tiny_model)
    assert len(reasons) == 1 and reasons[0].startswith(f"config.json quantization_config: {key} "), reasons
    assert f"quantize_config.json says {key} (not set there, so GPTQModel's default) {default!r}" in reasons[0]


@pytest.mark.parametrize("name,change,reason", [
    ("quantize_config.json", lambda c: c.update(adapter={"name": "lora", "path": "/tmp/elsewhere", "rank": 8}),
     "quantize_config.json: adapter {'name': 'lora', 'path': '/tmp/elsewhere', 'rank': 8} refused: GPTQModel would "
     "load LoRA weights from that path or hub repo"),
    ("quantize_config.json", lambda c: c.update(dynamic={"-:.*mlp.*": {}}),
     "quantize_config.json: dynamic {'-:.*mlp.*': {}} refused: GPTQModel would change bits/group size per module"),
    ("config.json", lambda c: c["quantization_config"].update(adapter={"name": "lora", "path": "org/repo"}),
     "config.json quantization_config: adapter {'name': 'lora', 'path': 'org/repo'} refused"),
    ("quantize_config.json", lambda c: c.update(rotation="hadamard"),
     "quantize_config.json: key 'rotation' is not one the gptq writers use; refused"),
    ("config.json", lambda c: c["quantization_config"].update(something_new=1),
     "config.json quantization_config: key 'something_new' is not one the gptq writers use; refused"),
])
def test_quantization_config_keys_outside_the_allow_list_fail(tmp_path, direct_checkpoints, tiny_model, name,
                                                               change, reason):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, change, name=name)
    reasons = reasons_of(bad, tiny_model)
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons


def test_empty_adapter_and_dynamic_are_admitted(tmp_path, direct_checkpoints, tiny_model):
    ok = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(ok, lambda c: c.update(adapter=None, dynamic={}), name="quantize_config.json")
    assert admission.validate(ok, str(tiny_model))["admitted"]


@pytest.mark.parametrize("kind,change", [
    ("awq", lambda c: c["quantization_config"].update(modules_to_not_convert=["mlp"])),
    ("int8", lambda c: c["quantization_config"].update(llm_int8_skip_modules=["model.layers.0.mlp.up_proj"])),
    ("awq", lambda c: c["quantization_config"].update(surprise=True)),
])
def test_other_methods_keys_are_allow_listed_too(tmp_path, direct_checkpoints, tiny_model, kind, change):
    bad = broken_copy(direct_checkpoints[kind], tmp_path / "c")
    edit_config(bad, change)
    reasons = reasons_of(bad, tiny_model)
    assert len(reasons) == 1 and reasons[0].startswith("config.json quantization_config: "), reasons


def test_awq_settings_only_in_a_side_file_fail(tmp_path, direct_checkpoints, tiny_model):
    """transformers reads only config.json: packed AWQ tensors without it would load as an unquantized model."""
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    qc = json.loads((bad / "config.json").read_text())["quantization_config"]
    edit_config(bad, lambda c: c.pop("quantization_config"))
    (bad / "quant_config.json").write_text(json.dumps(qc))
    assert reasons_of(bad, tiny_model) == [
        "quant_config.json: quant_method 'awq', but config.json has no quantization_config (transformers would "
        "load the packed tensors as an unquantized model)"]


def test_settings_come_from_the_config_the_loader_reads_and_every_copy_must_agree():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    assert quant_config.quant_settings({"quantization_config": awq}, {}) == (
        {"method": "awq", "bits": 4, "group_size": 64, "checkpoint_format": "gemm"}, [])
    assert quant_config.quant_settings({}, {})[0]["method"] == "none"  # no quantization config: an unquantized model
    assert quant_config.quant_settings({"quantization_config": awq}, {"quant_config.json": {**awq, "bits": 3}}) == (
        {}, ["config.json quantization_config: bits 4, but quant_config.json says bits 3 (the loaders read different "
             "files; they must agree)"])
