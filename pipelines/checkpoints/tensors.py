"""Tensors against the base model and the quantization format: names, dtypes and shapes from the headers
(phase 1), then the values chunk by chunk as the data pass streams them (NaN/inf, scale sign, g_idx range)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipelines.checkpoints import compressed_tensors
from pipelines.checkpoints.context import Candidate
from pipelines.checkpoints.shards import DTYPE_BYTES

# method -> (the tensor that marks a layer as quantized, that layer's scale tensor)
MARKERS = {"gptq": ("qweight", "scales"), "awq": ("qweight", "scales"), "bnb-int8": ("SCB", "SCB"),
           "compressed-tensors": ("weight_packed", "weight_scale"), "none": ("", "")}
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
INT_DTYPES = {"I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}


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
    return {"weight": ("I8", (n_out, n_in)), "SCB": ("F32", (n_out,))}


@dataclass
class TensorPlan:
    """What phase 1 learned about the tensors, and the value checks phase 2 runs on each."""

    reasons: list[str] = field(default_factory=list)
    g_idx_groups: dict[str, int] = field(default_factory=dict)  # g_idx tensor -> number of groups
    scales: dict[str, bool] = field(default_factory=dict)  # scale tensor -> whether 0 is a valid value
    shape_values: dict[str, list[int]] = field(default_factory=dict)  # compressed-tensors weight_shape -> [out, in]
    int_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # int8-stored tensor -> its bits' range
    theory: dict[str, int] = field(default_factory=dict)  # weight bytes the format implies (memory's theory)
    quantized_layers: int = 0


def quantized_layers(tensors: dict, q: dict, linears: dict, base_dir: str) -> tuple[dict[str, dict], dict, list[str]]:
    """({Linear module: {suffix: (dtypes allowed, shape)}} of every layer the format quantizes, {int8-stored
    tensor: the range its bits allow}, reasons).

    compressed-tensors says which layers in its config (targets minus ignore); the other formats mark a
    quantized layer by its packed tensor, since their writers may leave any layer unquantized.
    """
    method = q["method"]
    if method == "compressed-tensors":
        schemes, reasons = compressed_tensors.layer_schemes(q, base_dir)
        return ({m: compressed_tensors.layer_tensors(s, *linears[m]) for m, s in schemes.items()},
                {k: v for m, s in schemes.items() for k, v in compressed_tensors.int_ranges(s, m).items()}, reasons)
    marker_name, scale_name = MARKERS[method]
    layers = {}
    for module, (n_in, n_out) in linears.items():
        if method != "none" and f"{module}.{marker_name}" in tensors:
            layers[module] = {suffix: ({dtype, "BF16", "F32"} if suffix == scale_name and method != "bnb-int8"
                                       else {dtype}, shape)  # a float scale is written in the model's dtype
                              for suffix, (dtype, shape) in packed_shapes(q, n_in, n_out).items()}
    return layers, {}, []


def plan_tensors(tensors: dict[str, tuple[str, dict]], q: dict, base_dir: str, dtype: str = "float16") -> TensorPlan:
    """Names, dtypes and shapes against the base model and the quantization format; the value checks to run,
    and the weight bytes the format implies (`dtype`: the config's, that of every float tensor)."""
    params, linears, tied = base_shapes(base_dir)
    method, bits, group = q["method"], q["bits"], q["group_size"]
    scale_name = MARKERS[method][1]
    plan = TensorPlan()
    # name -> (dtypes allowed, shape, what implies it); a quantized layer's packed tensors replace its weight
    expected = {name: (set(FLOAT_DTYPES), shape, "the base model has") for name, shape in params.items()}
    optional = {"lm_head.weight"} if tied else set()
    layers, plan.int_ranges, plan.reasons = quantized_layers(tensors, q, linears, base_dir)
    if tied and "lm_head" in layers:  # one tensor shared with the embedding: quantizing it is quantizing both
        plan.reasons.append("lm_head: quantized, but the base model ties it to the embedding (tie_word_embeddings): "
                            "the loaders cannot give one tensor two forms (transformers refuses FP8 there), and without "
                            "it the embedding would stand in; leave lm_head unquantized (compressed-tensors: `ignore`)")
        return plan
    for module, layer in layers.items():
        n_in, n_out = linears[module]
        plan.quantized_layers += 1
        expected.pop(f"{module}.weight", None)
        why = f"quantization_config (bits={bits}, group_size={group}) and the base layer ({n_in} -> {n_out}) imply"
        if method == "compressed-tensors":
            why = f"its compressed-tensors scheme and the base layer ({n_in} -> {n_out}) imply"
        for suffix, (dtypes, shape) in layer.items():
            expected[f"{module}.{suffix}"] = (dtypes, shape, why)
        if method == "gptq":
            plan.g_idx_groups[f"{module}.g_idx"] = -(-n_in // group) if group > 0 else 1
        if "weight_shape" in layer:
            plan.shape_values[f"{module}.weight_shape"] = [n_out, n_in]
        # bitsandbytes' SCB is a row's absmax (0 for an all-zero row); GPTQ, AWQ and compressed-tensors
        # keep every group's scale above 0
        plan.scales[f"{module}.{scale_name}"] = method == "bnb-int8"
        if "input_scale" in layer:  # a static activation scheme's: above 0 too
            plan.scales[f"{module}.input_scale"] = False
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
    plan.theory = weight_theory({n: e for n, e in expected.items() if n not in optional}, layers, dtype)
    return plan


DTYPE_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def weight_theory(expected: dict, layers: dict, dtype: str) -> dict[str, int]:
    """Weight bytes the format implies, every scale, zero-point and index tensor included: what the memory stage
    sets the load footprint against (as quantize.theoretical_weight_bytes does for the pipeline's own variants).
    A tensor a float dtype may hold counts at the config's dtype, in which the writers store it."""
    quantized = unquantized = 0
    for name, (dtypes, shape, _) in expected.items():
        one = min(dtypes) if len(dtypes) == 1 else DTYPE_NAMES.get(dtype, "F16")
        size = DTYPE_BYTES[one] * int(torch.Size(shape).numel())
        if name.rsplit(".", 1)[0] in layers:
            quantized += size
        else:
            unquantized += size
    return {"quantized_layers": quantized, "unquantized": unquantized, "total": quantized + unquantized}



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
        elif dtype == compressed_tensors.FP8:  # E4M3 has no inf; NaN is S.1111.111 (torch.float8_e4m3fn)
            values = torch.frombuffer(view, dtype=torch.uint8)
            self._add(shard, name, "NaN values", int(((values & 0x7F) == 0x7F).sum()))
        elif name in self.plan.int_ranges and dtype in INT_DTYPES:
            values = torch.frombuffer(view, dtype=INT_DTYPES[dtype])
            low, high = self.plan.int_ranges[name]
            self._add(shard, name, f"values outside [{low}, {high}] (the scheme's bits)",
                      int(((values < low) | (values > high)).sum()))
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


def tensors_match_base(c: Candidate) -> list[str]:
    """Check: every tensor is the base model's or its quantized form (sets c.plan, the value checks to run)."""
    dtype = str((c.config or {}).get("dtype") or (c.config or {}).get("torch_dtype") or "float16")
    c.plan = plan_tensors(c.tensors, c.quant, c.base_dir, dtype)
    c.details.update({"tensors": len(c.tensors), "shards": len(c.shards), "quantized_layers": c.plan.quantized_layers,
                      "theoretical_weight_bytes": c.plan.theory})
    return c.plan.reasons
