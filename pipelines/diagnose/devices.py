"""The doctor's torch, device and quantization-backend rows: what each variant's method needs installed, and whether
its kernel runs on the device the run uses. torch is imported once; bitsandbytes only for its real int8 check."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.diagnose.check import FAIL, OK, WARN, Check, guarded, libraries

NO_DEVICE = "kernel not checked: no usable device (see device)"
INCONCLUSIVE = "these variants could not be measured (inconclusive)"


def torch_checks(params) -> tuple[str | None, list[Check]]:
    """(the device the run uses, or None when it cannot run, [torch row, device row])."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        return None, [Check("torch", FAIL, f"cannot import torch: {type(err).__name__}: {err}",
                            "bash scripts/setup.sh (docs/install.md)")]
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else \
        f"ROCm {torch.version.hip} build" if getattr(torch.version, "hip", None) else "CPU build"
    checks = [Check("torch", OK, f"torch {torch.__version__} ({build})")]
    setting = params.device if params is not None else "auto"
    try:
        from pipelines.models.loading import resolve_device

        device = resolve_device(setting)
    except QuantgateError as err:
        checks.append(Check("device", FAIL, str(err), "device: auto or cpu in params.yaml, or torch's CUDA build on a "
                                                      "machine with a GPU (docs/install.md, GPU)"))
        return None, checks
    if device != "cuda":
        why = "" if setting == "cpu" else " (torch sees no CUDA device)" if torch.version.cuda else " (a CPU build of torch)"
        checks.append(Check("device", OK, f"device: {setting} -> cpu{why}"))
        return device, checks
    from pipelines.models.loading import gpu_budget

    totals, gpus = [], []
    for i in range(torch.cuda.device_count()):
        prop = torch.cuda.get_device_properties(i)
        totals.append(prop.total_memory)
        gpus.append(f"cuda:{i} {prop.name} {prop.total_memory / 2**30:.0f} GiB sm_{prop.major}{prop.minor}")
    detail = f"device: {setting} -> cuda: {'; '.join(gpus)}"
    try:
        budget = gpu_budget(params.gpus.shares(), totals) if params is not None else None
    except QuantgateError as err:
        checks.append(Check("device", FAIL, f"{detail}; {err}", "gpus.max_memory in params.yaml: GPUs torch sees"))
        return None, checks
    if budget:
        detail += "; gpus.max_memory: " + ", ".join(f"cuda:{i} {b / 2**30:.1f} GiB" for i, b in sorted(budget.items()))
    checks.append(Check("device", OK, detail))
    return device, checks


def bnb_native_library(device: str) -> Path | None:
    """The native library bitsandbytes loads for `device` (bitsandbytes.cextension's naming), found without
    importing bitsandbytes; None when the package is not installed."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    if device != "cuda":
        return folder / "libbitsandbytes_cpu.so"
    import torch

    cuda = os.environ.get("BNB_CUDA_VERSION") or (torch.version.cuda or "").replace(".", "")
    return folder / f"libbitsandbytes_cuda{cuda}.so"


def bnb_int8_works(device: str) -> str:
    """A real LLM.int8 layer on `device`: a 64 -> 32 bitsandbytes Linear8bitLt, quantized by moving it there,
    against the fp32 layer on a 4 x 64 input. Returns what was measured; raises when the kernel does not work."""
    import torch

    from pipelines.core.logs import library_output

    with library_output("bitsandbytes"):
        import bitsandbytes as bnb

        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(32, 64, generator=generator) / 8
        x = torch.randn(4, 64, generator=generator)
        layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False, threshold=6.0)
        layer.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
        layer = layer.to(device)
        dtype = torch.float16 if device == "cuda" else torch.float32
        with torch.no_grad():
            got = layer(x.to(device, dtype)).float().cpu()
    if layer.weight.dtype != torch.int8:
        raise RuntimeError(f"the weight stayed {layer.weight.dtype}: nothing was quantized")
    want = x @ weight.T
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err < 0.05:
        raise RuntimeError(f"int8 output differs from fp32 by {err:.1%} of its largest value")
    return f"int8 Linear on {device} matches fp32 within {err:.2%}"


def backend_checks(params, device: str | None) -> list[Check]:
    """One row per quantization method the variants name: its libraries, and whether its kernel runs on `device`."""
    by_method: dict[str, list[str]] = {}
    for name, v in params.variants.items():
        by_method.setdefault(v.method, []).append(name)
    rows = []
    for method, names in by_method.items():
        label = f"{method} ({', '.join(names)})"
        rows.append(guarded(label, backend_row, label, method, [params.variants[n] for n in names], device))
    return rows


def backend_row(label: str, method: str, settings: list, device: str | None) -> Check:
    """One method's row, built the same way for every method: what stops it before its libraries are looked at,
    the libraries it needs (a missing one fails the row, naming what installs it), then its kernel on `device`."""
    if method not in KERNELS:
        return Check(label, WARN, f"method {method}: nothing known to check")
    if method in ("awq", "gptq") and device is None:
        return Check(label, WARN, NO_DEVICE)
    if method == "awq" and "gptqmodel" in {s.backend for s in settings} and device != "cuda":
        return Check(label, FAIL, f"backend gptqmodel on {device}: GPTQModel 7.6's AWQ needs CUDA",
                     "backend: autoawq (or auto) for these variants in params.yaml, or device cuda")
    needs, missing_text, remedy = _requirements(method, settings)
    have, missing = libraries(needs)
    if missing:
        return Check(label, FAIL, missing_text.format(" and ".join(missing)), remedy)
    return KERNELS[method](label, have, settings, device)


def _requirements(method: str, settings: list) -> tuple[list[tuple[str, str]], str, str]:
    """(the (distribution, module) pairs the method needs, the row when some are missing, its remedy)."""
    if method == "none":
        return [("transformers", "transformers")], "{} is not installed", "bash scripts/setup.sh"
    if method == "bnb-int8":
        return ([("bitsandbytes", "bitsandbytes")], f"{{}} is not installed: {INCONCLUSIVE}",
                "bash scripts/setup.sh (pyproject.toml pins bitsandbytes)")
    if method == "awq":
        autoawq = [("autoawq", "awq")] if {s.backend for s in settings} - {"gptqmodel"} else []
        return ([("gptqmodel", "gptqmodel"), *autoawq], f"{{}} not installed: {INCONCLUSIVE}",
                "bash scripts/setup.sh (pyproject.toml pins autoawq and gptqmodel)")
    return ([("gptqmodel", "gptqmodel")], f"{{}} not installed: {INCONCLUSIVE}",
            "bash scripts/setup.sh (pyproject.toml pins gptqmodel)")


def _baseline_kernel(label: str, have: list[str], settings: list, device: str | None) -> Check:
    return Check(label, OK, f"{have[0]}: the baseline in {', '.join(sorted({s.dtype for s in settings}))} "
                            f"on {device or '?'}")


def _int8_kernel(label: str, have: list[str], settings: list, device: str | None) -> Check:
    if device is None:
        return Check(label, WARN, f"{have[0]}; {NO_DEVICE}")
    library = bnb_native_library(device)
    if library is None or not library.is_file():
        return Check(label, FAIL, f"{have[0]} has no native library for {device} ({library.name if library else '?'})",
                     "a bitsandbytes build for this torch (docs/install.md, GPU)")
    try:
        ctypes.CDLL(str(library))
        measured = bnb_int8_works(device)
    except Exception as err:  # noqa: BLE001
        return Check(label, FAIL, f"{have[0]}: LLM.int8 does not run on {device}: {type(err).__name__}: {err}",
                     "a bitsandbytes build for this torch and device (docs/install.md), or drop the int8 variant")
    return Check(label, OK, f"{have[0]} ({library.name}); {measured}")


def _awq_kernel(label: str, have: list[str], settings: list, device: str | None) -> Check:
    how = "autoawq quantizes" if {s.backend for s in settings} - {"gptqmodel"} else "GPTQModel quantizes"
    kernel = ("GPTQModel's TorchAtenAwqLinear (torch, any device) runs it on the CPU, as docs/quantize.md measured"
              if device != "cuda" else "GPTQModel picks its CUDA AWQ kernel when loading")
    return Check(label, OK, f"{', '.join(have)}: {how}, {kernel} (not imported here: that takes ~20 s)")


def _gptq_kernel(label: str, have: list[str], settings: list, device: str | None) -> Check:
    bits = ", ".join(map(str, sorted({s.bits for s in settings})))
    if device == "cuda":
        kernel = ("GPTQModel picks Marlin/ExLlamaV2 for 4- and 8-bit where they fit, else its torch kernel "
                  f"(all bits, any device); bits here: {bits}")
    else:
        kernel = f"{bits}-bit on GPTQModel's torch kernel (2-8 bit, any device), as on this CPU in docs/quantize.md"
    return Check(label, OK, f"{have[0]}: {kernel} (not imported here: that takes ~20 s)")


KERNELS = {"none": _baseline_kernel, "bnb-int8": _int8_kernel, "awq": _awq_kernel, "gptq": _gptq_kernel}


def compressed_tensors_check(params, device: str | None) -> Check:
    """Which compressed-tensors formats this machine evaluates as served (a checkpoint of each, written by the
    library, loaded and run on `device`: pipelines/checkpoints/compressed_tensors.py), and the candidates it affects."""
    import json

    from pipelines.checkpoints.compressed_tensors_probe import evaluable_formats

    label = "compressed-tensors"
    if device is None:
        return Check(label, WARN, NO_DEVICE)
    ct = []  # candidates whose config.json says compressed-tensors (their format is checked at admission)
    for name, cand in params.candidates.items():
        config = Path(cand.path) / "config.json"
        try:
            method = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")
        except (OSError, ValueError, AttributeError):
            continue  # admission says what is wrong with it
        if method == "compressed-tensors":
            ct.append(name)
    formats = evaluable_formats(device)
    runs = [f for f, why in formats.items() if why is None]
    fails = {f: why for f, why in formats.items() if why is not None}
    detail = (f"{', '.join(runs) or 'no format'} load and run on {device} through compressed-tensors' own forward "
              "(as served: activations quantized where the scheme says)")
    if ct:
        detail += f" (candidates {', '.join(ct)})"
    if fails:
        return Check(label, WARN, detail + "; not on this machine: " + "; ".join(f"{f}: {w}" for f, w in fails.items())
                     + ": a candidate in those formats is 'could not measure'", "run on a device that runs them")
    return Check(label, OK, detail)
