"""compressed-tensors checkpoints as vLLM teams receive them (FP8-dynamic, W8A8, static FP8, block FP8, naive and
packed int): written by the library's own ModelCompressor, admitted when sound, refused naming the tensor when a
writer broke one thing; and evaluated as served, with activations quantized as the scheme says."""

from __future__ import annotations

import json

import pytest
import torch

from pipelines.checkpoints import admission
from pipelines.checkpoints.compressed_tensors import check_served
from pipelines.core import logs
from pipelines.models.loading import VariantFailed, load_variant
from tests.checkpoint_helpers import broken_copy, edit_config, edit_tensors, reasons_of

GOOD = {  # kind -> (format, bits, group size, what the forward says of the input activations)
    "sym": ("pack-quantized", 4, 32, "activations in full precision"),
    "fp8_dynamic": ("float-quantized", 8, -1, "input activations fp8 (E4M3) per token, dynamic"),
    "w8a8": ("int-quantized", 8, -1, "input activations int8 per token, dynamic"),
    "fp8_static": ("float-quantized", 8, -1, "input activations fp8 (E4M3) per tensor, static"),
    "fp8_block": ("float-quantized", 8, -1, "input activations fp8 (E4M3) per group of 32, dynamic"),
    "w8a8_asym": ("int-quantized", 8, -1, "input activations int8 per token, asymmetric, dynamic"),
    "naive_int4": ("naive-quantized", 4, 32, "activations in full precision"),
}
Q = "model.layers.0.self_attn.q_proj"


def tensor_bytes_in_file(folder) -> int:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_library_written_compressed_tensors_checkpoints_are_admitted(ct_checkpoints, tiny_model, kind):
    report = admission.validate(ct_checkpoints[kind], str(tiny_model))
    assert report["admitted"], report["reasons"]
    fmt, bits, group, acts = GOOD[kind]
    assert (report["checkpoint_format"], report["bits"], report["group_size"]) == (fmt, bits, group)
    assert report["quantized_layers"] == 7 and acts in report["forward"]
    # the memory theory counts every tensor the scheme stores (scales, zero points, packed words, static input
    # scales, a ragged block's scale): exactly the bytes the library wrote
    assert report["theoretical_weight_bytes"]["total"] == tensor_bytes_in_file(ct_checkpoints[kind])


@pytest.mark.parametrize("kind, name, change, reason", [
    ("w8a8", "a channel scale of a per-tensor shape", lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:1, 0]}),
     f"model.safetensors: tensor {Q}.weight_scale: F16[1] but its compressed-tensors scheme and the base layer "
     "(64 -> 64) imply BF16/F16/F32[64, 1]"),
    ("fp8_block", "a block grid that misses the ragged edge", lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:1, :1].clone()}),
     f"model.safetensors: tensor {Q}.weight_scale: F16[1, 1] but its compressed-tensors scheme and the base layer "
     "(64 -> 64) imply BF16/F16/F32[2, 2]"),
    ("fp8_dynamic", "FP8 weights stored as float16", lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].to(torch.float16)}),
     f"model.safetensors: tensor {Q}.weight: F16[64, 64] but its compressed-tensors scheme and the base layer "
     "(64 -> 64) imply F8_E4M3[64, 64]"),
    ("fp8_static", "a static activation scheme without its input scale", lambda t: t.pop(f"{Q}.input_scale"),
     f"tensor {Q}.input_scale: missing (its compressed-tensors scheme and the base layer (64 -> 64) imply "
     "BF16/F16/F32[1])"),
    ("w8a8_asym", "an asymmetric scheme without its zero points", lambda t: t.pop(f"{Q}.weight_zero_point"),
     f"tensor {Q}.weight_zero_point: missing (its compressed-tensors scheme and the base layer (64 -> 64) imply I8[64, 1])"),
    ("fp8_dynamic", "a NaN scale", lambda t: t[f"{Q}.weight_scale"].__setitem__((3, 0), float("nan")),
     f"model.safetensors: tensor {Q}.weight_scale: 1 NaN/inf values"),
    ("w8a8", "a zero scale", lambda t: t[f"{Q}.weight_scale"].__setitem__((5, 0), 0.0),
     f"model.safetensors: tensor {Q}.weight_scale: 1 scale values <= 0"),
    ("fp8_static", "a negative input scale", lambda t: t[f"{Q}.input_scale"].__setitem__(0, -0.05),
     f"model.safetensors: tensor {Q}.input_scale: 1 scale values <= 0"),
    ("fp8_dynamic", "a NaN FP8 weight", lambda t: t.update({f"{Q}.weight": torch.where(
        torch.arange(64 * 64).reshape(64, 64) < 2, torch.tensor(float("nan")), t[f"{Q}.weight"].float()).to(torch.float8_e4m3fn)}),
     f"model.safetensors: tensor {Q}.weight: 2 NaN values"),
    ("naive_int4", "an int4 value outside its range in an int8 byte", lambda t: t[f"{Q}.weight"].__setitem__((0, 0), 9),
     f"model.safetensors: tensor {Q}.weight: 1 values outside [-8, 7] (the scheme's bits)"),
])
def test_a_broken_tensor_is_refused_naming_it(tmp_path, ct_checkpoints, tiny_model, kind, name, change, reason):
    bad = broken_copy(ct_checkpoints[kind], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", change)
    assert reasons_of(bad, tiny_model) == [reason], name


@pytest.mark.parametrize("kind, change, reason", [
    ("fp8_dynamic", lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
     "config.json: compressed-tensors: kv_cache_scheme {\"num_bits\": 8, \"strategy\": \"tensor\", \"type\": \"float\"}: "
     "a quantized KV cache is refused: compressed-tensors 0.20 does not hook transformers 5.24's attention"),
    ("w8a8", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=128),
     "config.json: compressed-tensors: config_groups.group_0.weights: Value error, group_size requires strategy to be "
     "set to 'group' (compressed-tensors 0.20's QuantizationConfig refuses it)"),
    ("naive_int4", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=48),
     "config.json: compressed-tensors: config_groups.group_0.weights: group_size 48 does not divide "
     "model.layers.0.self_attn.q_proj's 64 inputs (compressed-tensors 0.20 cannot run a ragged last group)"),
    ("fp8_dynamic", lambda q: q.update(format="nvfp4-pack-quantized"),
     "config.json: compressed-tensors: format 'nvfp4-pack-quantized': only float-quantized, int-quantized, "
     "naive-quantized, pack-quantized (or mixed-precision of them) are checked"),
    ("w8a8", lambda q: q.update(transform_config={"config_groups": {"R1": {"type": "hadamard"}}}),
     "config.json: compressed-tensors: transform_config {\"config_groups\": {\"R1\": {\"type\": \"hadamard\"}}}: "
     "transforms (rotations) have no check here"),
    ("w8a8", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor_group"),
     "config.json: compressed-tensors: config_groups.group_0.weights: weight strategy 'tensor_group': only tensor, "
     "channel, group, block are checked"),
    ("w8a8", lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "config.json: compressed-tensors: config_groups.group_0.input_activations: static 'token' activations: only "
     "dynamic per-token, per-group and per-tensor, and static per-tensor, are checked"),
    ("w8a8", lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"),
     "config.json: compressed-tensors: config_groups.group_0.weights: actorder 'group': no check for it here"),
    ("fp8_dynamic", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4),
     "config.json: compressed-tensors: config_groups.group_0.weights: float 4-bit weights (NVFP4, MXFP4, FP6): "
     "no check for it here"),
    ("fp8_dynamic", lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8}),
     "config.json: compressed-tensors: config_groups.group_0: output_activations {'num_bits': 8}: no check for it here"),
    ("w8a8", lambda q: q.update(quantization_status="frozen"),
     "config.json: compressed-tensors: quantization_status 'frozen': only 'compressed' checkpoints are checked (a "
     "'frozen' one stores float weights that the loader would quantize again)"),
])
def test_what_has_no_check_is_refused_by_name(tmp_path, ct_checkpoints, tiny_model, kind, change, reason):
    bad = broken_copy(ct_checkpoints[kind], tmp_path / "c")
    edit_config(bad, lambda c: change(c["quantization_config"]))
    assert reasons_of(bad, tiny_model)[0].startswith(reason)


@pytest.mark.parametrize("actorder", ["static", "weight"])
def test_gptq_activation_ordering_that_stores_nothing_is_admitted_and_served(tmp_path, ct_checkpoints, tiny_model,
                                                                              actorder):
    """llm-compressor's GPTQ writes `actorder: static` by default: columns reordered while quantizing, nothing more
    stored; the checkpoint is admitted and loads through the served forward. `group` (a weight_g_idx) is refused."""
    ok = broken_copy(ct_checkpoints["w8a8"], tmp_path / "c")
    edit_config(ok, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(actorder=actorder))
    manifest = admission.admit("w8a8", str(ok), str(tiny_model), tmp_path / "admitted")
    assert manifest["status"] == "ok", manifest.get("reasons")
    load_variant(tmp_path / "admitted/w8a8")


def test_a_kv_cache_scheme_stays_refused_while_the_library_cannot_hook_attention(tiny_model):
    """The refusal's reason, kept true: compressed-tensors 0.20 finds no cached attention in transformers 5.24's
    Llama (its forward takes `cache`, not `past_key_value(s)`), so a KV scheme would not be applied here. When a
    release recognises it, this fails: then check k_scale/v_scale and admit it."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module
    from transformers import AutoModelForCausalLM

    with logs.library_output("test"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not is_cached_attention_module(model.model.layers[0].self_attn)


def test_ignore_and_targets_follow_the_library(tmp_path, ct_checkpoints, tiny_model):
    """A layer the config ignores must be stored as the base model's float weight; one it targets, quantized."""
    bad = broken_copy(ct_checkpoints["w8a8"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"].update(ignore=["lm_head", "re:.*q_proj$"]))
    assert reasons_of(bad, tiny_model) == [
        f"model.safetensors: tensor {Q}.weight: I8[64, 64] but the base model has BF16/F16/F32/F64[64, 64]",
        f"model.safetensors: unexpected tensor {Q}.weight_scale F16[64, 1] (neither in the base model nor part of "
        "the compressed-tensors format)"]


def kl_to(reference, model, ids) -> float:
    with torch.no_grad():
        ref = torch.log_softmax(reference(ids).logits.float(), -1)
        got = torch.log_softmax(model(ids).logits.float(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.mark.parametrize("kind", ["fp8_dynamic", "w8a8"])
def test_evaluated_as_served_with_activations_quantized(tmp_path, ct_checkpoints, tiny_model, kind):
    """load_variant (every stage's loader) runs compressed-tensors' own forward: its logits differ from the same
    checkpoint with its weights dequantized and full-precision activations, and are further from the float model."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    manifest = admission.admit(kind, str(ct_checkpoints[kind]), str(tiny_model), tmp_path)
    assert "quantized in every forward" in manifest["settings"]["forward"]
    served, tok = load_variant(tmp_path / kind)
    with logs.library_output("test"):
        weights_only = AutoModelForCausalLM.from_pretrained(tmp_path / kind, device_map="cpu",
                                                            quantization_config=CompressedTensorsConfig(dequantize=True))
        reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = tok("def add(a, b):\n    # sum of two numbers\n    return a + b\n12+30=", return_tensors="pt").input_ids
    assert kl_to(reference, served, ids) > 1.5 * kl_to(reference, weights_only, ids) > 0
    with pytest.raises(RuntimeError, match="admission counted 7"):  # dequantize=True: no layer quantizes anything
        check_served(weights_only, manifest)
    served.model.layers[0].mlp.up_proj.quantization_enabled = False
    with pytest.raises(RuntimeError, match="mlp.up_proj: the loaded layer does not run compressed-tensors' quantized"):
        check_served(served, manifest)


def test_a_scheme_the_loader_changed_is_not_evaluated(tmp_path, ct_checkpoints, tiny_model):
    """The manifest is what admission checked; a config edited after admission loads another scheme: refused."""
    admission.admit("w8a8", str(ct_checkpoints["w8a8"]), str(tiny_model), tmp_path)
    edit_config(tmp_path / "w8a8", lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        input_activations=None))
    with pytest.raises(VariantFailed, match="is not evaluated as served: .*q_proj: loaded with weights"):
        load_variant(tmp_path / "w8a8")


def test_the_doctor_lists_the_formats_this_machine_evaluates(ct_checkpoints, monkeypatch):
    """Each format's checkpoint is written, loaded and run here; one that does not run is named with why."""
    from types import SimpleNamespace

    from pipelines.checkpoints import compressed_tensors_probe
    from pipelines.diagnose import check, devices

    params = SimpleNamespace(candidates={"vendor-fp8": SimpleNamespace(path=str(ct_checkpoints["fp8_dynamic"])),
                                         "elsewhere": SimpleNamespace(path="/no/such/folder")})
    got = devices.compressed_tensors_check(params, "cpu")
    assert got.status == check.OK and got.detail.startswith(
        "float-quantized, int-quantized, naive-quantized, pack-quantized load and run on cpu") \
        and got.detail.endswith("(candidates vendor-fp8)")
    # NVFP4 (float 4-bit weights with a global scale) is not admitted; probed, it does not run here: named, a warning
    monkeypatch.setitem(compressed_tensors_probe.PROBES, "nvfp4-pack-quantized", ("NVFP4A16", "nvfp4-pack-quantized"))
    got = devices.compressed_tensors_check(params, "cpu")
    assert got.status == check.WARN and "not on this machine: nvfp4-pack-quantized: NVFP4A16: " in got.detail


def test_memory_sets_the_footprint_against_the_formats_theory(tmp_path, ct_checkpoints, tiny_model):
    """Loaded, an FP8 candidate holds what its theory says (fp8 weights and one fp16 scale per channel); transformers'
    compressed-tensors route unpacks the weights to float16 at the first forward, and the memory row says what
    serving then holds (routing costs it at that)."""
    from pipelines import memory
    from pipelines.measure import verdict
    from tests.test_memory import FAST

    manifest = admission.admit("fp8", str(ct_checkpoints["fp8_dynamic"]), str(tiny_model), tmp_path)
    r = memory.measure_isolated(str(tmp_path / "fp8"), FAST, "cpu")
    theory = manifest["theoretical_weight_bytes"]
    assert r["status"] == "ok" and r["load"]["theoretical_weight_bytes"] == theory["total"]
    assert 0 <= r["load"]["footprint_bytes"] - theory["total"] <= 256  # + the rotary embedding's buffer
    from safetensors import safe_open

    with safe_open(ct_checkpoints["fp8_dynamic"] / "model.safetensors", "pt") as f:  # the fp8 weights: 1 byte each
        fp8_weights = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys()
                          if f.get_slice(k).get_dtype() == "F8_E4M3")
    # unpacked to float16, every fp8 weight costs a second byte; the scales stay
    assert r["load"]["tensor_bytes_after_forward"] - r["load"]["tensor_bytes"] == fp8_weights
    row = verdict.summarize({"fp8": r}, FAST, baseline="fp16")["variants"]["fp8"]
    assert row["serving_tensor_bytes"] == r["load"]["tensor_bytes_after_forward"]


def test_a_scheme_this_machine_cannot_run_is_could_not_measure(tmp_path, ct_checkpoints, tiny_model, monkeypatch):
    """load_variant first probes the candidate's own scheme on the device; when that fails, evaluate and memory record
    the machine's error (environment) with its remedy, which compare turns into inconclusive rows (tests/test_gate.py's
    could-not-measure tests). Every admitted scheme runs on this CPU, so the probe's answer is replaced here with the
    one NVFP4 gives for real (the doctor's test runs it)."""
    from pipelines.checkpoints import compressed_tensors_probe
    from pipelines.core.errors import ENVIRONMENT, CannotRunHere, environment_cause

    admission.admit("fp8", str(ct_checkpoints["fp8_dynamic"]), str(tiny_model), tmp_path)
    assert compressed_tensors_probe.check_runs_here(json.loads((tmp_path / "fp8/quantgate.json").read_text()), "cpu") is None
    monkeypatch.setattr(compressed_tensors_probe, "probe", lambda *args: "RuntimeError: expected m1 and m2 "
                        "to have the same dtype, but got: float != c10::BFloat16")
    with pytest.raises(CannotRunHere, match="compressed-tensors group_0 does not run on cpu .*: RuntimeError") as err:
        load_variant(tmp_path / "fp8")
    assert environment_cause(err.value)["cause"] == ENVIRONMENT and "doctor" in err.value.remedy
    # the memory stage records it as the machine's, and its summary keeps why (tests/test_gate.py: rows inconclusive)
    from pipelines import memory
    from pipelines.measure import verdict
    from tests.test_memory import FAST

    r = memory.measure(str(tmp_path / "fp8"), FAST, "cpu")
    row = verdict.summarize({"fp8": r}, FAST, baseline="fp16")["variants"]["fp8"]
    assert (row["status"], row["cause"], row["remedy"]) == ("failed", ENVIRONMENT, err.value.remedy)
    assert row["reason"].startswith("compressed-tensors group_0 does not run on cpu")


def test_the_release_report_names_the_forward_each_candidate_was_evaluated_with():
    from pipelines import gate

    forward = "compressed-tensors' own forward (...): group_0: weights fp8 (E4M3) per output channel"
    report = {"variants": {"vendor-fp8": {"forward": forward, "domains": {}}, "int8": {"domains": {}}}}
    text = gate.render_report({"verdict": "fail", "gated": ["int8", "vendor-fp8"], "reasons": []}, report, None)
    assert f"vendor-fp8 was evaluated with {forward}." in text and "int8 was evaluated" not in text


def test_an_llm_compressor_folder_with_its_recipe_is_admitted(tmp_path, ct_checkpoints, tiny_model):
    """llm-compressor saves recipe.yaml beside every checkpoint: inert text, never parsed, copied with the rest."""
    folder = broken_copy(ct_checkpoints["w8a8"], tmp_path / "c")
    (folder / "recipe.yaml").write_text("default_stage:\n  default_modifiers:\n    QuantizationModifier:\n"
                                        "      targets: [Linear]\n      ignore: [lm_head]\n      scheme: W8A8\n")
    manifest = admission.admit("w8a8", str(folder), str(tiny_model), tmp_path / "admitted")
    assert manifest["status"] == "ok" and "recipe.yaml" in manifest["files"]
    assert (tmp_path / "admitted/w8a8/recipe.yaml").read_bytes() == (folder / "recipe.yaml").read_bytes()


def test_a_quantized_lm_head_tied_to_the_embedding_is_refused(tmp_path, tiny_model):
    """A model that ties lm_head to its embedding: quantizing lm_head (ignore left empty) quantizes one shared
    tensor; transformers cannot load it, and with lm_head.weight dropped the embedding would stand in unnoticed."""
    from pipelines.checkpoints.compressed_tensors_probe import preset, write_rtn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with logs.library_output("test"):
        AutoModelForCausalLM.from_pretrained(tiny_model, tie_word_embeddings=True).save_pretrained(tmp_path / "base")
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "base")
        write_rtn(tmp_path / "base", preset("FP8_DYNAMIC"), "float-quantized", tmp_path / "all", ignore=())
        write_rtn(tmp_path / "base", preset("FP8_DYNAMIC"), "float-quantized", tmp_path / "ok")
    assert reasons_of(tmp_path / "all", tmp_path / "base") == [
        "lm_head: quantized, but the base model ties it to the embedding (tie_word_embeddings): the loaders cannot give "
        "one tensor two forms (transformers refuses FP8 there), and without it the embedding would stand in; leave "
        "lm_head unquantized (compressed-tensors: `ignore`)"]
    assert admission.validate(tmp_path / "ok", str(tmp_path / "base"))["admitted"]


def test_several_schemes_in_one_checkpoint_are_checked_and_served_each(tmp_path, tiny_model):
    """mixed-precision, as llm-compressor writes a recipe of two modifiers: attention W8A8 (int-quantized), the MLP
    W4A16 (pack-quantized); each layer's tensors are its own scheme's, and each runs its own forward."""
    from pipelines.checkpoints.compressed_tensors_probe import preset, write_rtn

    groups = {"attention": {"targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], **preset("W8A8")},
              "mlp": {"targets": [r"re:.*mlp\.(gate|up|down)_proj$"], **preset("W4A16")}}
    groups["mlp"]["weights"] = groups["mlp"]["weights"].model_copy(update={"group_size": 32})
    with logs.library_output("test"):
        write_rtn(tiny_model, groups, None, tmp_path / "mixed", dtype=torch.float16)
    manifest = admission.admit("mixed", str(tmp_path / "mixed"), str(tiny_model), tmp_path / "admitted")
    assert manifest["status"] == "ok", manifest.get("reasons")
    assert manifest["settings"]["checkpoint_format"] == ["int-quantized", "pack-quantized"]
    assert manifest["validation"]["quantized_layers"] == 7
    forward = manifest["settings"]["forward"]  # the library saves the groups as group_0, group_1
    assert "group_0: weights int8 per output channel (int-quantized); input activations int8 per token" in forward
    assert "group_1: weights int4 per group of 32 (pack-quantized); activations in full precision" in forward
    model, tok = load_variant(tmp_path / "admitted/mixed")
    with torch.no_grad():
        assert torch.isfinite(model(tok("12+30=", return_tensors="pt").input_ids).logits).all()
    edit_tensors(tmp_path / "mixed/model.safetensors", lambda t: t.update(  # an MLP layer stored in attention's form
        {"model.layers.0.mlp.up_proj.weight_scale": torch.ones(128, 1, dtype=torch.float16)}))
    assert "model.safetensors: tensor model.layers.0.mlp.up_proj.weight_scale: F16[128, 1] but its compressed-tensors " \
           "scheme and the base layer (64 -> 128) imply BF16/F16/F32[128, 2]" in reasons_of(tmp_path / "mixed", tiny_model)


def test_mlflow_logs_the_forward_a_candidate_was_evaluated_with(tmp_path, ct_checkpoints, tiny_model):
    from pipelines.core.params_candidates import CandidateParams
    from pipelines.store.layout import child_params

    manifest = admission.admit("fp8", str(ct_checkpoints["fp8_dynamic"]), str(tiny_model), tmp_path)
    params = child_params(manifest, CandidateParams(path=str(ct_checkpoints["fp8_dynamic"])).model_dump(mode="json"))
    assert params["settings.forward"] == manifest["settings"]["forward"] and "per token, dynamic" in params[
        "settings.forward"]
