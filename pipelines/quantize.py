"""Stage `quantize@<variant>`: one checkpoint per variant from the same calibration set.

A small registry maps a method name to its quantizer; each quantizer writes a checkpoint into a
folder and nothing else. This module adds what every variant needs the same way: the tokenizer,
the manifest (`quantgate.json`) with settings, library versions, calibration hash, bytes on disk
against theory, and sha256 of every file; wall time and peak memory go to a metrics file. A quantizer that throws is
recorded as that variant's failure; the other variants go on. The stage runs quantize_variant in its own process
(pipelines/core/isolation.py): one that crashes or hangs is recorded the same way (record_failure).
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines.checkpoints.manifest import disk_bytes, library_versions
from pipelines.core.errors import QuantgateError, environment_cause
from pipelines.core.io import atomic_dir, sha256_file, write_json
from pipelines.core.logs import library_output
from pipelines.core.params_sections import CALIBRATED_METHODS, VariantParams
from pipelines.core.paths import BUILT_DIR, MANIFEST, METHOD_DIR, QUANTIZE_RESULTS, VARIANTS_DIR
from pipelines.core.timing import library_call
from pipelines.models.loading import ModelSource, device_map_for, dtype_of, gpu_budget

log = logging.getLogger(__name__)


@dataclass
class Job:
    """Everything a quantizer needs: the base model, the settings, calibration texts and the device."""

    source: ModelSource
    settings: VariantParams
    calibration: list[str]
    device: str
    max_seq_len: int
    max_memory: dict | None = None  # gpus.max_memory parsed: bnb-int8 loads the base model across GPUs with it


def _fp16_baseline(job: Job, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job.source.location, dtype=dtype_of(job.settings.dtype))
    model.save_pretrained(out)


def _bnb_int8(job: Job, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from pipelines.models.loading import gpu_totals

    device_map, budget = job.device, None
    if job.device == "cuda":  # several GPUs (or a budget): across them, GPU 0 first (pipelines/models/loading.py)
        device_map, budget = device_map_for("bnb-int8", "cuda", torch.cuda.device_count(),
                                            gpu_budget(job.max_memory, gpu_totals()))
    spread = {"max_memory": budget} if device_map != job.device else {}
    model = AutoModelForCausalLM.from_pretrained(
        job.source.location, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
        device_map=device_map, dtype=dtype_of(job.settings.dtype), **spread)
    model.save_pretrained(out)


def _awq(job: Job, out: Path) -> None:
    s = job.settings
    if s.backend == "gptqmodel":
        if job.device != "cuda":
            raise QuantgateError("GPTQModel 7.6's AWQ needs CUDA; use backend: autoawq (or auto) on a CPU")
        _gptqmodel(job, out, quant_method="awq", fmt="gemm")
        return
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    model = AutoAWQForCausalLM.from_pretrained(job.source.location, torch_dtype=dtype_of(s.dtype),
                                               device_map=job.device if job.device == "cuda" else None)
    tokenizer = AutoTokenizer.from_pretrained(job.source.location)
    extra = {"duo_scaling": s.duo_scaling} if s.duo_scaling is not None else {}
    if s.clip_tokens == 0:
        extra["apply_clip"] = False
    elif s.clip_tokens is not None:
        extra["quantizer_cls"] = _clip_budgeted(s.clip_tokens)
    model.quantize(tokenizer, quant_config={"zero_point": s.zero_point, "q_group_size": s.group_size,
                                            "w_bit": s.bits, "version": "GEMM"},
                   calib_data=job.calibration, max_calib_samples=len(job.calibration),
                   max_calib_seq_len=job.max_seq_len, **extra)
    model.save_quantized(str(out))


def _clip_budgeted(tokens: int):
    """autoawq's quantizer with its clipping search over `tokens` sampled tokens per linear layer instead of 512.

    The search tries 10 clipping ratios per weight group on every sampled token, element by element (not a matrix
    product): on a CPU it is most of AWQ's time (SmolLM2-135M, 2 threads: 1,340 s with 512 tokens, 441 s without the
    search; docs/quantize.md), and its cost grows with the tokens. autoawq takes the quantizer class as `quantizer_cls`."""
    from awq.quantize.quantizer import AwqQuantizer

    class ClipBudgeted(AwqQuantizer):
        def _compute_best_clip(self, w, input_feat, n_grid=20, max_shrink=0.5, n_sample_token=512):
            return super()._compute_best_clip(w, input_feat, n_grid, max_shrink, tokens)

    return ClipBudgeted


def _gptqmodel(job: Job, out: Path, quant_method: str = "gptq", fmt: str = "gptq") -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    s = job.settings
    extra = {"damp_percent": s.damp_percent} if s.damp_percent is not None else {}
    config = QuantizeConfig(bits=s.bits, group_size=s.group_size, sym=s.sym, desc_act=s.desc_act,
                            quant_method=quant_method, format=fmt, **extra)
    model = GPTQModel.load(job.source.location, config, device=job.device, dtype=dtype_of(s.dtype))
    model.quantize(job.calibration)
    model.save(str(out))


QUANTIZERS: dict[str, Callable[[Job, Path], None]] = {
    "none": _fp16_baseline,
    "bnb-int8": _bnb_int8,
    "awq": _awq,
    "gptq": _gptqmodel,
}


# --------------------------------------------------------------------------------------------
# Manifest pieces
# --------------------------------------------------------------------------------------------


def theoretical_weight_bytes(base_config_dir: str, settings: VariantParams) -> dict:
    """Weight bytes the settings imply, from the base model's shapes (no weights loaded).

    Quantized linear layers (every nn.Linear in the decoder blocks; lm_head stays unquantized) cost
    in x out x bits / 8, plus per-group fp16 scales and packed zeros (GPTQ also stores g_idx); int8
    stores one fp32 scale per output row. Everything else stays in `settings.dtype`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    keep_bytes = torch.finfo(dtype_of(settings.dtype)).bits // 8
    quantized = unquantized = 0.0
    counted: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and settings.method != "none":
            n_in, n_out = module.in_features, module.out_features
            if settings.method == "bnb-int8":
                quantized += n_in * n_out + 4 * n_out
            else:
                groups = -(-n_in // settings.group_size)
                quantized += n_in * n_out * settings.bits / 8 + groups * n_out * (2 + settings.bits / 8)
                if settings.method == "gptq":
                    quantized += 4 * n_in
            counted.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False) if p == "weight")
    for name, param in model.named_parameters():  # a tied lm_head is the embedding's tensor, listed (and stored) once
        if name not in counted:
            unquantized += param.numel() * keep_bytes
    return {"quantized_layers": int(quantized), "unquantized": int(unquantized), "total": int(quantized + unquantized)}


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def peak_memory_bytes(device: str) -> dict[str, int | None]:
    """Peak RSS of this process (the stage runs in its own process) and, on CUDA, peak allocated."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device != "cuda":
        return {"peak_rss": rss, "peak_cuda_allocated": None}
    import torch

    cuda = torch.cuda.max_memory_allocated()
    return {"peak_rss": rss, "peak_cuda_allocated": cuda}


def calibration_texts(built_dir: Path, method: str) -> tuple[list[str], str] | None:
    """The calibration texts `method` reads (built/by_method/<method>.jsonl) and their sha256; None for a
    method that reads none (fp16, bitsandbytes int8)."""
    if method not in CALIBRATED_METHODS:
        return None
    path = built_dir / METHOD_DIR / f"{method}.jsonl"
    if not path.is_file():
        raise QuantgateError(f"{path}: no calibration set for method {method!r}; run `dvc repro calibrate`")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise QuantgateError(f"{path}: the calibration set is empty")
    return [r["text"] for r in rows], sha256_file(path)


# --------------------------------------------------------------------------------------------
# Stage
# --------------------------------------------------------------------------------------------


def quantize_variant(name: str, settings: VariantParams, source: ModelSource, built_dir: Path, device: str,
                     out_root: Path = VARIANTS_DIR, max_memory: dict | None = None,
                     threads: int | None = None) -> tuple[dict, dict]:
    """Quantize one variant into out_root/name; on any error, a manifest that records the failure.

    Returns (manifest, timing). The manifest (quantgate.json, beside the weights) holds only what the same
    inputs always give, so a re-run that writes the same weights changes nothing downstream; wall time
    and peak memory go to `timing`, which the stage writes to a metrics file.
    """
    from transformers import AutoConfig, AutoTokenizer

    out_dir = out_root / name
    manifest = _manifest_base(name, settings, source, device)
    timing: dict = {}
    if threads:  # quantize.threads (the stage runs this in its own process)
        import torch

        torch.set_num_threads(threads)
    try:
        calibration = calibration_texts(built_dir, settings.method)
        max_positions = getattr(AutoConfig.from_pretrained(source.location), "max_position_embeddings", 2048)
        job = Job(source, settings, calibration[0] if calibration else [], device, min(512, max_positions), max_memory)
        if calibration:
            manifest["calibration"] = {"sha256": calibration[1], "samples": len(calibration[0])}
        with atomic_dir(out_dir) as tmp:
            started = time.perf_counter()
            with library_output(settings.method), library_call(f"quantize ({settings.method})"):
                QUANTIZERS[settings.method](job, tmp)
            timing["quantize_seconds"] = round(time.perf_counter() - started, 2)
            if not (tmp / "tokenizer_config.json").exists():  # autoawq saves no tokenizer
                AutoTokenizer.from_pretrained(source.location).save_pretrained(tmp)
            timing["peak_memory_bytes"] = peak_memory_bytes(device)
            manifest.update({
                "status": "ok",
                "dtype": settings.dtype,  # of the weights left unquantized (all of them for fp16)
                "theoretical_weight_bytes": theoretical_weight_bytes(source.location, settings),
                "disk_bytes": disk_bytes(tmp),
                "files": file_hashes(tmp),
            })
            write_json(tmp / MANIFEST, manifest)
    except Exception as err:  # noqa: BLE001 - one variant's failure must not stop the others
        logging.getLogger().error("quantize %s failed", name, exc_info=True)
        where = traceback.extract_tb(err.__traceback__)[-1]
        message = str(err).strip() or f"raised in {Path(where.filename).name}:{where.lineno} ({where.line})"
        manifest.update({"status": "failed", "error": f"{type(err).__name__}: {message}"[:2000],
                         "traceback_tail": traceback.format_exc().splitlines()[-6:], **(environment_cause(err) or {})})
        _write_failure(out_dir, manifest)
    return manifest, timing


def _manifest_base(name: str, settings: VariantParams, source: ModelSource, device: str) -> dict:
    return {"variant": name, "method": settings.method, "settings": settings.model_dump(mode="json"),
            "base_model": source.location, "device": device, "libraries": library_versions()}


def record_failure(name: str, settings: VariantParams, source: ModelSource, device: str, error: str,
                   out_root: Path = VARIANTS_DIR) -> dict:
    """The manifest of a variant whose quantizing process died or hung (isolation.run_isolated's reason),
    written in place of whatever that process left half-done."""
    manifest = {**_manifest_base(name, settings, source, device), "status": "failed", "error": error}
    _write_failure(out_root / name, manifest)
    return manifest


def _write_failure(out_dir: Path, manifest: dict) -> None:
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*"):  # atomic_dir's temp folders of a killed process
        shutil.rmtree(leftover, ignore_errors=True)
    with atomic_dir(out_dir) as tmp:
        write_json(tmp / MANIFEST, manifest)


def main(variant: str, failed_because: str | None = None) -> int:
    """Stage `quantize@<variant>`: quantize one variant in its own process; its failure (an exception, a crash, a
    hang past quantize.timeout_seconds) is recorded in its manifest and the stage still succeeds."""
    from pipelines.core import logs
    from pipelines.core.isolation import run_isolated
    from pipelines.core.params import load_params
    from pipelines.models.loading import resolve_device, resolve_model

    params = load_params()
    settings = params.variants.get(variant)
    if settings is None:
        params.model_under_test(variant)  # names what exists
        raise QuantgateError(f"{variant!r} is a candidate: use `quantgate admit {variant}`")
    source = resolve_model(params.model)
    device = resolve_device(params.device)
    if failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        record_failure(variant, settings, source, device, failed_because)
        write_json(QUANTIZE_RESULTS / f"{variant}.json", {"variant": variant, "status": "failed"})
        log.warning("quantize %s: recorded as FAILED (%s)", variant, failed_because)
        return 0
    with logs.progress(total=1, desc=f"quantize {variant} ({settings.method})", bar_format="{desc}: {elapsed}") as bar:
        done, error = run_isolated(quantize_variant,
                                   (variant, settings, source, BUILT_DIR, device, VARIANTS_DIR, params.gpus.shares(),
                                    params.quantize.threads),
                                   params.quantize.timeout_seconds, f"quantize {variant}", logs.current_log_file)
        bar.update()
    manifest, timing = (record_failure(variant, settings, source, device, error), {}) if error else done
    write_json(QUANTIZE_RESULTS / f"{variant}.json", {"variant": variant, "status": manifest["status"], **timing})
    if manifest["status"] == "ok":
        log.info("quantize %s: %s in %.1fs, %s weight bytes on disk (theory %s) -> models/variants/%s",
                 variant, settings.method, timing["quantize_seconds"],
                 f"{manifest['disk_bytes']['weights']:,}", f"{manifest['theoretical_weight_bytes']['total']:,}", variant)
    else:
        log.warning("quantize %s: FAILED (%s); recorded in models/variants/%s/quantgate.json",
                    variant, manifest["error"], variant)
    return 0
