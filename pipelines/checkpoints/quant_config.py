"""The quantization config: every file a loader may read it from must agree and hold only known keys.

GPTQModel reads quantize_config.json (or quant_config.json) first, transformers only config.json's
quantization_config: if they differed, the two loaders would load different models from the same folder.
"""

from __future__ import annotations

import json

from pipelines.checkpoints import compressed_tensors
from pipelines.checkpoints.context import Candidate

METHODS = {"gptq": "gptq", "awq": "awq", "bitsandbytes": "bnb-int8", "compressed-tensors": "compressed-tensors"}
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v2 (GPTQModel) stores zeros without the -1 offset; same shapes

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
        return compressed_tensors.settings(qc)
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


def quantization(c: Candidate) -> list[str]:
    """Check: the quantization settings every loader reads (sets c.quant: method, bits, group_size, format)."""
    c.quant, reasons = quant_settings(c.config, c.docs)
    return reasons
