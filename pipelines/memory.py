"""Stage `memory@<variant>`: load footprint, peak against sequence length, growth under soak, fragmentation.

The incident behind this stage: a GPTQ checkpoint grew GPU memory 3-5 % more than FP16 under real
traffic and services ran out of memory hours later. Each variant is measured in a fresh process
(`measure_isolated`), so one variant's allocator state cannot leak into another's numbers.

Both devices report the same JSON shape. On CUDA the numbers come from `torch.cuda.memory_stats()`
(allocated = live tensors, the leak signal; reserved = allocator cache; inactive split = fragments)
and NVML (process and device memory, which also counts the CUDA context and kernel workspaces). On a
CPU, `allocated` and `reserved` come from glibc's `mallinfo2()` (bytes in use vs bytes the heap
holds, so 1 - allocated/reserved is the same fragmentation ratio), and `process` is the RSS.

This module runs the phases in order; `pipelines/measure/probes.py` reads the memory,
`pipelines/measure/phases.py` runs the sweep and the soak (`pipelines/measure/growth.py`: their statistics),
`pipelines/measure/verdict.py` judges (leak verdict, growth against fp16) and `pipelines/measure/plots.py`
draws the charts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipelines.core import logs
from pipelines.core.isolation import run_isolated
from pipelines.core.params_sections import MemoryParams
from pipelines.core.timing import library_call

log = logging.getLogger(__name__)


def measure(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int = 0,
            leak_rounds: int | None = None, max_memory: dict | None = None) -> dict:
    """All phases for one variant, in this process; failures are recorded, never raised.

    `max_memory`: `gpus.max_memory` parsed (GpusParams.shares()), for variants that load across GPUs. On CUDA the
    probe reads every GPU the model occupies, the totals are sums over them, and `devices` holds each one's."""
    import torch  # here, in the isolated child: the stage's parent never loads a model

    from pipelines.measure.phases import kv_bytes_per_token, soak, sweep, tensor_bytes
    from pipelines.measure.probes import describe_devices, device_breakdown, make_probe, peak_of
    from pipelines.measure.verdict import leak_verdict
    from pipelines.models.loading import load_variant, model_devices, variant_manifest

    torch.set_num_threads(p.threads)
    result: dict = {"variant": Path(variant_dir).name, "device": device, "status": "ok"}
    probe = make_probe(device)
    result["method"] = probe.method
    try:
        manifest = variant_manifest(variant_dir)
        # A first load imports the libraries and initialises kernels; the second one is the footprint.
        model, _ = load_variant(variant_dir, device, max_memory)
        gpus = [int(d.split(":")[1]) for d in model_devices(model) if d.startswith("cuda:")]
        if device == "cuda" and gpus:  # read the GPUs the model occupies, not every visible one
            probe.use_devices(gpus)
        del model
        probe.sync()
        probe.reset_peak()
        before = probe.snapshot()
        started = time.perf_counter()
        model, _ = load_variant(variant_dir, device, max_memory)
        probe.sync()
        after = probe.snapshot()
        # CUDA: what the allocator holds after the load. CPU: the tensor bytes, because safetensors maps
        # weights straight from the file (no heap allocation) and RSS counts pages only once touched.
        held = tensor_bytes(model)
        footprint_signal = "allocated" if device == "cuda" else "tensor_bytes"
        footprint = after["allocated"] - before["allocated"] if device == "cuda" else held
        config = model.config
        element = next((t.element_size() for t in model.parameters() if t.is_floating_point()), 2)
        max_len = min(config.max_position_embeddings, p.max_tokens)
        result["load"] = {
            "seconds": round(time.perf_counter() - started, 3),
            "footprint_bytes": footprint,
            "footprint_signal": footprint_signal,
            "tensor_bytes": held,
            "rss_increase": after["process"] - before["process"] if after["process"] and before["process"] else None,
            "theoretical_weight_bytes": (manifest.get("theoretical_weight_bytes") or {}).get("total"),
            "peak": peak_of(after),
            "before": before,
            "after": after,
        }
        lengths = sorted({max(2, int(max_len * f)) for f in p.seq_fractions})
        with library_call("forward (sweep)"):
            result["sweep"] = sweep(model, probe, lengths, p.decode_tokens, config.vocab_size, device, p.sweep_batch)
        result["sweep"]["theoretical_kv_bytes_per_token"] = kv_bytes_per_token(config, element)
        with library_call("forward (soak rounds)"):
            result["soak"] = soak(model, probe, p, max_len, config.vocab_size, device, leak_bytes_per_round, leak_rounds)
        result["leak"] = leak_verdict(result["soak"], footprint, p)
        end = probe.snapshot()  # CUDA: OOMs the allocator hit and recovered from (a library caught and retried)
        result["allocator"] = {"ooms": end["ooms"], "alloc_retries": end["alloc_retries"]}
        if "devices" in after:  # CUDA: what each GPU saw
            result["devices"] = device_breakdown(before, after, end)
            for line in describe_devices(result["devices"]):
                log.info("memory %s: %s", result["variant"], line)
    except Exception as err:  # noqa: BLE001 - a variant that fails to load is that variant's result
        logging.getLogger().error("memory %s failed", variant_dir, exc_info=True)
        result.update({"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]})
    finally:
        probe.close()
    return result


def measure_isolated(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int = 0,
                     leak_rounds: int | None = None, max_memory: dict | None = None) -> dict:
    """`measure` in a fresh spawned process: no allocator state shared with the caller or other variants,
    and a worker that dies or runs past `memory.timeout_seconds` is that variant's recorded failure."""
    result, error = run_isolated(_measure_logged, (str(variant_dir), p, device, leak_bytes_per_round, leak_rounds,
                                                   str(logs.current_log_file), max_memory),
                                 p.timeout_seconds, f"the process measuring {variant_dir}")
    if error:
        return {"variant": Path(variant_dir).name, "device": device, "status": "failed", "error": error}
    return result


def _measure_logged(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int,
                    leak_rounds: int | None, log_file: str, max_memory: dict | None = None) -> dict:
    logs.setup(log_file=Path(log_file))
    return measure(variant_dir, p, device, leak_bytes_per_round, leak_rounds, max_memory)


def main(variant: str, failed_because: str | None = None, inject_leak_bytes: int = 0,
         inject_leak_rounds: int | None = None) -> int:
    """Stage `memory@<variant>`: measure one variant's memory in a fresh process; a variant that failed earlier is
    recorded as failed."""
    from pipelines.core.io import write_json
    from pipelines.core.params import load_params
    from pipelines.core.paths import MEMORY_RESULTS, VARIANTS_DIR
    from pipelines.models.loading import resolve_device

    params = load_params()
    params.model_under_test(variant)
    device = resolve_device(params.device)
    if failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        write_json(MEMORY_RESULTS / f"{variant}.json", {"variant": variant, "device": device, "status": "failed",
                                                        "error": failed_because})
        log.warning("memory %s: recorded as FAILED (%s)", variant, failed_because)
        return 0
    with logs.progress(total=1, desc=f"memory {variant} ({device})", bar_format="{desc}: {elapsed}") as bar:
        result = measure_isolated(str(VARIANTS_DIR / variant), params.memory, device, inject_leak_bytes,
                                  inject_leak_rounds, params.gpus.shares())
        bar.update()
    if inject_leak_bytes:
        result["injected_leak"] = {"bytes_per_round": inject_leak_bytes, "rounds": inject_leak_rounds}
    write_json(MEMORY_RESULTS / f"{variant}.json", result)
    if result["status"] == "ok":
        sw = result["sweep"]
        log.info("memory %s: footprint %s B, KV %.0f B/token fitted (theory %d), soak: %s",
                 variant, f"{result['load']['footprint_bytes']:,}", sw["fitted_bytes_per_token"],
                 sw["theoretical_kv_bytes_per_token"], result["leak"]["reason"])
    else:
        log.warning("memory %s: FAILED (%s)", variant, result["error"])
    return 0
