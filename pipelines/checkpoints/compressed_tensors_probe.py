"""compressed-tensors checkpoints written and run here: a checkpoint of any scheme written by the library's own
ModelCompressor (the only writer the tests, the doctor and the benchmarks use), and the probe that runs one on this
machine's device: it tells the doctor which formats this machine evaluates, and load_variant whether a candidate's
schemes run here before it loads one (pipelines/checkpoints/compressed_tensors.py says what the schemes mean)."""

from __future__ import annotations

import functools
import json
from pathlib import Path


# What the doctor probes (one checkpoint per admitted format), and what `write_rtn` writes by name:
# compressed-tensors' own presets (quantization/quant_scheme.py PRESET_SCHEMES) and the format they are saved in.
PROBES = {"float-quantized": ("FP8_DYNAMIC", "float-quantized"), "int-quantized": ("W8A8", "int-quantized"),
          "naive-quantized": ("W8A16", "naive-quantized"), "pack-quantized": ("W4A16", "pack-quantized")}


def _ranges(w, args):
    """Each scale's (min, max) of a weight [out, in] for the strategy, a ragged last group or block padded."""
    import torch

    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    rows, cols = args.block_structure if args.strategy == "block" else (1, args.group_size)
    out, n_in = w.shape
    padded = torch.nn.functional.pad(w, (0, -(-n_in // cols) * cols - n_in, 0, -(-out // rows) * rows - out))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).permute(0, 2, 1, 3)
    return blocks.amin((-1, -2)), blocks.amax((-1, -2))


def write_rtn(base_dir, scheme: dict, fmt: str | None, out, dtype=None, input_scale: float = 0.05,
              ignore: tuple[str, ...] = ("lm_head",)) -> None:
    """A compressed-tensors checkpoint of `base_dir` written by the library's own ModelCompressor, as llm-compressor
    writes one, with round-to-nearest scales from each group's range (llm-compressor itself does not install with the
    pins); a static input scale is `input_scale`. For the tests, the doctor's probe and benchmarks/real_profile.py.

    `scheme`: {"weights": QuantizationArgs, "input_activations": ...} for every Linear but `ignore`, or several
    groups {name: {"targets": [...], "weights": ..., ...}}; `fmt` None: the format the library infers (mixed-precision
    for groups of different formats).
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype or "auto")
    groups = {"group_0": {"targets": ["Linear"], **scheme}} if "weights" in scheme else scheme
    apply_quantization_config(model, QuantizationConfig(
        config_groups={name: QuantizationScheme(**g) for name, g in groups.items()}, ignore=list(ignore)))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            scale, zero = calculate_qparams(*_ranges(module.weight.detach().float(), args), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(input_scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    if (Path(base_dir) / "tokenizer_config.json").is_file():  # the doctor's probe model has none
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)


def evaluable_formats(device: str) -> dict[str, str | None]:
    """{format: None if this machine runs its PROBES preset, else why not}: the doctor's row."""
    out = {}
    for fmt, (name, save_as) in PROBES.items():
        scheme = {role: preset(name)[role].model_dump(mode="json") for role in ("weights", "input_activations")
                  if preset(name).get(role) is not None}
        why = probe(device, json.dumps(scheme, sort_keys=True), save_as)
        out[fmt] = why and f"{name}: {why}"
    return out


@functools.lru_cache(maxsize=None)
def probe(device: str, scheme_json: str, fmt: str, dtype: str = "float32") -> str | None:
    """None when a tiny random Llama quantized with this scheme (normalised as admission reads it), written by
    ModelCompressor in `fmt`, loads with transformers on `device` and runs compressed-tensors' forward to finite
    logits, the model in `dtype` (the candidate's: a scheme may run in one dtype and not another); else why not.
    Once per process per scheme (memory.py loads twice and measures the second load, which the
    probe must not fall inside); the caller's random state is left as it was."""
    import math
    import tempfile

    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipelines.core.logs import library_output

    scheme = {role: QuantizationArgs(**{k: v for k, v in a.items() if v is not None})
              for role, a in json.loads(scheme_json).items() if a is not None}
    if "weights" not in scheme:
        return "no weight scheme to probe"
    step = math.lcm(4, *[a.group_size for a in scheme.values() if a.strategy == "group"])  # groups divide it
    hidden = step * -(-64 // step)  # at least 64, an even head size for each of 2 heads
    cuda = range(torch.cuda.device_count()) if device.startswith("cuda") else []
    with tempfile.TemporaryDirectory(prefix="quantgate-ct-probe-") as tmp, library_output("compressed-tensors"), \
            torch.random.fork_rng(devices=cuda):
        base = Path(tmp) / "base"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, max_position_embeddings=32), dtype=getattr(torch, dtype)
        ).save_pretrained(base)
        try:
            write_rtn(base, scheme, fmt, Path(tmp) / "probe")
            model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "probe", device_map=device)
            with torch.no_grad():
                logits = model(torch.arange(8, device=device).reshape(1, 8)).logits
            return None if torch.isfinite(logits).all() else f"non-finite logits on {device}"
        except Exception as err:  # noqa: BLE001 - a scheme this machine cannot run is a reason, not a crash
            return f"{type(err).__name__}: {str(err)[:200]}"


def preset(name: str) -> dict:
    """One of compressed-tensors' preset schemes (FP8_DYNAMIC, W8A8, W4A16, ...), by name."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    return dict(PRESET_SCHEMES[name])


def check_runs_here(manifest: dict, device: str) -> None:
    """Raise CannotRunHere when this machine's libraries cannot run one of the candidate's own schemes (a tiny
    checkpoint of it written, loaded and run: `probe`)."""
    from pipelines.core.errors import CannotRunHere

    fails = {name: why for name, s in ((manifest.get("validation") or {}).get("schemes") or {}).items()
             if (why := probe(device, json.dumps({"weights": s["weights"], "input_activations": s["input_activations"]},
                                                 sort_keys=True), s["format"], manifest.get("dtype") or "float16"))}
    if fails:
        raise CannotRunHere(f"compressed-tensors {', '.join(fails)} does not run on {device} with the installed "
                            f"libraries: {'; '.join(fails.values())}", "run it where it runs (`quantgate doctor` lists "
                            "the formats this machine runs), or drop the candidate")
