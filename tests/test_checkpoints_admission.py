"""Admission end to end: real GPTQModel/autoawq/bitsandbytes/compressed-tensors outputs in real layouts
pass and load; a refusal or an unexpected error is a recorded failure, never a crash."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from pipelines.checkpoints import admission, context, tensors
from pipelines.checkpoints.shards import INDEX
from pipelines.core.paths import MANIFEST
from pipelines.models.loading import load_variant
from tests.checkpoint_helpers import SHARDS, broken_copy, edit_config, reasons_of


@pytest.mark.parametrize("kind,method,fmt", [("awq", "awq", "gemm"), ("gptq", "gptq", "gptq"),
                                             ("gptq_v2", "gptq", "gptq_v2"), ("int8", "bnb-int8", "bnb-int8")])
def test_library_written_checkpoints_pass(direct_checkpoints, tiny_model, kind, method, fmt):
    config = json.loads((direct_checkpoints[kind] / "config.json").read_text())
    if kind == "gptq_v2":  # GPTQModel really wrote v2 (zeros without the -1 offset), not a converted v1
        assert config["quantization_config"]["checkpoint_format"] == "gptq_v2"
    report = admission.validate(direct_checkpoints[kind], str(tiny_model))
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
    manifest = admission.admit("vendor-gptq", str(snap), str(base), tmp_path / "variants")
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


def test_sharded_checkpoint_is_admitted_and_loads(tmp_path, sharded_checkpoint, tiny_model):
    report = admission.validate(sharded_checkpoint, str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert report["shards"] == 2 and set(report["files"]) >= {*SHARDS, INDEX}
    manifest = admission.admit("vendor-sharded", str(sharded_checkpoint), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["settings"]["bits"] == 3
    model, tok = load_variant(tmp_path / "vendor-sharded")
    ids = tok("12+30=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_compressed_tensors_checkpoint_passes(ct_checkpoints, tiny_model):
    report = admission.validate(ct_checkpoints["sym"], str(tiny_model))
    assert report["admitted"], report["reasons"]
    assert (report["method"], report["bits"], report["group_size"]) == ("compressed-tensors", 4, 32)
    assert report["quantized_layers"] == 7


def test_admitted_compressed_tensors_candidate_loads(tmp_path, ct_checkpoints, tiny_model):
    manifest = admission.admit("vendor-ct", str(ct_checkpoints["sym"]), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["method"] == "compressed-tensors"
    assert manifest["libraries"]["compressed-tensors"] == "0.20.0"
    model, tok = load_variant(tmp_path / "vendor-ct")
    with torch.no_grad():
        assert torch.isfinite(model(tok("12+30=", return_tensors="pt").input_ids).logits).all()


def test_admitted_gptq_v2_candidate_loads(tmp_path, direct_checkpoints, tiny_model):
    manifest = admission.admit("vendor-v2", str(direct_checkpoints["gptq_v2"]), str(tiny_model), tmp_path)
    assert manifest["status"] == "ok" and manifest["settings"]["checkpoint_format"] == "gptq_v2"
    model, tok = load_variant(tmp_path / "vendor-v2")
    with torch.no_grad():
        assert torch.isfinite(model(tok("12+30=", return_tensors="pt").input_ids).logits).all()


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
    manifest = admission.admit("vendor", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed" and manifest["reasons"] == [reason]


def test_an_unexpected_error_is_a_refusal_naming_the_step(tmp_path, direct_checkpoints, tiny_model, monkeypatch):
    """The backstop: whatever a check raises becomes this candidate's recorded failure, never a crashed stage."""
    def broken(*args):
        raise KeyError("weight_map")
    monkeypatch.setattr(tensors, "plan_tensors", broken)
    manifest = admission.admit("vendor", str(direct_checkpoints["gptq"]), str(tiny_model), tmp_path)
    assert manifest["reasons"] == [
        "admission could not check the tensors against the base model: KeyError: 'weight_map'"]
    assert json.loads((tmp_path / "vendor" / MANIFEST).read_text())["status"] == "failed"
    monkeypatch.undo()
    monkeypatch.setattr(tensors.ValueCheck, "__call__", lambda *a: 1 / 0)  # in the data pass's threads
    assert reasons_of(direct_checkpoints["gptq"], tiny_model) == [
        "admission could not check model.safetensors: ZeroDivisionError: division by zero"]


def test_a_check_is_one_function_added_to_a_group(direct_checkpoints, tiny_model, monkeypatch):
    """The interface: a check takes the candidate and returns its reasons; a reason ends the run after its group,
    and an error in it is a refusal naming what the group list says it checks."""
    seen = []

    def tidy(c):
        seen.append(sorted(c.docs))  # what the checks before it in the list set
        return ["config.json: too tidy"]
    monkeypatch.setattr(admission, "PHASE_1", [[*admission.PHASE_1[0], ("the tidiness", tidy)], *admission.PHASE_1[1:]])
    report = admission.validate(direct_checkpoints["gptq"], str(tiny_model))
    assert report["reasons"] == ["config.json: too tidy"] and not report["admitted"]
    assert "config.json" in seen[0] and "notes" in report and "method" not in report  # no later group ran
    monkeypatch.setattr(admission, "PHASE_1", [[("the tidiness", lambda c: 1 / 0)]])
    assert admission.validate(direct_checkpoints["gptq"], str(tiny_model))["reasons"] == [
        "admission could not check the tidiness: ZeroDivisionError: division by zero"] == [
        context.could_not_check("the tidiness", ZeroDivisionError("division by zero"))]

