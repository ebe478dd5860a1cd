"""compressed-tensors checkpoints (llm-compressor's format, what vLLM serves): what the config's schemes mean.

One config holds named groups, each a scheme (weights, input activations) for the modules its `targets` match
minus `ignore`. From it this module derives, for every base-model Linear it quantizes, the tensors the format
stores (names, dtypes, shapes: the scale grid of the strategy, ragged edges included), the value ranges they must
keep, the forward that serves them, and checks that a loaded model runs that forward. What it has no check for
(a format, strategy, activation scheme, kv_cache_scheme, transform) is refused by name: docs/quantize.md's table.
"""

from __future__ import annotations

import json

# format -> the weight types it stores: float-quantized FP8 E4M3, int-quantized int8, naive either (one value per
# byte), pack-quantized int packed into int32 words along the input dimension (compressors/*/base.py)
FORMATS = {"float-quantized": ("float",), "int-quantized": ("int",), "naive-quantized": ("int", "float"),
           "pack-quantized": ("int",)}
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block")
# activation strategy -> whether it may be static (scales in the file) and dynamic (computed per forward)
ACTIVATION_STRATEGIES = {"token": (False, True), "tensor": (True, True), "group": (False, True)}
# QuantizationArgs fields (compressed_tensors/quantization/quant_args.py): the first are checked; the observer
# ones only steer calibration, and GPTQ's activation ordering `weight`/`static` (llm-compressor's default) reorders
# columns while quantizing and stores nothing more; the rest change what is stored or how it is read (`actorder:
# group` stores a weight_g_idx, scale_dtype/zp_dtype other dtypes), and have no check here
ARGS_CHECKED = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic"}
ARGS_CALIBRATION = {"observer", "observer_kwargs"}
ACTORDER_STORING_NOTHING = (None, False, "weight", "static")
SCHEME_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
FP8 = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
# config keys that change what is stored or run, with why each is refused
NOT_CHECKED = {
    "sparsity_config": "sparsity has no check here",
    "transform_config": "transforms (rotations) have no check here",
    # compressed-tensors 0.20 recognises an attention module to hook by a `past_key_value(s)` argument, which
    # transformers 5.24's attention no longer takes (it takes `cache`): neither its writer nor transformers' loader
    # applies the scheme, so the model would run, and be judged, with a float cache the server does not have
    "kv_cache_scheme": "a quantized KV cache is refused: compressed-tensors 0.20 does not hook transformers 5.24's "
                       "attention (is_cached_attention_module), so the evaluation here would run an unquantized cache",
}
FLOAT_SCALE = {"F16", "BF16", "F32"}
WHERE = "config.json: compressed-tensors"


def _args(where: str, raw, role: str) -> tuple[dict | None, list[str]]:
    """One QuantizationArgs, normalised to the fields the checks read; or why it has no check here."""
    if not isinstance(raw, dict):
        return None, [f"{where} is a {type(raw).__name__}, not a JSON object"]
    unchecked = sorted(k for k, v in raw.items() if k not in ARGS_CHECKED | ARGS_CALIBRATION and v not in (None, False)
                       and not (k == "actorder" and v in ACTORDER_STORING_NOTHING))
    if unchecked:
        return None, [f"{where}: {', '.join(f'{k} {raw[k]!r}' for k in unchecked)}: no check for it here"]
    a = {"type": raw.get("type", "int"), "num_bits": raw.get("num_bits", 8), "strategy": raw.get("strategy"),
         "symmetric": raw.get("symmetric", True), "dynamic": raw.get("dynamic", False),
         "group_size": raw.get("group_size"), "block_structure": raw.get("block_structure")}
    bits, kind, strategy = a["num_bits"], a["type"], a["strategy"]
    if kind not in ("int", "float"):
        return None, [f"{where}: type {kind!r} is not int or float"]
    if kind == "float" and bits != 8:
        return None, [f"{where}: float {bits!r}-bit {role} (NVFP4, MXFP4, FP6): no check for it here"]
    if kind == "int" and (type(bits) is not int or not 2 <= bits <= 8):
        return None, [f"{where}: int {bits!r}-bit {role}: only 2 to 8 bits are checked"]
    if kind == "float" and not a["symmetric"]:
        return None, [f"{where}: asymmetric float {role}: no FP8 writer stores zero points; no check for it here"]
    if role == "weights":
        if strategy not in WEIGHT_STRATEGIES:
            return None, [f"{where}: weight strategy {strategy!r}: only {', '.join(WEIGHT_STRATEGIES)} are checked"]
        if a["dynamic"] is not False:
            return None, [f"{where}: dynamic {a['dynamic']!r} weights: weights must be stored with their scales"]
    else:
        static_ok, dynamic_ok = ACTIVATION_STRATEGIES.get(strategy, (False, False))
        if a["dynamic"] not in (True, False) or not (dynamic_ok if a["dynamic"] else static_ok):
            how = "dynamic" if a["dynamic"] is True else "static" if a["dynamic"] is False else repr(a["dynamic"])
            return None, [f"{where}: {how} {strategy!r} activations: only dynamic per-token, per-group and "
                          "per-tensor, and static per-tensor, are checked"]
    group, block = a["group_size"], a["block_structure"]
    if strategy == "group" and (type(group) is not int or group <= 0):
        return None, [f"{where}: group strategy with group_size {group!r}: a positive integer is needed"]
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2
                                    and all(type(b) is int and b > 0 for b in block)):
        return None, [f"{where}: block strategy with block_structure {block!r}: [rows, columns] is needed"]
    return a, []


def settings(qc: dict) -> tuple[dict, list[str]]:
    """The schemes of a compressed-tensors config, checked field by field; or every reason it is refused."""
    fmt, status = qc.get("format"), qc.get("quantization_status")
    if fmt not in FORMATS and fmt != "mixed-precision":
        return {}, [f"{WHERE}: format {fmt!r}: only {', '.join(FORMATS)} (or mixed-precision of them) are checked"]
    if status != "compressed":
        return {}, [f"{WHERE}: quantization_status {status!r}: only 'compressed' checkpoints are checked (a 'frozen' "
                    "one stores float weights that the loader would quantize again)"]
    for key, why in NOT_CHECKED.items():
        if qc.get(key) not in (None, {}, []):
            return {}, [f"{WHERE}: {key} {json.dumps(qc[key], sort_keys=True)[:200]}: {why}"]
    ignore, groups = qc.get("ignore") or [], qc.get("config_groups")
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        return {}, [f"{WHERE}: ignore {ignore!r} is not a list of module names or re: patterns"]
    if not isinstance(groups, dict):
        return {}, [f"{WHERE}: config_groups is a {type(groups).__name__}, not a JSON object"]
    if not groups:
        return {}, [f"{WHERE}: config_groups is empty: no scheme says what the tensors are"]
    schemes, reasons = {}, []
    for name, raw in groups.items():
        scheme, why = _scheme(f"{WHERE}: config_groups.{name}", raw, fmt)
        reasons += why
        schemes[name] = scheme
    if reasons:
        return {}, reasons
    reasons = library_refuses(qc)  # after the checks above, whose reasons are more precise
    if reasons:
        return {}, reasons
    bits = sorted({s["weights"]["num_bits"] for s in schemes.values()})
    groups_ = sorted({s["weights"]["group_size"] or -1 for s in schemes.values()})
    formats = sorted({s["format"] for s in schemes.values()})
    return {"method": "compressed-tensors", "bits": bits[0] if len(bits) == 1 else bits,
            "group_size": groups_[0] if len(groups_) == 1 else groups_,
            "checkpoint_format": formats[0] if len(formats) == 1 else formats,
            "schemes": schemes, "ignore": ignore, "forward": forward_of(schemes)}, []


def library_refuses(qc: dict) -> list[str]:
    """What compressed-tensors' own model of the config refuses (a group size on a channel strategy, a block shape on
    a group one, ...): the loader would stop on it, so admission does first, with the library's words."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    except ValidationError as err:  # the first error; a union's other branches (a list of targets) add only noise
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if "[" not in str(part))
        return [f"{WHERE}: {where}: {first['msg']} (compressed-tensors 0.20's QuantizationConfig refuses it)"]
    return []


def _scheme(where: str, raw, fmt: str) -> tuple[dict | None, list[str]]:
    if not isinstance(raw, dict):
        return None, [f"{where} is a {type(raw).__name__}, not a JSON object"]
    extra = sorted(set(raw) - SCHEME_KEYS)
    if extra:
        return None, [f"{where}: key {extra[0]!r}: no check for it here"]
    targets = raw.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        return None, [f"{where}: targets {targets!r} is not a non-empty list of module names, classes or re: patterns"]
    if raw.get("output_activations"):
        return None, [f"{where}: output_activations {raw['output_activations']!r}: no check for it here"]
    own = raw.get("format") or fmt
    if fmt != "mixed-precision" and own != fmt:
        return None, [f"{where}: format {own!r}, but the config's format is {fmt!r} (only a 'mixed-precision' config "
                      "may name another per group)"]
    if own not in FORMATS:
        return None, [f"{where}: format {own!r}: only {', '.join(FORMATS)} are checked"]
    weights, reasons = _args(f"{where}.weights", raw.get("weights"), "weights")
    if reasons:
        return None, reasons
    if weights["type"] not in FORMATS[own]:
        return None, [f"{where}: {weights['type']} weights in format {own!r}, which stores {' or '.join(FORMATS[own])}"]
    if own == "pack-quantized" and not weights["symmetric"]:
        return None, [f"{where}: asymmetric pack-quantized weights: transformers 5.24 with compressed-tensors 0.20.0 "
                      "cannot load the packed weight_zero_point that compressed-tensors writes (size mismatch)"]
    inputs = None
    if raw.get("input_activations"):
        inputs, reasons = _args(f"{where}.input_activations", raw["input_activations"], "activations")
        if reasons:
            return None, reasons
    return {"targets": targets, "format": own, "weights": weights, "input_activations": inputs}, []


def _describe(a: dict) -> str:
    how = {"tensor": "per tensor", "channel": "per output channel", "token": "per token",
           "group": f"per group of {a['group_size']}", "block": f"per {a['block_structure']} block"}[a["strategy"]]
    kind = "fp8 (E4M3)" if a["type"] == "float" else f"int{a['num_bits']}"
    return f"{kind} {how}{'' if a['symmetric'] else ', asymmetric'}"


def forward_of(schemes: dict) -> str:
    """The forward that serves these schemes, in words: what the manifest, the report and MLflow say ran."""
    parts = []
    for name, s in schemes.items():
        a = s["input_activations"]
        acts = "activations in full precision" if a is None else \
            f"input activations {_describe(a)}, {'dynamic' if a['dynamic'] else 'static'}, quantized in every forward"
        parts.append(f"{name}: weights {_describe(s['weights'])} ({s['format']}); {acts}")
    return "compressed-tensors' own forward (transformers' default route, not dequantize=True): " + "; ".join(parts)


def scale_shape(a: dict, n_in: int, n_out: int) -> tuple[int, ...]:
    """The scale grid a weight strategy stores for an [out, in] weight; a ragged last group or block gets a scale."""
    strategy = a["strategy"]
    if strategy == "tensor":
        return (1,)
    if strategy == "channel":
        return (n_out, 1)
    if strategy == "group":
        return (n_out, -(-n_in // a["group_size"]))
    rows, cols = a["block_structure"]
    return (-(-n_out // rows), -(-n_in // cols))


def layer_tensors(s: dict, n_in: int, n_out: int) -> dict[str, tuple[set[str], tuple[int, ...]]]:
    """{suffix: (dtypes allowed, shape)} of every tensor one Linear under scheme `s` stores."""
    w, a = s["weights"], s["input_activations"]
    scale = scale_shape(w, n_in, n_out)
    if s["format"] == "pack-quantized":  # compressors/pack_quantized/base.py: ceil(in x bits / 32) int32 columns
        out = {"weight_packed": ({"I32"}, (n_out, -(-n_in * w["num_bits"] // 32))), "weight_shape": ({"I64"}, (2,))}
    else:
        out = {"weight": ({FP8} if w["type"] == "float" else {"I8"}, (n_out, n_in))}
    out["weight_scale"] = (FLOAT_SCALE, scale)
    if not w["symmetric"]:
        out["weight_zero_point"] = ({"I8"}, scale)
    if a is not None and not a["dynamic"]:  # static: one scale (and zero point) for the whole input, in the file
        out["input_scale"] = (FLOAT_SCALE, (1,))
        if not a["symmetric"]:
            out["input_zero_point"] = ({"I8"}, (1,))
    return out


def int_ranges(s: dict, module: str) -> dict[str, tuple[int, int]]:
    """{tensor: (lowest, highest)} of the int8-stored values a scheme of fewer than 8 bits must stay within."""
    out = {}
    for suffix, a in (("weight", s["weights"]), ("input", s["input_activations"])):
        if a is None or a["type"] != "int":
            continue
        bits = a["num_bits"]
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1  # compressed_tensors' calculate_range for int
        if suffix == "weight" and s["format"] != "pack-quantized" and bits < 8:
            out[f"{module}.weight"] = (low, high)
        if not a["symmetric"] and bits < 8:
            out[f"{module}.{suffix}_zero_point"] = (low, high)
    return out


def layer_schemes(q: dict, base_dir: str) -> tuple[dict[str, dict], list[str]]:
    """{Linear module: its scheme} as compressed-tensors itself matches targets and ignore on the base model."""
    import torch
    from compressed_tensors.utils import match_named_modules
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
    found, reasons = {}, []
    for name, s in q["schemes"].items():
        for module, m in match_named_modules(model, s["targets"], q["ignore"]):
            if not isinstance(m, torch.nn.Linear):
                reasons.append(f"{WHERE}: config_groups.{name} targets {module} ({type(m).__name__}): only Linear "
                               "layers are checked")
            elif module in found:
                reasons.append(f"{WHERE}: {module} is targeted by config_groups.{found[module][0]} and .{name}")
            else:
                found[module] = (name, s)
                for role, a in (("weights", s["weights"]), ("input_activations", s["input_activations"])):
                    if a is not None and a["strategy"] == "group" and m.in_features % a["group_size"]:
                        reasons.append(f"{WHERE}: config_groups.{name}.{role}: group_size {a['group_size']} does not "
                                       f"divide {module}'s {m.in_features} inputs (compressed-tensors 0.20 cannot run a "
                                       "ragged last group)")
    if not found and not reasons:
        reasons.append(f"{WHERE}: no config group's targets match a Linear layer of the base model "
                       f"(targets {[s['targets'] for s in q['schemes'].values()]}, ignore {q['ignore']})")
    return {module: s for module, (_, s) in found.items()}, reasons


def _key(weights: dict | None, inputs: dict | None) -> str:
    return json.dumps([weights, inputs], sort_keys=True)


def check_served(model, manifest: dict) -> str:
    """The forward the loaded model runs, checked against the admitted schemes; raises naming the layer if not.

    transformers' default route leaves every targeted Linear with compressed-tensors' `quantized_forward`, which
    quantizes the input as the scheme says; `dequantize=True` (or a hook turned off) would run full-precision
    activations and hide what the served model shows.
    """
    validation = manifest.get("validation") or {}
    admitted = {_key(s["weights"], s["input_activations"]) for s in (validation.get("schemes") or {}).values()}
    quantized = 0
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        quantized += 1
        # functools.wraps renames it; after the first forward compressed-tensors' offload wrapper calls it
        function = getattr(m, "_original_forward_func", None) or getattr(m.forward, "__func__", None)
        code = getattr(function, "__code__", None)
        if getattr(m, "quantization_enabled", True) is False or getattr(code, "co_name", "") != "quantized_forward" \
                or getattr(m, "quantization_status", None) is None:  # quantized_forward quantizes nothing without it
            raise RuntimeError(f"{name}: the loaded layer does not run compressed-tensors' quantized forward")
        loaded = [None if a is None else _args(name, a.model_dump(), role)[0]
                  for a, role in ((scheme.weights, "weights"), (scheme.input_activations, "activations"))]
        if _key(*loaded) not in admitted:
            raise RuntimeError(f"{name}: loaded with weights {loaded[0]} and input activations {loaded[1]}, which no "
                               "admitted scheme says")
    if quantized != validation.get("quantized_layers"):
        raise RuntimeError(f"{quantized} layers loaded with a compressed-tensors scheme, but admission counted "
                           f"{validation.get('quantized_layers')}")
    return validation.get("forward", "")
