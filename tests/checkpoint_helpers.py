"""Helpers for the checkpoint admission tests (tests/test_checkpoints_*.py): copy a real checkpoint and break
one thing in it, the way a real writer would; and the real checkpoints themselves (conftest.py serves them as session
fixtures)."""

from __future__ import annotations

import json
import shutil

from pipelines.checkpoints import admission
from pipelines.checkpoints.shards import INDEX

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


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
    (dest / INDEX).write_text(json.dumps(index, indent=2))
    return dest


def edit_index(folder, change):
    index = json.loads((folder / INDEX).read_text())
    change(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def reasons_of(folder, tiny_model):
    report = admission.validate(folder, str(tiny_model))
    assert not report["admitted"]
    return report["reasons"]


def hub_cache(src, cache, repo_id="vendor/tiny-gptq", revision="a" * 40):
    """`src` laid out as huggingface_hub lays out a download in its cache, with the hub's own link maker:
    blobs named by their sha256 (an LFS file's etag), snapshots/<revision>/<file> a relative link to its blob,
    refs/main naming the revision. Returns what snapshot_download() itself returns for it, offline."""
    import hashlib
    import os

    from huggingface_hub import snapshot_download
    from huggingface_hub.file_download import _create_symlink, repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        link = repo / "snapshots" / revision / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(link), new_blob=False)
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))  # the layout under test: relative links
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)


def library_written(tiny_model, tiny_calibration, root):
    """AWQ (autoawq), GPTQ 3-bit and gptq_v2 4-bit (GPTQModel) and int8 (bitsandbytes) checkpoints of the tiny model,
    written by the libraries themselves, not through quantgate."""
    import torch
    from awq import AutoAWQForCausalLM
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from pipelines.core import logs

    texts = [json.loads(line)["text"] for line in (tiny_calibration / "mixed.jsonl").read_text().splitlines()]
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


def ct_schemes():
    """{kind: (scheme, format)}: the compressed-tensors checkpoints the tests write, one per admitted format and
    strategy (compressed-tensors' own presets where one exists: FP8_DYNAMIC, W8A8, FP8), and the asymmetric pack one
    that transformers cannot load. The block is 48 x 48, so the tiny model's 64-wide layers end in a ragged block."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    def int_args(bits, strategy, symmetric=True, **kw):
        return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, **kw)

    fp8_block = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[48, 48])
    fp8_group = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=32, dynamic=True)
    return {
        "sym": ({"weights": int_args(4, "group", group_size=32)}, "pack-quantized"),
        "asym": ({"weights": int_args(4, "group", False, group_size=32)}, "pack-quantized"),
        "fp8_dynamic": (PRESET_SCHEMES["FP8_DYNAMIC"], "float-quantized"),
        "w8a8": (PRESET_SCHEMES["W8A8"], "int-quantized"),
        "fp8_static": (PRESET_SCHEMES["FP8"], "float-quantized"),
        "fp8_block": ({"weights": fp8_block, "input_activations": fp8_group}, "float-quantized"),
        "w8a8_asym": ({"weights": int_args(8, "channel", False),
                       "input_activations": int_args(8, "token", False, dynamic=True)}, "int-quantized"),
        "naive_int4": ({"weights": int_args(4, "group", group_size=32)}, "naive-quantized"),
    }


def compressed_tensors_written(tiny_model, root):
    """One checkpoint per ct_schemes() kind, written by compressed-tensors' own ModelCompressor (through
    pipelines/checkpoints/compressed_tensors_probe.py write_rtn: round-to-nearest scales, as llm-compressor's RTN path)."""
    import torch

    from pipelines.checkpoints.compressed_tensors_probe import write_rtn
    from pipelines.core import logs

    out = {}
    for kind, (scheme, fmt) in ct_schemes().items():
        with logs.library_output("test"):
            write_rtn(tiny_model, scheme, fmt, root / kind, dtype=torch.float16)
        out[kind] = root / kind
    return out
