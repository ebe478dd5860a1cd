"""Safetensors shards and their index: headers, duplicates, truncation and the index against the shards."""

from __future__ import annotations

import json
import struct

import torch

from pipelines.checkpoints.shards import INDEX
from tests.checkpoint_helpers import SHARDS, broken_copy, edit_index, edit_tensors, reasons_of


def test_duplicate_tensor_across_shards_fails(tmp_path, sharded_checkpoint, tiny_model):
    bad = broken_copy(sharded_checkpoint, tmp_path / "c")
    edit_tensors(bad / SHARDS[1], lambda t: t.update({"model.embed_tokens.weight": torch.zeros(512, 64,
                                                                                                dtype=torch.bfloat16)}))
    assert reasons_of(bad, tiny_model) == [f"tensor model.embed_tokens.weight: in both {SHARDS[0]} and {SHARDS[1]}"]


def test_index_naming_a_missing_shard_fails(tmp_path, sharded_checkpoint, tiny_model):
    bad = broken_copy(sharded_checkpoint, tmp_path / "c")
    edit_index(bad, lambda m: m.update({"model.norm.weight": "model-00003-of-00002.safetensors"}))
    reasons = reasons_of(bad, tiny_model)
    assert f"{INDEX}: lists shard 'model-00003-of-00002.safetensors', which is not in the folder" in reasons


def test_index_putting_a_tensor_in_the_wrong_shard_fails(tmp_path, sharded_checkpoint, tiny_model):
    bad = broken_copy(sharded_checkpoint, tmp_path / "c")
    edit_index(bad, lambda m: m.update({"model.embed_tokens.weight": SHARDS[1]}))
    assert reasons_of(bad, tiny_model) == [
        f"{INDEX}: puts tensor model.embed_tokens.weight in {SHARDS[1]}, but it is in {SHARDS[0]}"]


def test_shard_missing_from_the_index_fails(tmp_path, sharded_checkpoint, tiny_model):
    bad = broken_copy(sharded_checkpoint, tmp_path / "c")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, bad / "model-00003-of-00003.safetensors")
    reasons = reasons_of(bad, tiny_model)
    assert f"model-00003-of-00003.safetensors: not listed in {INDEX}" in reasons
    assert f"model-00003-of-00003.safetensors: tensor x is not listed in {INDEX}" in reasons


def test_several_shards_without_an_index_fail(tmp_path, sharded_checkpoint, tiny_model):
    bad = broken_copy(sharded_checkpoint, tmp_path / "c")
    (bad / INDEX).unlink()
    assert reasons_of(bad, tiny_model) == [
        f"{SHARDS[0]}, {SHARDS[1]}: without {INDEX}, transformers loads only model.safetensors"]


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
