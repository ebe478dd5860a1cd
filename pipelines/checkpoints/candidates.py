"""Stage `admit@<candidate>`: validate a third-party quantized checkpoint before anything loads it.

Loading a checkpoint can run code (pickle, remote code) and a malformed one can crash or silently
mis-load, so nothing here loads the model through a framework. Validation runs in two phases:

1. Cheap checks that read no weight bytes: the file policy (names and types; no code, no pickle, no
   symlinks, no PEFT adapter), every JSON file (no auto_map / trust_remote_code), every quantization
   config a loader may read (they must agree, missing settings counting as their reader's default,
   and hold only allow-listed keys), the whole config against the base model's (only DRIFT_ALLOWED
   keys may differ), the tokenizer's length, the tokenizer's behaviour and generation_config.json
   against the base model's, every safetensors header (the
   safetensors library's own validation), the index against the shards, and the tensor names,
   dtypes and shapes against the base model and what the quantization config implies. The small
   files (JSON, tokenizer, text) are read whole here and their sha256 kept.
2. One pass over the bytes: each file is read once, in bounded chunks, and each chunk is hashed
   (sha256, in a second thread), checked (NaN/inf in every floating tensor, g_idx range, scale sign)
   and, when admitting, written to the copy. The copy therefore holds exactly the bytes that were
   hashed and checked, with no second read of a shard and no re-hash (docs/quantize.md,
   benchmarks/admission_cost.py); a small file whose sha256 differs from phase 1's, or a shard whose
   header differs, changed in between and is refused.

Nothing a candidate contains can stop the stage: an unexpected error in a check is recorded as that
candidate's refusal, naming what was being checked.

An admitted candidate lands in models/variants/<name>/ and is judged exactly like a variant the
pipeline made; a rejected one gets a manifest with every reason, each naming its file and tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipelines.core.io import atomic_dir, write_json
from pipelines.models.loading import VARIANTS_DIR
from pipelines.core.paths import MANIFEST

INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 8 << 20  # bounded memory per read (two buffers per file being read)
METHODS = {"gptq": "gptq", "awq": "awq", "bitsandbytes": "bnb-int8", "compressed-tensors": "compressed-tensors"}
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v2 (GPTQModel) stores zeros without the -1 offset; same shapes
# method -> (the tensor that marks a layer as quantized, that layer's scale tensor)
MARKERS = {"gptq": ("qweight", "scales"), "awq": ("qweight", "scales"), "bnb-int8": ("SCB", "SCB"),
           "compressed-tensors": ("weight_packed", "weight_scale"), "none": ("", "")}

# ---- file policy -------------------------------------------------------------------------------
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".joblib", ".dill"}
CODE_SUFFIXES = {".py", ".pyc", ".pyo", ".pyd", ".so", ".dll", ".dylib", ".sh", ".ipynb", ".exe"}
IGNORED_DIRS = {".cache": "download tool state (huggingface_hub --local-dir)",
                "original": "the publisher's original-format weights, not what transformers loads"}
# transformers writes extra chat templates as additional_chat_templates/<name>.jinja beside the tokenizer
TEMPLATE_DIRS = {"additional_chat_templates": {".jinja"}}
# vocab.json / vocab.txt: the only vocab.* names transformers' tokenizers read (VOCAB_FILES_NAMES); any other
# vocab.<suffix> is an unexpected file, not a wildcard
TOKENIZER_NAMES = {"tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "merges.txt", "vocab.json",
                   "vocab.txt"}
TOKENIZER_SUFFIXES = {".tiktoken", ".spm", ".jinja"}
TEXT_PREFIXES = ("LICENSE", "LICENCE", "README", "NOTICE", "COPYING", "USE_POLICY")
TEXT_SUFFIXES = {".md", ".txt", ".csv"}  # inert text: READMEs, GPTQModel's quant_log.csv
# other frameworks' weights, which hub repositories often ship beside the safetensors ones (pickle or code-capable)
OTHER_WEIGHT_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx_data", ".gguf"}
OTHER_WEIGHT_DIRS = {"onnx", "openvino", "coreml"}
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}
# every non-weights file is read whole in phase 1 (its bytes parsed and hashed); the largest real
# tokenizer.json files are tens of MB
MAX_SMALL_BYTES = 256 << 20

# ---- config drift --------------------------------------------------------------------------------
DRIFT_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings",
              "tie_word_embeddings")
# The only config keys a candidate may change (everything else is compared with the base's, docs/quantize.md):
# how the file was written, the dtype its weights were saved in (a quantizer loads fp16), the KV-cache switch.
DRIFT_ALLOWED = {"transformers_version": "written by whichever transformers saved it",
                 "_name_or_path": "where it was loaded from",
                 "dtype": "the dtype the weights were saved in; the tensor checks cover it",
                 "torch_dtype": "the older spelling of dtype",
                 "use_cache": "a runtime switch for the KV cache, not the model's function"}

# ---- tensors ------------------------------------------------------------------------------------
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
INT_DTYPES = {"I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}


# =================================================================================================
# Phase 1: cheap checks (no weight bytes read)
# =================================================================================================

def classify(rel: str) -> tuple[str | None, str | None]:
    """(kind, None) for an accepted file, (None, reason) for a refused one; `rel` is relative to the folder."""
    parts = rel.split("/")
    name, suffix = parts[-1], Path(parts[-1]).suffix.lower()
    if name in PEFT_FILES:
        return None, (f"{rel}: a PEFT adapter, not a full checkpoint; merge it into its base model "
                      "(peft's merge_and_unload, then save_pretrained) and admit the merged folder")
    if suffix in PICKLE_SUFFIXES:
        return None, f"{rel}: pickle-based file refused (loading it can run code); only safetensors weights"
    if suffix in OTHER_WEIGHT_SUFFIXES:
        return None, f"{rel}: {suffix} weights refused (another framework's format); only safetensors weights"
    if suffix in CODE_SUFFIXES:
        return None, f"{rel}: {suffix} file refused (executable code)"
    if len(parts) > 1:
        allowed = TEMPLATE_DIRS.get(parts[0], set())
        if len(parts) == 2 and suffix in allowed:
            return "tokenizer", None
        return None, f"{rel}: unexpected file in sub-folder {parts[0]}/ (only {sorted(allowed)} files are accepted there)"
    if name.endswith(".safetensors"):
        return "weights", None
    if suffix == ".json":
        return "json", None
    if name in TOKENIZER_NAMES or suffix in TOKENIZER_SUFFIXES:
        return "tokenizer", None
    if name.startswith(TEXT_PREFIXES) or name == ".gitattributes" or suffix in TEXT_SUFFIXES:
        return "text", None
    return None, f"{rel}: unexpected file type; accepted: safetensors, JSON, tokenizer and plain-text files"


def list_files(folder: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """({relative path: kind} to copy, reasons to refuse, notes) under the file policy."""
    files: dict[str, str] = {}
    reasons: list[str] = []
    notes: list[str] = []

    def visit(path: Path) -> None:
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            reasons.append(f"{rel}: symbolic link refused (copy the real files, e.g. `hf download --local-dir`)")
        elif path.is_dir():
            if path.parent == folder and path.name in IGNORED_DIRS:
                count = sum(1 for p in path.rglob("*") if not p.is_dir())
                notes.append(f"{rel}/: ignored, not copied ({count} files; {IGNORED_DIRS[path.name]})")
            elif path.parent == folder and path.name in TEMPLATE_DIRS:
                for child in sorted(path.iterdir()):
                    visit(child)
            else:
                reasons.append(f"{rel}/: sub-folder refused (only {sorted(IGNORED_DIRS)} are ignored and "
                               f"{sorted(TEMPLATE_DIRS)} accepted)")
        elif not path.is_file():
            reasons.append(f"{rel}: not a regular file")
        else:
            kind, reason = classify(rel)
            if kind:
                files[rel] = kind
            else:
                reasons.append(reason)

    for entry in sorted(folder.iterdir()):
        visit(entry)
    hint = download_hint(folder, files, reasons)
    return files, reasons + ([hint] if hint else []), notes


def download_hint(folder: Path, files: dict[str, str], reasons: list[str]) -> str | None:
    """What to do when other frameworks' weights sit beside safetensors ones (a common hub layout)."""
    if not any(kind == "weights" for kind in files.values()):
        return None
    patterns = []
    for reason in reasons:
        rel = reason.split(": ", 1)[0]
        if rel.rstrip("/") in OTHER_WEIGHT_DIRS and rel.endswith("/"):
            patterns.append(f'"{rel}*"')
        elif "/" not in rel and Path(rel).suffix.lower() in OTHER_WEIGHT_SUFFIXES | PICKLE_SUFFIXES:
            patterns.append(f'"*{Path(rel).suffix.lower()}"')
    if not patterns:
        return None
    return (f"{folder}: the safetensors weights are here too: delete the other formats, or download without them: "
            f"hf download <repo> --exclude {' '.join(dict.fromkeys(patterns))} --local-dir {folder}")


def find_remote_code(data, where: str = "") -> list[str]:
    """Paths of auto_map keys and truthy trust_remote_code anywhere in a parsed JSON document."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{where}.{key}" if where else key
            if key == "auto_map":
                found.append(f"{path} {sorted(value) if isinstance(value, dict) else value!r}")
            elif key == "trust_remote_code" and value:
                found.append(f"{path} = {value!r}")
            else:
                found += find_remote_code(value, path)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += find_remote_code(value, f"{where}[{i}]")
    return found


def read_small(folder: Path, files: dict[str, str]) -> tuple[dict, dict[str, str], dict[str, int], list[str]]:
    """(parsed JSON files, {file: sha256}, {file: size} of every non-weights file, reasons) from one read of each.

    The data pass copies these files again and must find the same sha256: a config.json rewritten
    between the checks and the copy (to add auto_map, say) is refused, not copied unchecked.
    """
    docs, digests, sizes, reasons = {}, {}, {}, []
    for rel, kind in files.items():
        if kind == "weights":
            continue
        with (folder / rel).open("rb") as fh:
            raw = fh.read(MAX_SMALL_BYTES + 1)
        if len(raw) > MAX_SMALL_BYTES:
            reasons.append(f"{rel}: larger than {MAX_SMALL_BYTES >> 20} MiB; refused for a {kind} file")
            continue
        digests[rel], sizes[rel] = hashlib.sha256(raw).hexdigest(), len(raw)
        if kind != "json":
            continue
        try:
            docs[rel] = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            reasons.append(f"{rel}: not valid JSON ({type(err).__name__}: {err})")
            continue
        for hit in find_remote_code(docs[rel]):
            reasons.append(f"{rel}: {hit} asks to run remote code; refused")
    return docs, digests, sizes, reasons


# Where the loaders read the quantization config: GPTQModel takes the first of these files that exists
# (gptqmodel/quantization/config.py, QUANT_CONFIG_FILENAME_COMPAT); transformers reads only config.json's.
QUANT_SOURCES = ("quantize_config.json", "quant_config.json", "config.json")
# The settings every source must agree on, each with the spellings the writers use for it.
QUANT_KEYS = {"quant_method": ("quant_method", "method"), "bits": ("bits",), "group_size": ("group_size",),
              "sym": ("sym",), "desc_act": ("desc_act",), "checkpoint_format": ("checkpoint_format", "format")}


def source_name(source: str) -> str:
    return "config.json quantization_config" if source == "config.json" else source


def quant_sources(config: dict, docs: dict) -> tuple[dict[str, dict], list[str]]:
    """{file: quantization config} for every place a loader may read one, in GPTQModel's order, or reasons."""
    found, reasons = {}, []
    for source in QUANT_SOURCES:
        qc = config.get("quantization_config") if source == "config.json" else docs.get(source)
        if qc is None and (source == "config.json" or source not in docs):
            continue
        if not isinstance(qc, dict):
            reasons.append(f"{source_name(source)} is a {type(qc).__name__}, not a JSON object")
        else:
            found[source] = qc
    return found, reasons


# What each reader assumes for a setting its file leaves out: GPTQModel for quantize_config.json/quant_config.json
# (gptqmodel/quantization/config.py BaseQuantizeConfig: bits 4, group_size 128, desc_act None -> False, sym True,
# method and format gptq), transformers' GPTQConfig for config.json (the same, but no method: it must be stated).
# A file that leaves out a setting another file states is compared with its reader's default, not skipped.
GPTQ_DEFAULTS = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
                 "checkpoint_format": "gptq"}

# The quantization-config keys the real writers put there, per method: GPTQModel's QuantizeConfig.to_dict,
# transformers' GPTQConfig/AwqConfig/BitsAndBytesConfig.to_dict, AutoGPTQ's and autoawq's side files, and
# compressed-tensors' ModelCompressor.update_config. Any other key is refused (a loader may act on it unchecked).
_GPTQ_TRANSFORMERS = {"act_group_aware", "backend", "batch_size", "bits", "block_name_to_quantize",
                      "cache_block_outputs", "checkpoint_format", "damp_percent", "dataset", "desc_act", "format",
                      "group_size", "max_input_length", "meta", "model_seqlen", "module_name_preceding_first_block",
                      "modules_in_block_to_quantize", "pad_token_id", "quant_method", "sym", "tokenizer",
                      "true_sequential", "use_exllama", "exllama_config", "use_cuda_fp16"}
QC_KEYS = {
    "gptq": _GPTQ_TRANSFORMERS | {"method", "lm_head", "pack_dtype", "adapter", "dynamic",  # GPTQModel
                                  "static_groups", "model_name_or_path", "model_file_base_name"},  # AutoGPTQ
    "awq": _GPTQ_TRANSFORMERS | {"zero_point", "version", "modules_to_not_convert",  # transformers' AwqConfig
                                 "w_bit", "q_group_size", "do_fuse", "fuse_max_seq_len", "modules_to_fuse"},  # autoawq
    "bitsandbytes": {"_load_in_4bit", "_load_in_8bit", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage",
                     "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "llm_int8_enable_fp32_cpu_offload",
                     "llm_int8_has_fp16_weight", "llm_int8_skip_modules", "llm_int8_threshold", "load_in_4bit",
                     "load_in_8bit", "quant_method"},
    "compressed-tensors": {"config_groups", "format", "global_compression_ratio", "ignore", "kv_cache_scheme",
                           "moe_sparsity_config", "quant_method", "quantization_status", "sparsity_config",
                           "transform_config", "version", "provider"},
}
# Allowed keys that must be empty (null, {}, []): each changes what is loaded in a way the checks do not follow.
QC_EMPTY_ONLY = {
    "adapter": "GPTQModel would load LoRA weights from that path or hub repo, bytes outside the checked folder "
               "(never hashed, checked or registered)",
    "dynamic": "GPTQModel would change bits/group size per module or skip modules, while the checks assume one "
               "setting for every layer",
    "modules_in_block_to_quantize": "it changes which layers the loader quantizes; the checks assume every layer",
    "modules_to_not_convert": "the loader would treat the named layers as unquantized, which is not checked "
                              "against the tensors",
    "llm_int8_skip_modules": "the loader would treat the named layers as unquantized, which is not checked "
                             "against the tensors",
    "moe_sparsity_config": "sparsity is not admitted",
}


def stated_method(source: str, qc: dict):
    """The method a file states, or the one its reader assumes (GPTQModel: gptq); None when none applies."""
    method = qc.get("quant_method", qc.get("method"))
    if method is None and source != "config.json":
        return "gptq"  # an AutoGPTQ quantize_config.json states no method: it is GPTQ's file
    return method


def unknown_keys(source: str, qc: dict, method) -> list[str]:
    """Keys the method's writers never put there, and keys that must be empty but are not."""
    allowed = QC_KEYS.get(method)
    if allowed is None:
        return []  # an unknown method is refused by name elsewhere
    reasons = []
    for key in sorted(qc):
        if key not in allowed:
            reasons.append(f"{source_name(source)}: key {key!r} is not one the {method} writers use; refused "
                           f"(a loader may act on it unchecked)")
        elif key in QC_EMPTY_ONLY and qc[key] not in (None, {}, []):
            reasons.append(f"{source_name(source)}: {key} {qc[key]!r} refused: {QC_EMPTY_ONLY[key]}")
    return reasons


def agreed_settings(sources: dict[str, dict]) -> list[str]:
    """Every file must say the same thing (a loader that reads another file must not load something else).

    A GPTQ file that leaves a setting out is compared with the default its reader fills in (GPTQ_DEFAULTS).
    """
    reasons, seen = [], {}  # key -> (value, source, spelling)
    for source, qc in sources.items():
        gptq = stated_method(source, qc) == "gptq"
        for key, spellings in QUANT_KEYS.items():
            values = {spelling: qc[spelling] for spelling in spellings if spelling in qc}
            if len(set(map(json.dumps, values.values()))) > 1:
                a, b = list(values)[:2]
                reasons.append(f"{source_name(source)}: {a} {values[a]!r} but {b} {values[b]!r}")
                continue
            if values:
                spelling, value = next(iter(values.items()))
            elif gptq and key in GPTQ_DEFAULTS and not (key == "quant_method" and source == "config.json"):
                reader = "transformers'" if source == "config.json" else "GPTQModel's"
                spelling, value = f"{key} (not set there, so {reader} default)", GPTQ_DEFAULTS[key]
            else:
                continue
            if key in seen and json.dumps(seen[key][0]) != json.dumps(value):
                first, where, other = seen[key]
                reasons.append(f"{source_name(source)}: {spelling} {value!r}, but {source_name(where)} says "
                               f"{other} {first!r} (the loaders read different files; they must agree)")
            seen.setdefault(key, (value, source, spelling))
    return reasons


def quant_settings(config: dict, docs: dict) -> tuple[dict, list[str]]:
    """(method, bits, group size, format) from the quantization config the loader reads, or reasons.

    Every file that holds one (quantize_config.json, quant_config.json, config.json's
    quantization_config) must agree on QUANT_KEYS (a missing setting counts as its reader's default)
    and hold only the keys its method's writers use (QC_KEYS); config.json must hold one, since
    transformers reads only that; GPTQ is validated with the file GPTQModel reads first, the other
    methods with config.json's.
    """
    sources, reasons = quant_sources(config, docs)
    if reasons:
        return {}, reasons
    if not sources:
        return {"method": "none", "bits": None, "group_size": None, "checkpoint_format": None}, []
    reasons = agreed_settings(sources)
    if reasons:
        return {}, reasons
    first = next(iter(sources))
    qc = sources[first]
    method = stated_method(first, qc)
    for source, one in sources.items():
        reasons += unknown_keys(source, one, stated_method(source, one) or method)
    if reasons:
        return {}, reasons
    if "config.json" not in sources:
        return {}, [f"{first}: quant_method {method!r}, but config.json has no quantization_config "
                    "(transformers would load the packed tensors as an unquantized model)"]
    if stated_method("config.json", sources["config.json"]) is None:
        return {}, ["config.json quantization_config: no quant_method (transformers cannot tell how to load it)"]
    if method != "gptq":
        first, qc = "config.json", sources["config.json"]
    where = f"{source_name(first)}"
    if method == "compressed-tensors":
        return compressed_tensors_settings(qc)
    if method not in METHODS:
        return {}, [f"{where}: quant_method {method!r} is not one of {sorted(METHODS)}"]
    if method == "bitsandbytes":
        if qc.get("load_in_8bit") is not True or qc.get("load_in_4bit"):
            return {}, [f"{where}: bitsandbytes is admitted only as int8 (load_in_8bit: true)"]
        return {"method": "bnb-int8", "bits": 8, "group_size": 0, "checkpoint_format": "bnb-int8"}, []
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if type(bits) is not int or bits not in (2, 3, 4, 8):
        return {}, [f"{where}: bits {bits!r} is not one of 2, 3, 4, 8"]
    if type(group) is not int or (group <= 0 and group != -1):
        return {}, [f"{where}: group_size {group!r} is not a positive integer or -1"]
    if method == "gptq":
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in GPTQ_FORMATS:
            return {}, [f"{where}: GPTQ checkpoint_format {fmt!r}: only {list(GPTQ_FORMATS)} are admitted"]
    else:
        fmt = str(qc.get("version", "gemm")).lower()
        if fmt != "gemm":
            return {}, [f"{where}: AWQ version {qc.get('version')!r}: only GEMM packing is admitted"]
    return {"method": METHODS[method], "bits": bits, "group_size": group, "checkpoint_format": fmt}, []


def compressed_tensors_settings(qc: dict) -> tuple[dict, list[str]]:
    """llm-compressor's format as vLLM serves it: weight-only int4/int8, pack-quantized, one weight scheme.

    Activation quantization, sparsity, transforms and the other formats (naive, float, nvfp4, ...) are
    refused: each changes what the tensors mean, and none of them can be written and loaded here to test.
    """
    where = "config.json: compressed-tensors"
    if qc.get("format") != "pack-quantized" or qc.get("quantization_status") != "compressed":
        return {}, [f"{where} format {qc.get('format')!r} (status {qc.get('quantization_status')!r}): only "
                    "'pack-quantized', 'compressed' is admitted"]
    if qc.get("sparsity_config") or qc.get("transform_config") or qc.get("kv_cache_scheme"):
        return {}, [f"{where}: sparsity, transforms and kv-cache quantization are not admitted"]
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        return {}, [f"{where}: config_groups is a {type(groups).__name__}, not a JSON object"]
    schemes = []
    for name, scheme in groups.items():
        if not isinstance(scheme, dict):
            return {}, [f"{where}: config_groups.{name} is a {type(scheme).__name__}, not a JSON object"]
        if scheme.get("input_activations") or scheme.get("output_activations"):
            return {}, [f"{where}: config_groups.{name} quantizes activations; only weight-only schemes are admitted"]
        if scheme.get("format") not in (None, "pack-quantized"):
            return {}, [f"{where}: config_groups.{name} format {scheme.get('format')!r} is not 'pack-quantized'"]
        weights = scheme.get("weights") or {}
        if not isinstance(weights, dict):
            return {}, [f"{where}: config_groups.{name}.weights is a {type(weights).__name__}, not a JSON object"]
        schemes.append(weights)
    if not schemes or any(w != schemes[0] for w in schemes):
        return {}, [f"{where}: config_groups must hold one weight scheme (found {len(set(map(str, schemes)))})"]
    w = schemes[0]
    bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if w.get("type") != "int" or bits not in (4, 8) or w.get("dynamic") or strategy not in ("group", "channel") \
            or (strategy == "group" and (not isinstance(group, int) or group <= 0)):
        return {}, [f"{where}: weights {w}: only static int 4/8-bit, group or channel strategy is admitted"]
    if not w.get("symmetric", True):  # the compressor packs zero points that the loader then expects unpacked
        return {}, [f"{where}: asymmetric weights are not admitted: transformers 5.24 with compressed-tensors "
                    "0.20.0 cannot load the packed weight_zero_point that compressed-tensors writes (size mismatch)"]
    return {"method": "compressed-tensors", "bits": bits, "group_size": group if strategy == "group" else -1,
            "checkpoint_format": "pack-quantized"}, []


def normalized_config(config: dict):
    """The config as transformers reads it (defaults filled in, legacy rope_theta/rope_scaling folded in)."""
    from transformers import AutoConfig

    clean = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    return AutoConfig.for_model(**clean)


def rope_of(cfg) -> tuple[object, dict]:
    """(rope_theta, the rest of the rope parameters) whichever way the config spells them."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(cfg, "rope_theta", None))
    scaling = params or dict(getattr(cfg, "rope_scaling", None) or {})
    if scaling.get("rope_type", scaling.get("type")) in (None, "default") and len(scaling) <= 1:
        scaling = {}  # "default" rope with nothing else is no scaling
    return theta, scaling


def config_drift(config: dict, base_dir: str) -> list[str]:
    """Reasons the candidate's config.json differs from the base model's where it changes the model."""
    from transformers import AutoConfig

    try:
        cand = normalized_config(config)
    except (ValueError, KeyError, TypeError) as err:
        return [f"config.json: transformers cannot read it ({err})"]
    base = AutoConfig.from_pretrained(base_dir)
    reasons = []
    for key in DRIFT_KEYS:
        mine, theirs = getattr(cand, key, None), getattr(base, key, None)
        if mine != theirs:
            reasons.append(f"config.json: {key} is {mine!r}, the base model has {theirs!r}")
    # Every other key too (hidden_act, rms_norm_eps, token ids, ...): they change what the model computes
    # without changing a shape. Only DRIFT_ALLOWED may differ; rope is compared above, spelling-independently.
    mine, theirs = cand.to_dict(), base.to_dict()
    skip = set(DRIFT_KEYS) | set(DRIFT_ALLOWED) | {"rope_parameters", "rope_theta", "rope_scaling"}
    for key in sorted((set(mine) | set(theirs)) - skip):
        if json.dumps(mine.get(key), sort_keys=True, default=str) != \
                json.dumps(theirs.get(key), sort_keys=True, default=str):
            reasons.append(f"config.json: {key} is {mine.get(key)!r}, the base model has {theirs.get(key)!r}")
    (theta, scaling), (base_theta, base_scaling) = rope_of(cand), rope_of(base)
    if theta != base_theta:
        reasons.append(f"config.json: rope_theta is {theta!r}, the base model has {base_theta!r}")
    if scaling != base_scaling:
        reasons.append(f"config.json: rope_scaling is {scaling or None!r}, the base model has {base_scaling or None!r}")
    return reasons


def tokenizer_size(docs: dict) -> tuple[tuple[int, str] | None, list[str]]:
    """((largest token id + 1, file it comes from), reasons) from the shipped tokenizer files, without loading them."""
    best, reasons = None, []
    tok = docs.get("tokenizer.json")
    if tok is not None:
        model = tok.get("model") if isinstance(tok, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        extra = tok.get("added_tokens") if isinstance(tok, dict) else None
        if not isinstance(tok, dict):
            reasons.append(f"tokenizer.json: a {type(tok).__name__}, not a JSON object")
        elif not isinstance(model, dict):
            reasons.append(f"tokenizer.json: model is a {type(model).__name__}, not a JSON object")
        elif not isinstance(vocab, (dict, list, type(None))):  # token -> id (BPE, WordPiece), [piece, score] (Unigram)
            reasons.append(f"tokenizer.json: model.vocab is a {type(vocab).__name__}, not an object or a list")
        elif not isinstance(extra, (list, type(None))) or not all(
                isinstance(t, dict) and type(t.get("id")) is int for t in extra or []):
            reasons.append("tokenizer.json: added_tokens is not a list of {id: integer, ...} objects")
        else:
            ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or [])))
            bad = [k for k, v in (vocab.items() if isinstance(vocab, dict) else ()) if type(v) is not int]
            if bad:
                reasons.append(f"tokenizer.json: model.vocab token {bad[0]!r} has id {vocab[bad[0]]!r}, not an integer")
            ids = [i for i in ids if type(i) is int] + [t["id"] for t in extra or []]
            if ids:
                best = (max(ids) + 1, "tokenizer.json")
    added = docs.get("added_tokens.json")
    if added is not None:
        bad = [k for k, v in added.items() if type(v) is not int] if isinstance(added, dict) else None
        if bad is None:
            reasons.append(f"added_tokens.json: a {type(added).__name__}, not a JSON object")
        elif bad:
            reasons.append(f"added_tokens.json: token {bad[0]!r} has id {added[bad[0]]!r}, not an integer")
        elif added and (best is None or max(added.values()) + 1 > best[0]):
            best = (max(added.values()) + 1, "added_tokens.json")
    return best, reasons


def tokenizer_fits(config: dict, docs: dict) -> list[str]:
    """A token id past vocab_size has no embedding row: the model would index out of range."""
    size, reasons = tokenizer_size(docs)
    vocab = config.get("vocab_size")
    if size and isinstance(vocab, int) and size[0] > vocab:
        reasons.append(f"{size[1]}: token ids reach {size[0] - 1}, past config.json vocab_size {vocab} "
                       "(those tokens have no embedding row)")
    return reasons


# ---- tokenizer and generation config against the base ---------------------------------------------
# Probe strings whose ids must equal the base tokenizer's: English, Chinese, code, math, whitespace, specials.
TOKENIZER_PROBES = ("The quick brown fox jumps over the lazy dog.", "量化模型的验证流程：检查每一个文件。",
                    "def f(x):\n    return x ** 2  # square\n", "∫₀¹ x² dx = 1/3, 12+30=42, e^{iπ} + 1 = 0",
                    "  Mixed 中文 and English\t\ttabs\n\nnew lines  ", "<s> </s> <pad> <unk>")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
TOKENIZER_SIDE = ("padding_side", "truncation_side")
# GPTQModel sets do_sample: true in every generation_config.json it saves (gptqmodel/utils/hf.py,
# _sanitize_generation_config); with every sampling parameter equal to the base's, that alone is tolerated
# (evaluation passes do_sample=False). Without a base generation_config.json, the candidate's may hold only
# the token ids (equal to config.json's), GPTQModel's do_sample and values equal to transformers' defaults.
GENERATION_IGNORED = {"transformers_version"}


def tokenizer_files(files: dict[str, str]) -> str:
    names = [rel for rel in files if rel in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                             "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt")
             or rel in TOKENIZER_NAMES]
    return ", ".join(names) or "the tokenizer files"


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    from pipelines.core import logs

    with logs.library_output("admit"):
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def tokenizer_behaviour(tok) -> dict:
    """What evaluation depends on: vocabulary, special tokens and ids, chat template, probe ids and their decoding."""
    special = {name: (str(getattr(tok, name, None)) if getattr(tok, name, None) is not None else None,
                      getattr(tok, f"{name}_id", None)) for name in SPECIAL_TOKENS}
    extra = getattr(tok, "additional_special_tokens", None) or []
    probes = {text: tok(text, add_special_tokens=True)["input_ids"] for text in TOKENIZER_PROBES}
    return {"vocab": tok.get_vocab(), "special": special, "additional_special_tokens": [str(t) for t in extra],
            "chat_template": getattr(tok, "chat_template", None), "probes": probes,
            "decoded": {text: tok.decode(ids) for text, ids in probes.items()},
            "side": {name: getattr(tok, name, None) for name in TOKENIZER_SIDE}}


_BASE_TOKENIZERS: dict = {}


def base_tokenizer_behaviour(base_dir: str) -> dict:
    """The base tokenizer's behaviour, cached per folder and file state (admission runs once per candidate)."""
    base = Path(base_dir)
    key = (str(base.resolve()), tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                                             for p in base.iterdir() if p.is_file() and p.suffix != ".safetensors")))
    if key not in _BASE_TOKENIZERS:
        _BASE_TOKENIZERS.clear()
        _BASE_TOKENIZERS[key] = tokenizer_behaviour(load_tokenizer(base))
    return _BASE_TOKENIZERS[key]


def tokenizer_matches_base(folder: Path, files: dict[str, str], base_dir: str) -> list[str]:
    """Evaluation tokenizes with the candidate's own tokenizer: it must behave exactly like the base model's."""
    where = tokenizer_files(files)
    if where == "the tokenizer files":
        return ["no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): evaluation and serving "
                "tokenize with the checkpoint's own tokenizer; ship the base model's beside the weights"]
    try:
        mine = tokenizer_behaviour(load_tokenizer(folder))
    except Exception as err:  # noqa: BLE001 - whatever the files do, the candidate is refused
        return [f"{where}: transformers cannot load the tokenizer ({type(err).__name__}: {err})"]
    theirs = base_tokenizer_behaviour(base_dir)
    reasons = []
    if mine["vocab"] != theirs["vocab"]:
        moved = sorted(t for t in set(mine["vocab"]) & set(theirs["vocab"]) if mine["vocab"][t] != theirs["vocab"][t])
        added, gone = sorted(set(mine["vocab"]) - set(theirs["vocab"])), sorted(set(theirs["vocab"]) - set(mine["vocab"]))
        detail = "; ".join(part for part in (
            f"{len(moved)} tokens map to other ids (e.g. {moved[0]!r}: {mine['vocab'][moved[0]]}, the base "
            f"{theirs['vocab'][moved[0]]})" if moved else "",
            f"{len(added)} tokens not in the base (e.g. {added[0]!r})" if added else "",
            f"{len(gone)} base tokens missing (e.g. {gone[0]!r})" if gone else "") if part)
        reasons.append(f"{where}: the vocabulary differs from the base model's ({detail})")
    for name, (token, tid) in mine["special"].items():
        if (token, tid) != theirs["special"][name]:
            reasons.append(f"{where}: {name} is {token!r} (id {tid}), the base model's is "
                           f"{theirs['special'][name][0]!r} (id {theirs['special'][name][1]})")
    if mine["additional_special_tokens"] != theirs["additional_special_tokens"]:
        reasons.append(f"{where}: additional special tokens {mine['additional_special_tokens']}, the base model has "
                       f"{theirs['additional_special_tokens']}")
    if mine["chat_template"] != theirs["chat_template"]:
        template_files = [rel for rel in files if rel.endswith(".jinja")] or ["tokenizer_config.json"]
        reasons.append(f"{', '.join(template_files)}: the chat template differs from the base model's")
    for name, value in mine["side"].items():
        if value != theirs["side"][name]:
            reasons.append(f"{where}: {name} is {value!r}, the base model's is {theirs['side'][name]!r}")
    for text, ids in mine["probes"].items():
        if ids != theirs["probes"][text]:
            reasons.append(f"{where}: {text!r} encodes to {ids}, the base tokenizer gives {theirs['probes'][text]}")
        elif mine["decoded"][text] != theirs["decoded"][text]:
            reasons.append(f"{where}: the ids of {text!r} decode to {mine['decoded'][text]!r}, the base tokenizer "
                           f"gives {theirs['decoded'][text]!r}")
    return reasons


def generation_matches_base(config: dict, docs: dict, base_dir: str) -> list[str]:
    """generation_config.json must be the base model's (apart from GENERATION_IGNORED and GPTQModel's do_sample)."""
    mine = docs.get("generation_config.json")
    if mine is None:
        return []  # transformers derives one from config.json, which is compared with the base's
    if not isinstance(mine, dict):
        return [f"generation_config.json: a {type(mine).__name__}, not a JSON object"]
    path = Path(base_dir) / "generation_config.json"
    try:
        theirs = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError) as err:
        return [f"{path}: the base model's generation config cannot be read ({err})"]
    mine = {k: v for k, v in mine.items() if k not in GENERATION_IGNORED}
    if theirs is None:
        from transformers import GenerationConfig

        defaults = GenerationConfig().to_dict()
        expected = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        reasons = []
        for key, value in sorted(mine.items()):
            if key in expected:
                if value != expected[key]:
                    reasons.append(f"generation_config.json: {key} is {value!r}, config.json has {expected[key]!r}")
            elif key == "_from_model_config" or (key == "do_sample" and value is True) or \
                    (key in defaults and json.dumps(defaults[key], default=str) == json.dumps(value, default=str)):
                continue
            else:
                reasons.append(f"generation_config.json: {key} is {value!r}; the base model has no "
                               "generation_config.json, so only the token ids of config.json may be set")
        return reasons
    theirs = {k: v for k, v in theirs.items() if k not in GENERATION_IGNORED}
    if mine.get("do_sample") is True and not theirs.get("do_sample"):  # what GPTQModel writes on every save
        mine = {k: v for k, v in mine.items() if k != "do_sample"}
        theirs = {k: v for k, v in theirs.items() if k != "do_sample"}
    return [f"generation_config.json: {key} is {mine.get(key)!r}, the base model's is {theirs.get(key)!r}"
            for key in sorted(set(mine) | set(theirs))
            if json.dumps(mine.get(key), sort_keys=True) != json.dumps(theirs.get(key), sort_keys=True)]


@dataclass
class Shard:
    """One safetensors file: its header as read (raw bytes kept, so the data pass can prove it unchanged)."""

    name: str
    size: int
    header: bytes  # the 8-byte length and the JSON header, exactly as on disk
    tensors: dict[str, dict] = field(default_factory=dict)  # name -> {dtype, shape, data_offsets}


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"tensor {key} appears twice in the header")
        seen[key] = value
    return seen


def read_header(folder: Path, rel: str) -> tuple[Shard | None, list[str]]:
    """The shard's header, validated by the safetensors library, plus a hand parse for what it does not give.

    safe_open already refuses a too-large or non-UTF-8 header, unknown dtypes, offsets that overlap,
    leave gaps or do not match shape x dtype, and a data section that does not end at the end of the
    file. The hand parse is kept for two things it does not do: its Python API does not expose the
    offsets (the data pass needs them to stream tensor by tensor), and its JSON parser keeps the last
    of two entries with the same name instead of refusing the header.
    """
    from safetensors import SafetensorError, safe_open

    path = folder / rel
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        return None, [f"{rel}: refused by safetensors ({err})"]
    with path.open("rb") as fh:
        raw_len = fh.read(8)
        (n,) = struct.unpack("<Q", raw_len)
        raw = fh.read(n)
    try:
        table = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as err:
        return None, [f"{rel}: {err}"]
    if not isinstance(table, dict):
        return None, [f"{rel}: header is not a JSON object"]
    table.pop("__metadata__", None)
    shard = Shard(rel, path.stat().st_size, raw_len + raw, table)
    # The data pass streams by these offsets; safe_open validated the file through another open, so
    # the bytes kept here are checked again (tiled from 0 to the end, size = shape x dtype).
    end = 0
    for name, entry in table.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and isinstance(entry.get("dtype"), str) and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)):
            return None, [f"{rel}: tensor {name}: header entry {entry!r} is not {{dtype, shape, data_offsets}}"]
    for name, entry in sorted(table.items(), key=lambda kv: kv[1]["data_offsets"]):
        start, stop = entry["data_offsets"]
        width = DTYPE_BYTES.get(entry.get("dtype"))
        if start != end or stop < start or (width and stop - start != width * math.prod(entry["shape"])):
            return None, [f"{rel}: tensor {name}: data_offsets {entry['data_offsets']} do not follow the previous "
                          "tensor or disagree with its shape and dtype (changed while being read)"]
        end = stop
    if len(raw_len + raw) + end != shard.size:
        return None, [f"{rel}: the data section ends at {len(raw_len + raw) + end}, the file at {shard.size} "
                      "(changed while being read)"]
    return shard, []


def check_index(docs: dict, shards: dict[str, Shard]) -> list[str]:
    """model.safetensors.index.json must describe the shards exactly; without it, one model.safetensors."""
    index = docs.get(INDEX)
    if index is None:
        if list(shards) != ["model.safetensors"]:
            return [f"{', '.join(shards) or 'no weights'}: without {INDEX}, transformers loads only "
                    "model.safetensors"]
        return []
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return [f"{INDEX}: no weight_map"]
    odd = [name for name, shard in weight_map.items() if not isinstance(shard, str)]
    if odd:
        return [f"{INDEX}: weight_map entry {odd[0]} is not a file name"]
    reasons = []
    listed = set(weight_map.values())
    for shard in sorted(listed):
        if "/" in shard or "\\" in shard or shard not in shards:
            reasons.append(f"{INDEX}: lists shard {shard!r}, which is not in the folder")
    for shard in shards:
        if shard not in listed:
            reasons.append(f"{shard}: not listed in {INDEX}")
    for name, shard in weight_map.items():
        if shard in shards and name not in shards[shard].tensors:
            actual = [s for s in shards if name in shards[s].tensors]
            reasons.append(f"{INDEX}: puts tensor {name} in {shard}, but it is in "
                           f"{', '.join(actual) if actual else 'no shard'}")
    for shard in shards.values():
        for name in shard.tensors:
            if name not in weight_map:
                reasons.append(f"{shard.name}: tensor {name} is not listed in {INDEX}")
    return reasons


def collect_tensors(shards: dict[str, Shard]) -> tuple[dict[str, tuple[str, dict]], list[str]]:
    """{tensor: (shard, entry)}; a name in two shards is refused (which copy loads depends on the loader)."""
    tensors: dict[str, tuple[str, dict]] = {}
    reasons = []
    for shard in shards.values():
        for name, entry in shard.tensors.items():
            if name in tensors:
                reasons.append(f"tensor {name}: in both {tensors[name][0]} and {shard.name}")
            else:
                tensors[name] = (shard.name, entry)
    return tensors, reasons


def base_shapes(base_dir: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, int]], bool]:
    """(state-dict shapes, linear modules as (in, out), tied embeddings) of the base model, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return params, linears, bool(config.tie_word_embeddings)


def packed_shapes(q: dict, n_in: int, n_out: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Expected (dtype, shape) of each packed tensor of one linear layer (see docs/quantize.md)."""
    method, bits, group = q["method"], q["bits"], q["group_size"]
    groups = -(-n_in // group) if group > 0 else 1
    if method == "gptq":
        return {"qweight": ("I32", (n_in * bits // 32, n_out)), "qzeros": ("I32", (groups, n_out * bits // 32)),
                "scales": ("F16", (groups, n_out)), "g_idx": ("I32", (n_in,))}
    if method == "awq":
        return {"qweight": ("I32", (n_in, n_out * bits // 32)), "qzeros": ("I32", (groups, n_out * bits // 32)),
                "scales": ("F16", (groups, n_out))}
    if method == "compressed-tensors":  # weight [out, in] packed along in; zero points packed along out
        # symmetric only (compressed_tensors_settings): no weight_zero_point
        return {"weight_packed": ("I32", (n_out, -(-n_in * bits // 32))), "weight_scale": ("F16", (n_out, groups)),
                "weight_shape": ("I64", (2,))}
    return {"weight": ("I8", (n_out, n_in)), "SCB": ("F32", (n_out,))}


@dataclass
class TensorPlan:
    """What phase 1 learned about the tensors, and the value checks phase 2 runs on each."""

    reasons: list[str] = field(default_factory=list)
    g_idx_groups: dict[str, int] = field(default_factory=dict)  # g_idx tensor -> number of groups
    scales: dict[str, bool] = field(default_factory=dict)  # scale tensor -> whether 0 is a valid value
    shape_values: dict[str, list[int]] = field(default_factory=dict)  # compressed-tensors weight_shape -> [out, in]
    quantized_layers: int = 0


def plan_tensors(tensors: dict[str, tuple[str, dict]], q: dict, base_dir: str) -> TensorPlan:
    """Names, dtypes and shapes against the base model and the quantization format; the value checks to run."""
    params, linears, tied = base_shapes(base_dir)
    method, bits, group = q["method"], q["bits"], q["group_size"]
    marker_name, scale_name = MARKERS[method]
    plan = TensorPlan()
    # name -> (dtypes allowed, shape, what implies it); a quantized layer's packed tensors replace its weight
    expected = {name: (set(FLOAT_DTYPES), shape, "the base model has") for name, shape in params.items()}
    optional = {"lm_head.weight"} if tied else set()
    for module, (n_in, n_out) in linears.items():
        if method == "none" or f"{module}.{marker_name}" not in tensors:
            continue
        plan.quantized_layers += 1
        expected.pop(f"{module}.weight", None)
        why = f"quantization_config (bits={bits}, group_size={group}) and the base layer ({n_in} -> {n_out}) imply"
        for suffix, (dtype, shape) in packed_shapes(q, n_in, n_out).items():
            float_scale = suffix == scale_name and method != "bnb-int8"  # written in the model's dtype
            expected[f"{module}.{suffix}"] = ({dtype, "BF16", "F32"} if float_scale else {dtype}, shape, why)
        if method == "gptq":
            plan.g_idx_groups[f"{module}.g_idx"] = -(-n_in // group) if group > 0 else 1
        if method == "compressed-tensors":
            plan.shape_values[f"{module}.weight_shape"] = [n_out, n_in]
        # bitsandbytes' SCB is a row's absmax (0 for an all-zero row); GPTQ, AWQ and compressed-tensors
        # keep every group's scale above 0
        plan.scales[f"{module}.{scale_name}"] = method == "bnb-int8"
        if method == "bnb-int8":
            expected[f"{module}.weight_format"] = ({"U8"}, (), "bitsandbytes writes")
            optional.add(f"{module}.weight_format")
        if f"{module}.bias" not in expected:  # GPTQ writers may store a zero bias for a bias-free layer
            expected[f"{module}.bias"] = (set(FLOAT_DTYPES), (n_out,), "the base layer implies")
            optional.add(f"{module}.bias")
    if method != "none" and plan.quantized_layers == 0:
        plan.reasons.append(f"config.json says {method} but no layer holds {method} tensors")
    for name, (dtypes, shape, why) in expected.items():
        want = min(dtypes) if len(dtypes) == 1 else "/".join(sorted(dtypes))
        if name not in tensors:
            if name not in optional:
                plan.reasons.append(f"tensor {name}: missing ({why} {want}{list(shape)})")
            continue
        shard, entry = tensors[name]
        if tuple(entry["shape"]) != shape or entry["dtype"] not in dtypes:
            plan.reasons.append(f"{shard}: tensor {name}: {entry['dtype']}{entry['shape']} but {why} {want}{list(shape)}")
    for name, (shard, entry) in tensors.items():
        if name not in expected:
            plan.reasons.append(f"{shard}: unexpected tensor {name} {entry['dtype']}{entry['shape']} "
                                f"(neither in the base model nor part of the {method} format)")
    return plan


# =================================================================================================
# Phase 2: one pass over the bytes (hash, value checks, copy)
# =================================================================================================

class ValueCheck:
    """Per-tensor counts of bad values, accumulated chunk by chunk."""

    def __init__(self, plan: TensorPlan):
        self.plan = plan
        self.bad: dict[tuple[str, str, str], int] = {}  # (shard, tensor, what) -> count
        self.wrong_shapes: dict[tuple[str, str], list[int]] = {}

    def __call__(self, shard: str, name: str, dtype: str, view: memoryview) -> None:
        if dtype in FLOAT_DTYPES:
            values = torch.frombuffer(view, dtype=FLOAT_DTYPES[dtype])
            # Fast path (one vectorised pass, no copy): torch's min and max propagate NaN, and an inf is
            # the max or the min, so both finite proves every element finite; otherwise count exactly.
            low, high = torch.aminmax(values)
            if not (torch.isfinite(low) and torch.isfinite(high)):
                self._add(shard, name, "NaN/inf values", int((~torch.isfinite(values)).sum()))
            if name in self.plan.scales:
                if self.plan.scales[name]:
                    self._add(shard, name, "negative scale values", int((values < 0).sum()))
                else:
                    self._add(shard, name, "scale values <= 0", int((values <= 0).sum()))
        elif name in self.plan.g_idx_groups and dtype in INT_DTYPES:
            values = torch.frombuffer(view, dtype=INT_DTYPES[dtype])
            groups = self.plan.g_idx_groups[name]
            self._add(shard, name, f"g_idx values outside [0, {groups})", int(((values < 0) | (values >= groups)).sum()))
        elif name in self.plan.shape_values and dtype in INT_DTYPES:  # a few bytes: never split across chunks
            got = torch.frombuffer(view, dtype=INT_DTYPES[dtype]).tolist()
            if got != self.plan.shape_values[name]:
                self.wrong_shapes[(shard, name)] = got

    def _add(self, shard: str, name: str, what: str, count: int) -> None:
        if count:
            key = (shard, name, what)
            self.bad[key] = self.bad.get(key, 0) + count

    def reasons(self) -> list[str]:
        return [f"{shard}: tensor {name}: {count} {what}" for (shard, name, what), count in sorted(self.bad.items())] + \
            [f"{shard}: tensor {name}: {got}, but the base layer is {self.plan.shape_values[name]} (out, in)"
             for (shard, name), got in sorted(self.wrong_shapes.items())]


class Sink:
    """A file's copy and sha256, fed chunk by chunk from a worker thread while the reading thread reads on."""

    def __init__(self, dest: Path | None):
        self.digest = hashlib.sha256()
        self.out = dest.open("wb") if dest else None

    def write(self, view: memoryview) -> None:
        if self.out:
            self.out.write(view)

    def consume(self, view: memoryview) -> None:
        """Copy and hash one chunk, off the reading thread (both release the GIL)."""
        self.write(view)
        self.hash(view)

    def hash(self, view: memoryview) -> None:
        self.digest.update(view)  # hashlib releases the GIL: this overlaps the reading, checking and writing

    def close(self) -> str:
        # No fsync, like every checkpoint the quantize stage writes: atomic_dir's rename publishes the folder
        # and DVC hashes it next; an fsync would add a full disk write to the stage's time.
        if self.out and not self.out.closed:
            self.out.close()
        return self.digest.hexdigest()


def stream_file(src: Path, dest: Path | None, shard: Shard | None, check: ValueCheck | None,
                pool: ThreadPoolExecutor) -> tuple[str, list[str]]:
    """(sha256, reasons) after reading `src` once: hash, value checks and copy share each chunk.

    Two buffers alternate: while the worker thread writes and hashes one, the next is read and checked.
    A safetensors file is read tensor by tensor in header order, so each chunk holds whole elements of one
    tensor; its header bytes must equal those phase 1 validated, or the file changed in between.
    """
    sink = Sink(dest)
    buffers, pending, turn = [bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES)], [None, None], 0

    def read_chunk(fh, count: int) -> memoryview:
        nonlocal turn
        turn ^= 1
        if pending[turn] is not None:
            pending[turn].result()  # the worker is done with this buffer
        view = memoryview(buffers[turn])[:count]
        return view[:fh.readinto(view)]

    def hand_off(view: memoryview) -> None:
        pending[turn] = pool.submit(sink.consume, view)

    try:
        with src.open("rb") as fh:
            if hasattr(os, "posix_fadvise"):  # larger read-ahead from a cold disk (Linux)
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if shard is None:
                while view := read_chunk(fh, CHUNK_BYTES):
                    hand_off(view)
                return sink_result(sink, pending, [])
            if fh.read(len(shard.header)) != shard.header:
                return sink_result(sink, pending, [f"{shard.name}: header changed while being read"])
            sink.hash(memoryview(shard.header))
            sink.write(memoryview(shard.header))
            for name, entry in sorted(shard.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = entry["dtype"]
                left = entry["data_offsets"][1] - entry["data_offsets"][0]
                step = CHUNK_BYTES - CHUNK_BYTES % 8  # whole elements of every dtype
                while left:
                    view = read_chunk(fh, min(step, left))
                    if len(view) < min(step, left):
                        return sink_result(sink, pending, [f"{shard.name}: ends inside tensor {name} "
                                                           "(changed while being read)"])
                    hand_off(view)
                    if check is not None:
                        check(shard.name, name, dtype, view)
                    left -= len(view)
            if fh.read(1):
                return sink_result(sink, pending, [f"{shard.name}: longer than its header says "
                                                   "(changed while being read)"])
            return sink_result(sink, pending, [])
    except BaseException:
        for job in pending:
            if job is not None:
                job.exception()  # wait for the worker before closing its file
        sink.close()
        raise


def sink_result(sink: Sink, pending: list, reasons: list[str]) -> tuple[str, list[str]]:
    """Wait for the worker, close the copy and return (sha256, reasons)."""
    for job in pending:
        if job is not None:
            job.result()
    return sink.close(), reasons


def stream_all(folder: Path, files: dict[str, str], shards: dict[str, Shard], plan: TensorPlan | None,
               copy_to: Path | None, checked: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """({file: sha256}, reasons) over every accepted file, each read exactly once.

    sha256 runs at about 1.7 GB/s per core, slower than a warm read, so files are streamed in parallel
    (one per core, each with its own hashing thread): the shards of a large checkpoint then hash about as
    fast as a disk delivers them (benchmarks/admission_cost.py).
    """
    check = ValueCheck(plan) if plan is not None else None
    if copy_to is not None:
        for rel in files:
            (copy_to / rel).parent.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(len(files), 2 * cores))  # more files than cores: a shard count that does not divide
    # evenly over the cores still keeps every core hashing (measured: 3 shards on 2 cores)

    def one(rel: str) -> tuple[str, list[str]]:
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="admit-hash") as pool:
                digest, reasons = stream_file(folder / rel, copy_to / rel if copy_to else None, shards.get(rel),
                                              check, pool)
            if rel not in shards and digest != checked.get(rel):  # the copy must be the bytes phase 1 checked
                reasons.append(f"{rel}: changed while being read (its bytes differ from those checked)")
            return digest, reasons
        except OSError as err:  # vanished, unreadable, or (for the copy) no space: this candidate's failure
            return "", [f"{rel}: {err.strerror or err} ({err.filename})"]
        except Exception as err:  # noqa: BLE001 - whatever a file does, it is refused, never a crash
            return "", [could_not_check(rel, err)]

    sizes = {rel: shards[rel].size if rel in shards else 0 for rel in files}
    order = sorted(files, key=lambda rel: -sizes[rel])  # largest (the shards) first: balanced workers
    # One torch thread: the value checks already run one file per core, and torch's own thread pool fighting
    # these threads made aminmax 16x slower here (16 GiB/s with one thread, under 1 GiB/s with two).
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="admit-file") as files_pool:
            results = dict(zip(order, files_pool.map(one, order)))
    finally:
        torch.set_num_threads(torch_threads)
    hashes = {rel: results[rel][0] for rel in files}
    reasons = [reason for rel in files for reason in results[rel][1]]
    if check is not None:
        reasons += check.reasons()
    return hashes, reasons


# =================================================================================================
# The two entry points
# =================================================================================================

@dataclass
class Inspection:
    """What phase 1 found: the reasons to refuse, and what phase 2 needs to read the bytes."""

    reasons: list[str] = field(default_factory=list)
    quant: dict = field(default_factory=dict)  # method, bits, group_size, checkpoint_format
    details: dict = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> kind, in copy order
    shards: dict[str, Shard] = field(default_factory=dict)
    plan: TensorPlan | None = None
    checked: dict[str, str] = field(default_factory=dict)  # non-weights file -> sha256 of the bytes checked
    sizes: dict[str, int] = field(default_factory=dict)  # non-weights file -> its size when checked
    step: str = ""  # what is being checked now (names the file if a check fails unexpectedly)


def inspect(folder: Path, base_dir: str, found: Inspection) -> None:
    """Phase 1 into `found`; it stops at the first group of checks that fails, so nothing later reads a
    dangerous folder. `found.step` names what is being checked, for the reason if a check itself fails."""
    found.step = str(folder)
    found.files, found.reasons, notes = list_files(folder)
    found.details["notes"] = notes
    found.step = "the JSON, tokenizer and text files"
    docs, found.checked, found.sizes, bad = read_small(folder, found.files)
    found.reasons += bad
    config = docs.get("config.json")
    if not isinstance(config, dict):
        found.reasons.append("config.json: missing" if "config.json" not in found.files else
                             "config.json: not a JSON object")
    if found.reasons:  # code, pickle or no config: look no further
        return
    found.step = "the quantization config"
    found.quant, bad = quant_settings(config, docs)
    found.step = "config.json"
    found.reasons += bad + config_drift(config, base_dir)
    found.step = "the tokenizer files"
    found.reasons += tokenizer_fits(config, docs)
    found.step = "generation_config.json against the base model"
    found.reasons += generation_matches_base(config, docs, base_dir)
    if not found.reasons:  # only a folder whose files passed the checks above is handed to transformers
        found.step = "the tokenizer against the base model"
        found.reasons += tokenizer_matches_base(folder, found.files, base_dir)
    weights = [rel for rel, kind in found.files.items() if kind == "weights"]
    if not weights:
        found.reasons.append("no .safetensors weights in the checkpoint")
    for rel in weights:
        found.step = rel
        shard, bad = read_header(folder, rel)
        found.reasons += bad
        if shard:
            found.shards[rel] = shard
    if found.reasons:
        return
    found.step = INDEX
    found.reasons += check_index(docs, found.shards)
    tensors, bad = collect_tensors(found.shards)
    found.reasons += bad
    if found.reasons:
        return
    found.step = "the tensors against the base model"
    found.plan = plan_tensors(tensors, found.quant, base_dir)
    found.reasons += found.plan.reasons
    found.details.update({"tensors": len(tensors), "shards": len(found.shards),
                          "quantized_layers": found.plan.quantized_layers})


def could_not_check(where: str, err: Exception) -> str:
    return f"admission could not check {where}: {type(err).__name__}: {err}"


def run_checks(folder: str | Path, base_dir: str, copy_to: Path | None) -> dict:
    """Every check; when `copy_to` is given, the accepted files are copied there in the same single read.

    It never raises for anything a candidate contains: an unexpected error is that candidate's refusal.
    """
    folder = Path(folder)
    found, hashes = Inspection(), {}
    try:
        if not folder.is_dir():
            return {"admitted": False, "reasons": [f"{folder}: not a directory"], "files": {}, "bytes_read": 0}
        inspect(folder, base_dir, found)
        reasons = found.reasons
        if not reasons:
            found.step = "the bytes"
            hashes, reasons = stream_all(folder, found.files, found.shards, found.plan, copy_to, found.checked)
    except OSError as err:  # unreadable or vanished: this candidate's failure
        reasons = [f"{err.filename or found.step}: {err.strerror or err}"]
    except Exception as err:  # noqa: BLE001 - a malformed candidate is refused, it never stops the stage
        reasons = [could_not_check(found.step, err)]
    sizes = {**found.sizes, **{rel: shard.size for rel, shard in found.shards.items()}}
    return {"admitted": not reasons, "reasons": reasons, "files": hashes, **found.quant, **found.details,
            "bytes_read": sum(sizes.get(rel, 0) for rel in hashes)}


def validate(folder: str | Path, base_dir: str) -> dict:
    """Every check, cheapest and most dangerous first; reasons name the file, key and tensor."""
    return run_checks(folder, base_dir, copy_to=None)


def record_failure(name: str, path: str, base_dir: str, cause: str, out_root: Path = VARIANTS_DIR) -> dict:
    """The manifest of a candidate whose admission died outside the stage (`quantgate fanout`): refused, with why."""
    manifest = {"variant": name, "candidate": True, "source_path": str(path), "base_model": base_dir, "status": "failed",
                "reasons": [cause], "validation": {"admitted": False, "reasons": [cause]}, "error": cause}
    for leftover in out_root.glob(f".{name}.*"):  # atomic_dir's temp folders of a killed process
        shutil.rmtree(leftover, ignore_errors=True)
    with atomic_dir(out_root / name) as tmp:
        write_json(tmp / MANIFEST, manifest)
    return manifest


def admit(name: str, path: str, base_dir: str, out_root: Path = VARIANTS_DIR) -> dict:
    """Validate while copying the bytes into out_root/name, with a manifest; or record the rejection."""
    from pipelines.quantize import disk_bytes, library_versions

    with atomic_dir(out_root / name) as tmp:
        report = run_checks(path, base_dir, copy_to=tmp)
        libraries = library_versions()
        if report.get("method") == "compressed-tensors":  # the loader's format library, beside the quantizers
            from importlib import metadata

            libraries["compressed-tensors"] = metadata.version("compressed-tensors")
        manifest = {"variant": name, "candidate": True, "source_path": str(path), "base_model": base_dir,
                    "libraries": libraries, "validation": report}
        if report["admitted"]:
            config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "float16")
            manifest.update({"status": "ok", "method": report["method"], "dtype": dtype if dtype in
                             ("float16", "bfloat16", "float32") else "float16",
                             "settings": {"method": report["method"], "bits": report["bits"],
                                          "group_size": report["group_size"],
                                          "checkpoint_format": report["checkpoint_format"]},
                             "disk_bytes": disk_bytes(tmp), "files": report["files"]})
        else:
            for child in sorted(tmp.iterdir()):  # nothing of a rejected checkpoint stays
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            manifest.update({"status": "failed", "method": report.get("method"), "reasons": report["reasons"],
                             "error": "validation failed: " + "; ".join(report["reasons"][:5])})
        write_json(tmp / MANIFEST, manifest)
    return manifest
