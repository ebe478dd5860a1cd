"""Stage `admit@<candidate>`: validate a third-party quantized checkpoint before anything loads it.

Loading a checkpoint can run code (pickle, remote code) and a malformed one can crash or silently
mis-load, so nothing here imports the weights through a framework: file types are checked by name,
safetensors headers are parsed by hand, packed tensor shapes are checked against what
`quantization_config` claims and what the base model's shapes imply, and scales are read as plain
tensors. An admitted candidate is copied (the bytes that were validated) into models/variants/<name>/
and judged exactly like a variant the pipeline made; a rejected one gets a manifest with its reasons.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import torch

from pipelines.io import atomic_dir, sha256_file, write_json
from pipelines.models import VARIANTS_DIR

MANIFEST = "quantgate.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".joblib"}
# Inert text kept beside weights by tools (tokenizer merges, READMEs, GPTQModel's quant_log.csv): never loaded as code.
INERT_SUFFIXES = {".txt", ".md", ".csv"}
METHODS = {"gptq": "gptq", "awq": "awq", "bitsandbytes": "bnb-int8"}


def read_safetensors_header(path: Path) -> tuple[dict, list[str]]:
    """(tensor table, reasons it is malformed) following the safetensors format rules."""
    size = path.stat().st_size
    if size < 8:
        return {}, [f"{path.name}: {size} bytes, shorter than the 8-byte header length"]
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > MAX_HEADER_BYTES:
            return {}, [f"{path.name}: header length {n} exceeds {MAX_HEADER_BYTES} bytes"]
        if 8 + n > size:
            return {}, [f"{path.name}: header length {n} runs past the end of the file ({size} bytes): truncated"]
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, [f"{path.name}: header is not UTF-8 JSON ({err})"]
    header.pop("__metadata__", None)
    reasons: list[str] = []
    spans = []
    for name, info in header.items():
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BYTES or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
            reasons.append(f"{path.name}: tensor {name}: malformed entry {info}")
            continue
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != expected:
            reasons.append(f"{path.name}: tensor {name}: {dtype}{shape} needs {expected} bytes, offsets span "
                           f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            reasons.append(f"{path.name}: tensor {name}: starts at byte {begin}, expected {cursor} (offsets must be contiguous)")
        cursor = end
    if cursor != size - 8 - n:
        reasons.append(f"{path.name}: tensors end at byte {cursor} of a {size - 8 - n}-byte data section "
                       f"({'truncated' if cursor > size - 8 - n else 'trailing bytes'})")
    return header, reasons


def check_files(folder: Path) -> list[str]:
    reasons = []
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            reasons.append(f"{p.name}: symbolic link refused")
        elif p.is_dir():
            reasons.append(f"{p.relative_to(folder)}/: sub-folders are not part of a checkpoint")
        elif p.suffix in PICKLE_SUFFIXES:
            reasons.append(f"{p.name}: pickle-based file refused (loading it can run code); only safetensors weights")
        elif p.suffix == ".py":
            reasons.append(f"{p.name}: Python file refused (remote code)")
        elif p.suffix not in {".safetensors", ".json"} | INERT_SUFFIXES:
            reasons.append(f"{p.name}: unexpected file type; only .safetensors, .json and plain text are accepted")
    return reasons


def check_remote_code(folder: Path) -> list[str]:
    reasons = []
    for p in sorted(folder.glob("*.json")):
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            reasons.append(f"{p.name}: not valid JSON ({err})")
            continue
        if isinstance(data, dict):
            if "auto_map" in data:
                reasons.append(f"{p.name}: auto_map {sorted(data['auto_map'])} asks to run remote code; refused")
            if data.get("trust_remote_code"):
                reasons.append(f"{p.name}: trust_remote_code is set; refused")
    return reasons


def base_shapes(base_dir: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, int]]]:
    """(parameter shapes, linear modules as (in, out)) of the base model, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return params, linears


def packed_shapes(method: str, n_in: int, n_out: int, bits: int, group: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Expected (dtype, shape) of each packed tensor of one linear layer (see docs/quantize.md)."""
    groups = -(-n_in // group) if group > 0 else 1
    if method == "gptq":
        return {"qweight": ("I32", (n_in * bits // 32, n_out)), "qzeros": ("I32", (groups, n_out * bits // 32)),
                "scales": ("F16", (groups, n_out)), "g_idx": ("I32", (n_in,))}
    if method == "awq":
        return {"qweight": ("I32", (n_in, n_out * bits // 32)), "qzeros": ("I32", (groups, n_out * bits // 32)),
                "scales": ("F16", (groups, n_out))}
    return {"weight": ("I8", (n_out, n_in)), "SCB": ("F32", (n_out,))}


def check_tensors(folder: Path, config: dict, base_dir: str) -> tuple[list[str], dict]:
    reasons: list[str] = []
    tensors: dict[str, tuple[Path, dict]] = {}
    for p in sorted(folder.glob("*.safetensors")):
        header, bad = read_safetensors_header(p)
        reasons += bad
        tensors.update({name: (p, info) for name, info in header.items()})
    if not list(folder.glob("*.safetensors")):
        return ["no .safetensors weights in the checkpoint"], {}
    if reasons:
        return reasons, {}

    qc = config.get("quantization_config") or {}
    method = METHODS.get(qc.get("quant_method"), "none") if qc else "none"
    bits = 8 if method == "bnb-int8" else qc.get("bits")
    group = qc.get("group_size", -1) if method != "bnb-int8" else 0
    if method in ("gptq", "awq") and (not isinstance(bits, int) or bits not in (2, 3, 4, 8)):
        return [f"config.json: quantization_config.bits {bits!r} is not one of 2, 3, 4, 8"], {}
    if method == "gptq" and qc.get("checkpoint_format", qc.get("format", "gptq")) not in ("gptq",):
        return [f"config.json: GPTQ checkpoint_format {qc.get('checkpoint_format')!r}: only 'gptq' (v1) is supported"], {}
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        return [f"config.json: AWQ version {qc.get('version')!r}: only GEMM packing is supported"], {}

    params, linears = base_shapes(base_dir)
    checked_quantized, scale_tensors = 0, []
    seen: set[str] = set()
    for module, (n_in, n_out) in linears.items():
        marker = f"{module}.qweight" if method in ("gptq", "awq") else f"{module}.SCB"
        if marker not in tensors:
            continue
        checked_quantized += 1
        for suffix, (dtype, shape) in packed_shapes(method, n_in, n_out, bits, group).items():
            name = f"{module}.{suffix}"
            seen.add(name)
            if name not in tensors:
                reasons.append(f"{name}: missing for a {method} layer")
                continue
            got_dtype, got_shape = tensors[name][1]["dtype"], tuple(tensors[name][1]["shape"])
            if got_shape != shape or (got_dtype != dtype and not (suffix == "scales" and got_dtype in ("BF16", "F32"))):
                reasons.append(f"{name}: {got_dtype}{list(got_shape)} but quantization_config (bits={bits}, "
                               f"group_size={group}) and the base layer ({n_in} -> {n_out}) imply {dtype}{list(shape)}")
            if suffix in ("scales", "SCB"):
                scale_tensors.append(name)
        seen.add(f"{module}.weight")  # a quantized layer has no fp weight to compare
        seen.update(f"{module}.{extra}" for extra in ("bias", "weight_format"))
    if method != "none" and checked_quantized == 0:
        reasons.append(f"config.json says {method} but no layer holds {method} tensors")
    for name, shape in params.items():
        if name in seen:
            continue
        if name not in tensors:
            reasons.append(f"{name}: missing (the base model has {list(shape)})")
        elif tuple(tensors[name][1]["shape"]) != shape:
            reasons.append(f"{name}: shape {tensors[name][1]['shape']} but the base model has {list(shape)}")
    if reasons:
        return reasons, {}

    from safetensors import safe_open

    for name in scale_tensors:
        path = tensors[name][0]
        with safe_open(str(path), framework="pt") as fh:
            values = fh.get_tensor(name).float()
        if not torch.isfinite(values).all():
            reasons.append(f"{name}: {int((~torch.isfinite(values)).sum())} non-finite scale values (NaN/inf)")
        elif not (values > 0).all():
            reasons.append(f"{name}: {int((values <= 0).sum())} scale values <= 0")
    return reasons, {"method": method, "bits": bits, "group_size": group, "tensors": len(tensors),
                     "quantized_layers": checked_quantized}


def validate(folder: str | Path, base_dir: str) -> dict:
    """Every check, in order of how dangerous it is to go further; reasons name file and tensor."""
    folder = Path(folder)
    if not folder.is_dir():
        return {"admitted": False, "reasons": [f"{folder}: not a directory"]}
    reasons = check_files(folder) + check_remote_code(folder)
    if not (folder / "config.json").is_file():
        reasons.append("config.json: missing")
    details: dict = {}
    if not reasons:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        reasons, details = check_tensors(folder, config, base_dir)
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and not p.is_symlink()}
    return {"admitted": not reasons, "reasons": reasons, "files": files, **details}


def admit(name: str, path: str, base_dir: str, out_root: Path = VARIANTS_DIR) -> dict:
    """Validate, then copy the validated bytes into out_root/name with a manifest, or record the rejection."""
    from pipelines.quantize import disk_bytes, library_versions

    report = validate(path, base_dir)
    manifest = {"variant": name, "candidate": True, "source_path": str(path), "base_model": base_dir,
                "libraries": library_versions(), "validation": report}
    with atomic_dir(out_root / name) as tmp:
        if report["admitted"]:
            for file in report["files"]:
                shutil.copy2(Path(path) / file, tmp / file)
            copied = {f: sha256_file(tmp / f) for f in report["files"]}
            if copied != report["files"]:  # the checkpoint changed while we copied it
                changed = sorted(f for f in copied if copied[f] != report["files"][f])
                report["admitted"] = False
                report["reasons"] = [f"{f}: changed while being copied" for f in changed]
                for f in report["files"]:
                    (tmp / f).unlink()
        if report["admitted"]:
            config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "float16")
            manifest.update({"status": "ok", "method": report["method"], "dtype": dtype if dtype in
                             ("float16", "bfloat16", "float32") else "float16",
                             "settings": {"method": report["method"], "bits": report["bits"],
                                          "group_size": report["group_size"]},
                             "disk_bytes": disk_bytes(tmp), "files": report["files"]})
        else:
            manifest.update({"status": "failed", "method": report.get("method"), "reasons": report["reasons"],
                             "error": "validation failed: " + "; ".join(report["reasons"][:5])})
        write_json(tmp / MANIFEST, manifest)
    return manifest
