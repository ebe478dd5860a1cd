"""The data pass: every file read once in chunks; what changes between the checks and the copy is refused."""

from __future__ import annotations

import json

import pytest

from pipelines.checkpoints import admission, copying
from pipelines.checkpoints.shards import INDEX
from tests.checkpoint_helpers import SHARDS, broken_copy, edit_config, edit_tensors, reasons_of


def test_nan_in_an_unquantized_tensor_of_a_shard_fails(tmp_path, sharded_checkpoint, tiny_model, monkeypatch):
    bad = broken_copy(sharded_checkpoint, tmp_path / "c")
    assert json.loads((bad / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"] == SHARDS[0]

    def poison(t):
        t["model.embed_tokens.weight"][0, 1] = float("nan")
        t["model.embed_tokens.weight"][-1, -1] = float("-inf")
    edit_tensors(bad / SHARDS[0], poison)
    monkeypatch.setattr(copying, "CHUNK_BYTES", 256)  # the 64 KiB tensor streams in 256 chunks: both are seen
    assert reasons_of(bad, tiny_model) == [f"{SHARDS[0]}: tensor model.embed_tokens.weight: 2 NaN/inf values"]


def test_a_file_that_vanishes_between_the_phases_is_a_refusal(tmp_path, direct_checkpoints, tiny_model, monkeypatch):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    stream_all = copying.stream_all

    def vanish(folder, *args):
        (folder / "quant_log.csv").unlink()
        return stream_all(folder, *args)
    monkeypatch.setattr(copying, "stream_all", vanish)
    report = admission.validate(bad, str(tiny_model))
    assert report["reasons"] == [f"quant_log.csv: No such file or directory ({bad / 'quant_log.csv'})"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_a_small_file_rewritten_between_check_and_copy_is_refused(tmp_path, direct_checkpoints, tiny_model,
                                                                    monkeypatch, name):
    """The race the reviewer ran: auto_map added after the checks read config.json, before the copy."""
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    stream_all = copying.stream_all

    def rewrite(folder, *args):
        edit_config(folder, lambda c: c.update(auto_map={"AutoModelForCausalLM": "evil.Model"},
                                               trust_remote_code=True), name=name)
        return stream_all(folder, *args)
    monkeypatch.setattr(copying, "stream_all", rewrite)
    manifest = admission.admit("raced", str(bad), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed"
    assert manifest["reasons"] == [f"{name}: changed while being read (its bytes differ from those checked)"]
    assert [p.name for p in (tmp_path / "variants" / "raced").iterdir()] == ["quantgate.json"]
