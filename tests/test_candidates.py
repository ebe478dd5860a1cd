"""Third-party checkpoints: real GPTQModel/autoawq/bitsandbytes outputs in real layouts pass; each kind of
broken or dangerous one is refused with its file, key and tensor named."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import pytest
import torch

from pipelines.checkpoints import candidates
from pipelines.core import logs
from pipelines.models.loading import VariantFailed, load_variant

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def direct_checkpoints(tmp_path_factory, tiny_model, tiny_calibration):
    """Checkpoints written by the libraries themselves, not through quantgate."""
    from awq import AutoAWQForCausalLM
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

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
        v2 = GPTQModel.load(str(tiny_model), QuantizeConfig(bits=4, group_size=32, format="gptq_v2"), device="cpu")
        v2.quantize(texts)
        v2.save(str(root / "gptq_v2"))
        int8 = AutoModelForCausalLM.from_pretrained(str(tiny_model), device_map="cpu",
                                                    quantization_config=BitsAndBytesConfig(load_in_8bit=True))
        int8.save_pretrained(root / "int8")
        tok.save_pretrained(root / "int8")
    return {"awq": root / "awq", "gptq": root / "gptq", "gptq_v2": root / "gptq_v2", "int8": root / "int8"}


@pytest.fixture(scope="module")
def ct_checkpoints(tmp_path_factory, tiny_model):
    """compressed-tensors pack-quantized int4 (group 32), symmetric and asymmetric, written by the library's own
    ModelCompressor; llm-compressor (which drives it with GPTQ) does not install with the pins, so the scales
    come from each group's min/max, as its RTN path does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("ct")
    out = {}
    for kind, symmetric in (("sym", True), ("asym", False)):
        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32)
        with logs.library_output("test"):
            model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float16)
            apply_quantization_config(model, QuantizationConfig(
                config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
            for module in model.modules():
                if hasattr(module, "weight_scale"):
                    w = module.weight.detach().float().reshape(module.weight.shape[0], -1, 32)
                    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
                    module.weight_scale.data.copy_(scale)
                    module.weight_zero_point.data.copy_(zero)
            compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
            compressor.compress_model(model)
            model.save_pretrained(root / kind)
            compressor.update_config(str(root / kind))
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def broken_copy(src, dest):
    shutil.copytree(src, dest)
    return dest


def edit_config(folder, change, name="config.json"):
    config = json.loads((folder / name).read_text())
    change(config)
    (folder / name).write_text(json.dumps(config))


def edit_tensors(path, change):
    """Rewrite one safetensors file with `change(tensors)` applied, as a real writer would."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def reshard(src, dest):
    """The checkpoint split into 2 shards plus the index, the way save_pretrained(max_shard_size=...) lays it out."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    (dest / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2:]}
    for shard, members in parts.items():
        save_file({n: tensors[n] for n in members}, dest / shard, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: shard for shard, members in parts.items() for n in members}}
    (dest / candidates.INDEX).write_text(json.dumps(index, indent=2))
    return dest


def edit_index(folder, change):
    index = json.loads((folder / candidates.INDEX).read_text())
    change(index["weight_map"])
    (folder / candidates.INDEX).write_text(json.dumps(index))


def reasons_of(folder, tiny_model):
    report = candidates.validate(folder, str(tiny_model))
    assert not report["admitted"]
    return report["reasons"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, direct_checkpoints):
    return reshard(direct_checkpoints["gptq"], tmp_path_factory.mktemp("sharded") / "gptq")


# ---------------------------------------------------------------------------------------- accepted

@pytest.mark.parametrize("kind,method,fmt", [("awq", "awq", "gemm"), ("gptq", "gptq", "gptq"),
                                             ("gptq_v2", "gptq", "gptq_v2"), ("int8", "bnb-int8", "bnb-int8")])
def test_library_written_checkpoints_pass(direct_checkpoints, tiny_model, kind, method, fmt):
    config = json.loads((direct_checkpoints[kind] / "config.json").read_text())
    if kind == "gptq_v2":  # GPTQModel really wrote v2 (zeros without the -1 offset), not a converted v1
        assert config["quantization_config"]["checkpoint_format"] == "gptq_v2"
    report = candidates.validate(direct_checkpoints[kind], str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert report["method"] == method and report["checkpoint_format"] == fmt
    assert report["quantized_layers"] == 7  # q k v o gate up down of the one layer
    assert report["files"]["model.safetensors"] == hashlib.sha256(
        (direct_checkpoints[kind] / "model.safetensors").read_bytes()).hexdigest()


def test_hub_snapshot_layout_is_admitted_and_extras_ignored(tmp_path, direct_checkpoints, tiny_model):
    snap = broken_copy(direct_checkpoints["gptq"], tmp_path / "snapshot")
    (snap / "LICENSE").write_text("Apache-2.0\n")
    (snap / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (snap / "README.md").write_text("---\nlicense: apache-2.0\n---\n# vendor gptq\n")
    (snap / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    # sentencepiece-style: a serialized ModelProto starts with its first piece (field 1, '<unk>', score 0)
    (snap / "tokenizer.model").write_bytes(b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    (snap / "additional_chat_templates").mkdir()  # where transformers saves named chat templates
    (snap / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (snap / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (snap / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("abc\n")
    (snap / "original").mkdir()
    torch.save({"w": torch.zeros(2)}, snap / "original" / "consolidated.00.pth")  # a pickle: ignored, never read

    base = shutil.copytree(tiny_model, tmp_path / "base")  # a base model with the same chat templates
    shutil.copy(snap / "chat_template.jinja", base / "chat_template.jinja")
    shutil.copytree(snap / "additional_chat_templates", base / "additional_chat_templates")
    manifest = candidates.admit("vendor-gptq", str(snap), str(base), tmp_path / "variants")
    assert manifest["status"] == "ok", manifest.get("reasons")
    copy = tmp_path / "variants" / "vendor-gptq"
    assert set(manifest["files"]) == {"config.json", "generation_config.json", "model.safetensors", "quant_log.csv",
                                      "quantize_config.json", "tokenizer.json", "tokenizer_config.json", "LICENSE",
                                      ".gitattributes", "README.md", "chat_template.jinja", "tokenizer.model",
                                      "additional_chat_templates/tool_use.jinja"}
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == \
        sorted([*manifest["files"], "quantgate.json"])
    for name, digest in manifest["files"].items():  # the copy is the bytes that were hashed, one read
        assert hashlib.sha256((copy / name).read_bytes()).hexdigest() == digest
        assert (copy / name).read_bytes() == (snap / name).read_bytes()
    notes = manifest["validation"]["notes"]
    assert any(n.startswith(".cache/: ignored, not copied (1 files") for n in notes)
    assert any(n.startswith("original/: ignored, not copied (1 files") for n in notes)
    assert manifest["validation"]["bytes_read"] == sum((snap / f).stat().st_size for f in manifest["files"])


def test_sharded_checkpoint_is_admitted_and_loads(tmp_path, sharded, tiny_model):
    report = candidates.validate(sharded, str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert report["shards"] == 2 and set(report["files"]) >= {*SHARDS, candidates.INDEX}
    manifest = candidates.admit("vendor-sharded", str(sharded), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["settings"]["bits"] == 3
    model, tok = load_variant(tmp_path / "vendor-sharded")
    ids = tok("12+30=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_tensor_in_a_non_float_dtype_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t.update(
        {"model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.int32)}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.input_layernorm.weight: I32[64] but the base model has "
        "BF16/F16/F32/F64[64]"]


def test_compressed_tensors_checkpoint_passes(ct_checkpoints, tiny_model):
    report = candidates.validate(ct_checkpoints["sym"], str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert (report["method"], report["bits"], report["group_size"]) == ("compressed-tensors", 4, 32)
    assert report["quantized_layers"] == 7


def test_admitted_compressed_tensors_candidate_loads(tmp_path, ct_checkpoints, tiny_model):
    manifest = candidates.admit("vendor-ct", str(ct_checkpoints["sym"]), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["method"] == "compressed-tensors"
    assert manifest["libraries"]["compressed-tensors"] == "0.20.0"
    model, tok = load_variant(tmp_path / "vendor-ct")
    with torch.no_grad():
        assert torch.isfinite(model(tok("12+30=", return_tensors="pt").input_ids).logits).all()


def test_compressed_tensors_weight_shape_that_lies_fails(tmp_path, ct_checkpoints, tiny_model):
    bad = broken_copy(ct_checkpoints["sym"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight_shape": torch.tensor([64, 128])}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.layers.0.mlp.up_proj.weight_shape: [64, 128], but the base layer is "
        "[128, 64] (out, in)"]


def test_compressed_tensors_asymmetric_is_refused_because_it_does_not_load(tmp_path, ct_checkpoints, tiny_model):
    """The library's own asymmetric checkpoint fails to load here (packed zero points, size mismatch): refused."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"), logs.library_output("test"):
        AutoModelForCausalLM.from_pretrained(ct_checkpoints["asym"], device_map="cpu")
    assert reasons_of(ct_checkpoints["asym"], tiny_model)[0].startswith(
        "config.json: compressed-tensors: asymmetric weights are not admitted")


def test_compressed_tensors_other_formats_are_refused(tmp_path, ct_checkpoints, tiny_model):
    bad = broken_copy(ct_checkpoints["sym"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"].update(format="naive-quantized"))
    assert reasons_of(bad, tiny_model) == [
        "config.json: compressed-tensors format 'naive-quantized' (status 'compressed'): only 'pack-quantized', "
        "'compressed' is admitted"]


def test_compressed_tensors_activation_quantization_is_refused(tmp_path, ct_checkpoints, tiny_model):
    bad = broken_copy(ct_checkpoints["sym"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}))
    assert reasons_of(bad, tiny_model) == [
        "config.json: compressed-tensors: config_groups.group_0 quantizes activations; only weight-only schemes "
        "are admitted"]


def test_admitted_gptq_v2_candidate_loads(tmp_path, direct_checkpoints, tiny_model):
    manifest = candidates.admit("vendor-v2", str(direct_checkpoints["gptq_v2"]), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["settings"]["checkpoint_format"] == "gptq_v2"
    model, tok = load_variant(tmp_path / "vendor-v2")
    with torch.no_grad():
        assert torch.isfinite(model(tok("12+30=", return_tensors="pt").input_ids).logits).all()


def test_cosmetic_config_keys_may_differ(tmp_path, direct_checkpoints, tiny_model):
    """DRIFT_ALLOWED: what real writers change (autoawq: use_cache; GPTQModel: dtype) and how the file was saved."""
    ok = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(ok, lambda c: c.update(use_cache=False, dtype="bfloat16", transformers_version="4.57.1",
                                       _name_or_path="/somewhere/else"))
    assert candidates.validate(ok, str(tiny_model))["admitted"]
    assert set(candidates.DRIFT_ALLOWED) == {"transformers_version", "_name_or_path", "dtype", "torch_dtype",
                                             "use_cache"}


def test_legacy_rope_spelling_is_not_drift(tmp_path, direct_checkpoints, tiny_model):
    ok = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(ok, lambda c: (c.pop("rope_parameters"), c.update(rope_theta=10000.0, rope_scaling=None)))
    assert candidates.validate(ok, str(tiny_model))["admitted"]


# ---------------------------------------------------------------------------------------- values

def test_nan_in_an_unquantized_tensor_of_a_shard_fails(tmp_path, sharded, tiny_model, monkeypatch):
    bad = broken_copy(sharded, tmp_path / "c")
    assert json.loads((bad / candidates.INDEX).read_text())["weight_map"]["model.embed_tokens.weight"] == SHARDS[0]

    def poison(t):
        t["model.embed_tokens.weight"][0, 1] = float("nan")
        t["model.embed_tokens.weight"][-1, -1] = float("-inf")
    edit_tensors(bad / SHARDS[0], poison)
    monkeypatch.setattr(candidates, "CHUNK_BYTES", 256)  # the 64 KiB tensor streams in 256 chunks: both are seen
    assert reasons_of(bad, tiny_model) == [f"{SHARDS[0]}: tensor model.embed_tokens.weight: 2 NaN/inf values"]


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
    assert candidates.validate(bad, str(tiny_model))["admitted"]


# ---------------------------------------------------------------------------------------- config drift

@pytest.mark.parametrize("change,reason", [
    (lambda c: c["rope_parameters"].update(rope_theta=500000.0),
     "config.json: rope_theta is 500000.0, the base model has 10000.0"),
    (lambda c: c["rope_parameters"].update(rope_type="linear", factor=4.0),
     "config.json: rope_scaling is {'rope_type': 'linear', 'factor': 4.0}, the base model has None"),
    (lambda c: c.update(tie_word_embeddings=True), "config.json: tie_word_embeddings is True, the base model has False"),
    (lambda c: c.update(vocab_size=520), "config.json: vocab_size is 520, the base model has 512"),
    (lambda c: c.update(num_key_value_heads=1), "config.json: num_key_value_heads is 1, the base model has 2"),
    (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"]),
     "config.json: model_type is 'mistral', the base model has 'llama'"),
    # behaviour, not shapes: every key outside DRIFT_ALLOWED is compared
    (lambda c: c.update(hidden_act="relu"), "config.json: hidden_act is 'relu', the base model has 'silu'"),
    (lambda c: c.update(rms_norm_eps=1.0), "config.json: rms_norm_eps is 1.0, the base model has 1e-06"),
    (lambda c: c.update(eos_token_id=7), "config.json: eos_token_id is 7, the base model has 2"),
    (lambda c: c.update(bos_token_id=5), "config.json: bos_token_id is 5, the base model has 1"),
    (lambda c: c.update(attention_bias=True), "config.json: attention_bias is True, the base model has False"),
])
def test_config_drift_fails(tmp_path, direct_checkpoints, tiny_model, change, reason):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, change)
    assert reason in reasons_of(bad, tiny_model)


def permute_vocab(t):
    vocab = t["model"]["vocab"]
    tokens = list(vocab)
    t["model"]["vocab"] = dict(zip(tokens, [vocab[k] for k in tokens][::-1]))


@pytest.mark.parametrize("kind,name,change,reason", [
    ("gptq", "tokenizer.json", permute_vocab, "the vocabulary differs from the base model's"),
    ("awq", "tokenizer_config.json", lambda c: c.update(eos_token="<pad>"), "eos_token is '<pad>' (id 0), the base "
     "model's is '</s>' (id 2)"),
    ("int8", "tokenizer_config.json", lambda c: c.update(chat_template="{{ 'x' }}"),
     "tokenizer_config.json: the chat template differs from the base model's"),
    ("gptq", "tokenizer.json", lambda t: t.update(normalizer={"type": "Lowercase"}), "encodes to"),
    ("gptq", "generation_config.json", lambda c: c.update(do_sample=True, temperature=5.0),
     "generation_config.json: temperature is 5.0, the base model's is None"),
    ("awq", "generation_config.json", lambda c: c.update(eos_token_id=5),
     "generation_config.json: eos_token_id is 5, the base model's is 2"),
])
def test_tokenizer_and_generation_config_must_match_the_base(tmp_path, direct_checkpoints, tiny_model, kind, name,
                                                              change, reason):
    """Evaluation tokenizes with the candidate's own tokenizer: a tampered one would be evaluated and registered."""
    bad = broken_copy(direct_checkpoints[kind], tmp_path / "c")
    if not (bad / "generation_config.json").exists():
        shutil.copy(tiny_model / "generation_config.json", bad / "generation_config.json")
    assert candidates.validate(bad, str(tiny_model))["admitted"]
    edit_config(bad, change, name=name)
    reasons = reasons_of(bad, tiny_model)
    assert any(reason in r for r in reasons), reasons
    assert all(r.split(": ", 1)[0] for r in reasons)


def test_a_tokenizer_that_does_not_load_is_a_refusal_naming_the_files(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda t: t.update(pre_tokenizer={"type": "NoSuchPreTokenizer"}), name="tokenizer.json")
    reasons = reasons_of(bad, tiny_model)
    assert len(reasons) == 1 and reasons[0].startswith("tokenizer.json, tokenizer_config.json: transformers cannot "
                                                       "load the tokenizer ("), reasons


def test_only_vocab_json_and_vocab_txt_are_accepted(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    (bad / "vocab.pickle2").write_bytes(b"\x80\x04junk")
    assert reasons_of(bad, tiny_model) == [
        "vocab.pickle2: unexpected file type; accepted: safetensors, JSON, tokenizer and plain-text files"]
    assert candidates.classify("vocab.txt") == ("tokenizer", None)
    assert candidates.classify("vocab.json") == ("json", None)


def test_a_checkpoint_without_a_tokenizer_fails_saying_so(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (bad / name).unlink(missing_ok=True)
    assert reasons_of(bad, tiny_model) == [
        "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): evaluation and serving tokenize with "
        "the checkpoint's own tokenizer; ship the base model's beside the weights"]


def test_tokenizer_longer_than_vocab_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda t: t["added_tokens"].append(
        {"id": 512, "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}), name="tokenizer.json")
    assert reasons_of(bad, tiny_model) == [
        "tokenizer.json: token ids reach 512, past config.json vocab_size 512 (those tokens have no embedding row)"]


# ---------------------------------------------------------------------------------------- tensors and index

def test_duplicate_tensor_across_shards_fails(tmp_path, sharded, tiny_model):
    bad = broken_copy(sharded, tmp_path / "c")
    edit_tensors(bad / SHARDS[1], lambda t: t.update({"model.embed_tokens.weight": torch.zeros(512, 64,
                                                                                                dtype=torch.bfloat16)}))
    assert reasons_of(bad, tiny_model) == [f"tensor model.embed_tokens.weight: in both {SHARDS[0]} and {SHARDS[1]}"]


def test_index_naming_a_missing_shard_fails(tmp_path, sharded, tiny_model):
    bad = broken_copy(sharded, tmp_path / "c")
    edit_index(bad, lambda m: m.update({"model.norm.weight": "model-00003-of-00002.safetensors"}))
    reasons = reasons_of(bad, tiny_model)
    assert f"{candidates.INDEX}: lists shard 'model-00003-of-00002.safetensors', which is not in the folder" in reasons


def test_index_putting_a_tensor_in_the_wrong_shard_fails(tmp_path, sharded, tiny_model):
    bad = broken_copy(sharded, tmp_path / "c")
    edit_index(bad, lambda m: m.update({"model.embed_tokens.weight": SHARDS[1]}))
    assert reasons_of(bad, tiny_model) == [
        f"{candidates.INDEX}: puts tensor model.embed_tokens.weight in {SHARDS[1]}, but it is in {SHARDS[0]}"]


def test_shard_missing_from_the_index_fails(tmp_path, sharded, tiny_model):
    bad = broken_copy(sharded, tmp_path / "c")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, bad / "model-00003-of-00003.safetensors")
    reasons = reasons_of(bad, tiny_model)
    assert f"model-00003-of-00003.safetensors: not listed in {candidates.INDEX}" in reasons
    assert f"model-00003-of-00003.safetensors: tensor x is not listed in {candidates.INDEX}" in reasons


def test_several_shards_without_an_index_fail(tmp_path, sharded, tiny_model):
    bad = broken_copy(sharded, tmp_path / "c")
    (bad / candidates.INDEX).unlink()
    assert reasons_of(bad, tiny_model) == [
        f"{SHARDS[0]}, {SHARDS[1]}: without {candidates.INDEX}, transformers loads only model.safetensors"]


def test_unexpected_tensor_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors",
                 lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_A": torch.ones(4, 64, dtype=torch.float16)}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: unexpected tensor model.layers.0.self_attn.q_proj.lora_A F16[4, 64] "
        "(neither in the base model nor part of the gptq format)"]


def test_duplicate_name_inside_one_header_fails(tmp_path, direct_checkpoints, tiny_model):
    """safetensors' own parser keeps the last of two same-named entries; the hand parse refuses the header."""
    from safetensors import safe_open

    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    path = bad / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    entry = json.dumps({"model.norm.weight": header["model.norm.weight"]})[1:-1]
    text = raw[8:8 + n].decode().rstrip()
    new = (text[:-1] + "," + entry + "}").encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    with safe_open(str(path), framework="pt") as fh:  # the library accepts it
        assert "model.norm.weight" in fh.keys()
    assert reasons_of(bad, tiny_model) == ["model.safetensors: tensor model.norm.weight appears twice in the header"]


def test_a_shard_changed_after_safetensors_checked_it_fails(tmp_path, direct_checkpoints, tiny_model, monkeypatch):
    """safe_open and the hand parse are two opens: the offsets the data pass streams by are checked again."""
    import safetensors

    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    real = safetensors.safe_open

    class Grow:  # the real check, then the file grows before the hand parse reads it
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            return self.inner.__enter__()

        def __exit__(self, *exc):
            self.inner.__exit__(*exc)
            with (bad / "model.safetensors").open("ab") as fh:
                fh.write(b"\0" * 100)
    monkeypatch.setattr(safetensors, "safe_open", Grow)
    size = (bad / "model.safetensors").stat().st_size
    assert reasons_of(bad, tiny_model) == [
        f"model.safetensors: the data section ends at {size}, the file at {size + 100} (changed while being read)"]


def test_truncated_weights_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: refused by safetensors (Error while deserializing header: incomplete metadata, "
        "file not fully covered)"]


def test_config_claiming_4_bits_over_3_bit_tensors_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, lambda c: c["quantization_config"].update(bits=4))
    edit_config(bad, lambda c: c.update(bits=4), name="quantize_config.json")
    assert "model.safetensors: tensor model.layers.0.self_attn.q_proj.qweight: I32[6, 64] but quantization_config " \
           "(bits=4, group_size=64) and the base layer (64 -> 64) imply I32[8, 64]" in reasons_of(bad, tiny_model)


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
    assert candidates.validate(bad, str(tiny_model))["admitted"]


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
    report = candidates.validate(ok, str(tiny_model))
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
    assert candidates.validate(ok, str(tiny_model))["admitted"]


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


# ---------------------------------------------------------------------------------------- malformed files

@pytest.mark.parametrize("kind,name,content,reason", [
    ("gptq", "added_tokens.json", {"a": "x"}, "added_tokens.json: token 'a' has id 'x', not an integer"),
    ("gptq", "added_tokens.json", [1], "added_tokens.json: a list, not a JSON object"),
    ("gptq", "tokenizer.json", {"model": [1, 2]}, "tokenizer.json: model is a list, not a JSON object"),
    ("gptq", "tokenizer.json", {"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": "7"}]},
     "tokenizer.json: added_tokens is not a list of {id: integer, ...} objects"),
    ("gptq", "config.json", lambda c: c.update(quantization_config="gptq"),
     "config.json quantization_config is a str, not a JSON object"),
    ("gptq", "quantize_config.json", [3], "quantize_config.json is a list, not a JSON object"),
    ("ct", "config.json", lambda c: c["quantization_config"].update(config_groups=[1]),
     "config.json: compressed-tensors: config_groups is a list, not a JSON object"),
    ("ct", "config.json", lambda c: c["quantization_config"]["config_groups"].update(group_0=[1]),
     "config.json: compressed-tensors: config_groups.group_0 is a list, not a JSON object"),
])
def test_malformed_json_is_refused_not_a_crash(tmp_path, direct_checkpoints, ct_checkpoints, tiny_model, kind, name,
                                               content, reason):
    src = ct_checkpoints["sym"] if kind == "ct" else direct_checkpoints[kind]
    bad = broken_copy(src, tmp_path / "c")
    if callable(content):
        edit_config(bad, content, name=name)
    else:
        (bad / name).write_text(json.dumps(content))
    assert reasons_of(bad, tiny_model) == [reason]
    manifest = candidates.admit("vendor", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed" and manifest["reasons"] == [reason]


def test_an_unexpected_error_is_a_refusal_naming_the_step(tmp_path, direct_checkpoints, tiny_model, monkeypatch):
    """The backstop: whatever a check raises becomes this candidate's recorded failure, never a crashed stage."""
    def broken(*args):
        raise KeyError("weight_map")
    monkeypatch.setattr(candidates, "plan_tensors", broken)
    manifest = candidates.admit("vendor", str(direct_checkpoints["gptq"]), str(tiny_model), tmp_path)
    assert manifest["reasons"] == [
        "admission could not check the tensors against the base model: KeyError: 'weight_map'"]
    assert json.loads((tmp_path / "vendor" / candidates.MANIFEST).read_text())["status"] == "failed"
    monkeypatch.undo()
    monkeypatch.setattr(candidates.ValueCheck, "__call__", lambda *a: 1 / 0)  # in the data pass's threads
    assert reasons_of(direct_checkpoints["gptq"], tiny_model) == [
        "admission could not check model.safetensors: ZeroDivisionError: division by zero"]


def test_a_file_that_vanishes_between_the_phases_is_a_refusal(tmp_path, direct_checkpoints, tiny_model, monkeypatch):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    stream_all = candidates.stream_all

    def vanish(folder, *args):
        (folder / "quant_log.csv").unlink()
        return stream_all(folder, *args)
    monkeypatch.setattr(candidates, "stream_all", vanish)
    report = candidates.validate(bad, str(tiny_model))
    assert report["reasons"] == [f"quant_log.csv: No such file or directory ({bad / 'quant_log.csv'})"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_a_small_file_rewritten_between_check_and_copy_is_refused(tmp_path, direct_checkpoints, tiny_model,
                                                                    monkeypatch, name):
    """The race the reviewer ran: auto_map added after the checks read config.json, before the copy."""
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    stream_all = candidates.stream_all

    def rewrite(folder, *args):
        edit_config(folder, lambda c: c.update(auto_map={"AutoModelForCausalLM": "evil.Model"},
                                               trust_remote_code=True), name=name)
        return stream_all(folder, *args)
    monkeypatch.setattr(candidates, "stream_all", rewrite)
    manifest = candidates.admit("raced", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed"
    assert manifest["reasons"] == [f"{name}: changed while being read (its bytes differ from those checked)"]
    assert [p.name for p in (tmp_path / "variants" / "raced").iterdir()] == ["quantgate.json"]


def test_wrong_base_model_shapes_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors", lambda t: t.update(
        {"model.embed_tokens.weight": t["model.embed_tokens.weight"][:-8].clone()}))
    assert reasons_of(bad, tiny_model) == [
        "model.safetensors: tensor model.embed_tokens.weight: F16[504, 64] but the base model has BF16/F16/F32/F64[512, 64]"]


def test_other_quantization_methods_are_refused(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda c: c.update(quantization_config={"quant_method": "hqq", "nbits": 4}))
    assert reasons_of(bad, tiny_model) == [
        "config.json quantization_config: quant_method 'hqq' is not one of ['awq', 'bitsandbytes', "
        "'compressed-tensors', 'gptq']"]


# ---------------------------------------------------------------------------------------- code and files

def test_pickle_file_beside_weights_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    torch.save({"x": 1}, bad / "optimizer.pt")
    (bad / "training_args.pkl").write_bytes(b"\x80\x04")
    assert reasons_of(bad, tiny_model) == [
        "optimizer.pt: pickle-based file refused (loading it can run code); only safetensors weights",
        "training_args.pkl: pickle-based file refused (loading it can run code); only safetensors weights",
        f"{bad}: the safetensors weights are here too: delete the other formats, or download without them: "
        f'hf download <repo> --exclude "*.pt" "*.pkl" --local-dir {bad}']


def test_hub_layout_with_other_weight_formats_says_what_to_do(tmp_path, direct_checkpoints, tiny_model):
    """pytorch_model.bin, tf_model.h5, flax_model.msgpack and onnx/ beside the safetensors: still refused."""
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    torch.save({"x": torch.zeros(1)}, bad / "pytorch_model.bin")
    (bad / "tf_model.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    (bad / "flax_model.msgpack").write_bytes(b"\x80")
    (bad / "onnx").mkdir()
    (bad / "onnx" / "model.onnx").write_bytes(b"\x08\x07")
    assert reasons_of(bad, tiny_model) == [
        "flax_model.msgpack: .msgpack weights refused (another framework's format); only safetensors weights",
        "onnx/: sub-folder refused (only ['.cache', 'original'] are ignored and ['additional_chat_templates'] "
        "accepted)",
        "pytorch_model.bin: pickle-based file refused (loading it can run code); only safetensors weights",
        "tf_model.h5: .h5 weights refused (another framework's format); only safetensors weights",
        f"{bad}: the safetensors weights are here too: delete the other formats, or download without them: "
        f'hf download <repo> --exclude "*.msgpack" "onnx/*" "*.bin" "*.h5" --local-dir {bad}']


def test_peft_adapter_is_refused(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "base_model_name_or_path": "x"}))
    assert reasons_of(bad, tiny_model) == [
        "adapter_config.json: a PEFT adapter, not a full checkpoint; merge it into its base model (peft's "
        "merge_and_unload, then save_pretrained) and admit the merged folder"]


def test_auto_map_and_python_files_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}))
    (bad / "modeling_evil.py").write_text("import os\n")
    assert reasons_of(bad, tiny_model) == [
        "modeling_evil.py: .py file refused (executable code)",
        "config.json: auto_map ['AutoModelForCausalLM'] asks to run remote code; refused"]


def test_trust_remote_code_in_a_tokenizer_config_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda c: c.update(init_kwargs={"trust_remote_code": True}), name="tokenizer_config.json")
    assert reasons_of(bad, tiny_model) == [
        "tokenizer_config.json: init_kwargs.trust_remote_code = True asks to run remote code; refused"]


def test_symlinks_sub_folders_and_unknown_files_fail(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    (bad / "tokenizer.json").rename(tmp_path / "elsewhere.json")
    (bad / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    (bad / "checkpoint-500").mkdir()
    (bad / "model.onnx").write_bytes(b"\x08\x07")
    assert reasons_of(bad, tiny_model) == [
        "checkpoint-500/: sub-folder refused (only ['.cache', 'original'] are ignored and "
        "['additional_chat_templates'] accepted)",
        "model.onnx: .onnx weights refused (another framework's format); only safetensors weights",
        "tokenizer.json: symbolic link refused (copy the real files, e.g. `hf download --local-dir`)",
        f"{bad}: the safetensors weights are here too: delete the other formats, or download without them: "
        f'hf download <repo> --exclude "*.onnx" --local-dir {bad}']


def test_rejected_candidate_is_a_recorded_failure_not_a_crash(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_tensors(bad / "model.safetensors",
                 lambda t: t["model.norm.weight"].__setitem__(0, float("nan")))
    manifest = candidates.admit("vendor-awq", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed"
    assert manifest["error"] == "validation failed: model.safetensors: tensor model.norm.weight: 1 NaN/inf values"
    # the copy was written during the one read; a rejection removes it
    assert [p.name for p in (tmp_path / "variants" / "vendor-awq").iterdir()] == ["quantgate.json"]
    with pytest.raises(VariantFailed, match="vendor-awq is not usable: validation failed: model.safetensors"):
        load_variant(tmp_path / "variants" / "vendor-awq")
