"""The file policy: code, pickle, other frameworks' weights, PEFT adapters, symlinks, sub-folders,
unknown files and remote code are refused, each by name."""

from __future__ import annotations

import json

import torch

from pipelines.checkpoints.files import classify
from tests.checkpoint_helpers import broken_copy, edit_config, reasons_of


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
        "tokenizer.json: symbolic link refused (not in a huggingface_hub cache snapshot; copy the real files, e.g. "
        "`hf download --local-dir`)",
        f"{bad}: the safetensors weights are here too: delete the other formats, or download without them: "
        f'hf download <repo> --exclude "*.onnx" --local-dir {bad}']


def test_only_vocab_json_and_vocab_txt_are_accepted(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    (bad / "vocab.pickle2").write_bytes(b"\x80\x04junk")
    assert reasons_of(bad, tiny_model) == [
        "vocab.pickle2: unexpected file type; accepted: safetensors, JSON, tokenizer and plain-text files"]
    assert classify("vocab.txt") == ("tokenizer", None)
    assert classify("vocab.json") == ("json", None)
