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

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from pathlib import Path

from pipelines.core import logs
from pipelines.core.errors import environment_cause
from pipelines.core.isolation import run_isolated
from pipelines.core.params_sections import MemoryParams
from pipelines.core.timing import library_call
from pipelines.measure.attribution import ALLOC_CONF_VARS, TRACE_ARTIFACTS, TRACES_INDEX

log = logging.getLogger(__name__)
TIMEOUT_RESERVE_S = 60  # of memory.timeout_seconds: spawning, imports and writing the result, outside measure()


def measure(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int = 0,
            leak_rounds: int | None = None, max_memory: dict | None = None, trace_dir: str | None = None) -> dict:
    """All phases for one variant, in this process; failures are recorded, never raised.

    `max_memory`: `gpus.max_memory` parsed (GpusParams.shares()), for variants that load across GPUs. On CUDA the
    probe reads every GPU the model occupies, the totals are sums over them, and `devices` holds each one's.
    A soak that does not settle goes on under a tracer (pipelines/measure/attribution.py), its flame graph or
    snapshot written to `trace_dir` (default: a temporary folder)."""
    import tempfile

    import torch  # here, in the isolated child: the stage's parent never loads a model

    from pipelines.measure.attribution import explain, fragmentation
    from pipelines.measure.phases import Injection, kv_bytes_per_token, soak, sweep, tensor_bytes
    from pipelines.measure.probes import describe_devices, device_breakdown, make_probe, peak_of
    from pipelines.measure.verdict import leak_verdict
    from pipelines.models.loading import load_variant, model_devices, variant_manifest

    torch.set_num_threads(p.threads)
    # the traced rounds stop in time for the result to be written before the parent's timeout kills this process
    deadline = time.monotonic() + p.timeout_seconds - TIMEOUT_RESERVE_S
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
        # Every round collects garbage (probe.sync); the millions of objects the imports made would make each
        # collection take a quarter of a second on a CPU. They live as long as the process: freeze them (after the
        # first model's cycles are collected), so a collection walks only what the model and the rounds made.
        gc.freeze()
        stop_progress_monitor()
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
        # a loader may unpack weights at the first forward (transformers' compressed-tensors route does, to the
        # model's dtype): what the model holds while it serves, beside what it held when loaded
        result["load"]["tensor_bytes_after_forward"] = tensor_bytes(model)
        inject = Injection(leak_bytes_per_round, None if leak_rounds is None else p.warmup_rounds + leak_rounds)
        with library_call("forward (soak rounds)"):
            result["soak"] = soak(model, probe, p, max_len, config.vocab_size, device, inject)
        cause = fragmentation(result["soak"], footprint, p, device)
        if result["soak"]["growth_bytes_per_round"] and p.trace_rounds and not result["soak"]["oom"]:
            with library_call("forward (traced rounds)"):
                out = Path(trace_dir) if trace_dir else Path(tempfile.mkdtemp(prefix="quantgate-trace-"))
                cause = explain(model, p, max_len, config.vocab_size, device, result["soak"], out, inject, deadline)
            if cause.get("oom"):  # more of the same traffic ran out of memory: the strongest evidence there is
                result["soak"]["oom"] = cause["oom"]
        result["growth_cause"] = cause
        result["leak"] = leak_verdict(result["soak"], footprint, p, cause)
        end = probe.snapshot()  # CUDA: OOMs the allocator hit and recovered from (a library caught and retried)
        result["allocator"] = {"ooms": end["ooms"], "alloc_retries": end["alloc_retries"]}
        result["peak_reserved_bytes"] = end.get("peak_reserved")  # CUDA: since the last sweep length, the soak included
        if "devices" in after:  # CUDA: what each GPU saw
            result["devices"] = device_breakdown(before, after, end)
            for line in describe_devices(result["devices"]):
                log.info("memory %s: %s", result["variant"], line)
    except Exception as err:  # noqa: BLE001 - a variant that fails to load is that variant's result
        logging.getLogger().error("memory %s failed", variant_dir, exc_info=True)
        result.update({"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000], **(environment_cause(err) or {})})
    finally:
        probe.close()
        gc.unfreeze()  # (above: in the stage's isolated child; a caller that measures in its own process keeps its gc)
    return result


def stop_progress_monitor() -> None:
    """Stop tqdm's monitor thread (a library's progress bar starts it; it wakes every 10 s) and keep it from starting
    again: what it allocates between rounds would be counted as the model's growth (a fanned-out gptq3 soak was once
    flagged as a leak, 95 % of it traced to tqdm/_monitor.py)."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    std.tqdm.monitor_interval = 0
    for thread in threading.enumerate():
        if isinstance(thread, std.TMonitor):
            thread.exit()


def measure_isolated(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int = 0,
                     leak_rounds: int | None = None, max_memory: dict | None = None,
                     trace_dir: str | None = None) -> dict:
    """`measure` in a fresh spawned process: no allocator state shared with the caller or other variants,
    and a worker that dies or runs past `memory.timeout_seconds` is that variant's recorded failure."""
    result, error = run_isolated(_measure_logged, (str(variant_dir), p, device, leak_bytes_per_round, leak_rounds,
                                                   str(logs.current_log_file), max_memory, trace_dir),
                                 p.timeout_seconds, f"the process measuring {variant_dir}")
    if error:
        return {"variant": Path(variant_dir).name, "device": device, "status": "failed", "error": error}
    return result


def _measure_logged(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int,
                    leak_rounds: int | None, log_file: str, max_memory: dict | None = None,
                    trace_dir: str | None = None) -> dict:
    logs.setup(log_file=Path(log_file))
    return measure(variant_dir, p, device, leak_bytes_per_round, leak_rounds, max_memory, trace_dir)


@contextlib.contextmanager
def cuda_allocator(setting: str | None):
    """The allocator setting `setting` for the processes spawned inside (None: the environment's own), in both
    variables PyTorch reads (ALLOC_CONF_VARS). Set in this parent, which never touches CUDA, so each child reads it
    before its allocator starts. Yields the setting in force ("default" when none is)."""
    before = {k: os.environ.get(k) for k in ALLOC_CONF_VARS}
    if setting is not None:
        os.environ.update({k: setting for k in ALLOC_CONF_VARS})
    try:
        yield next((os.environ[k] for k in ALLOC_CONF_VARS if os.environ.get(k)), "default")
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare_allocators(variant_dir: str, p: MemoryParams, device: str, served: dict, max_memory: dict | None,
                       leak_bytes_per_round: int = 0, leak_rounds: int | None = None) -> dict:
    """On CUDA, the soak again under each of `memory.compare_allocators` (the same injected leak, if any):
    fragmentation (1 - allocated/reserved at the end), peak reserved and growth per setting, beside the served
    setting's own. Skipped on a CPU, saying why."""
    if device != "cuda":
        return {"skipped": "on a CPU: PYTORCH_CUDA_ALLOC_CONF configures the CUDA caching allocator only (glibc's "
                           "heap fragmentation is under soak.fragmentation)"}

    def row(r: dict) -> dict:
        if r.get("status") != "ok":
            return {"status": "failed", "error": r.get("error")}
        return {"status": "ok", "fragmentation": r["soak"]["fragmentation"]["one_minus_allocated_over_reserved"],
                "peak_reserved_bytes": r.get("peak_reserved_bytes"),
                "growth_bytes_per_round": r["soak"]["growth_bytes_per_round"],
                "footprint_bytes": r["load"]["footprint_bytes"]}

    rows = {served.get("allocator_setting", "default"): {**row(served), "served": True}}
    for setting in p.compare_allocators:
        if setting in rows:
            continue
        with cuda_allocator(setting):
            rows[setting] = row(measure_isolated(variant_dir, p.model_copy(update={"trace_rounds": 0}), device,
                                                 leak_bytes_per_round, leak_rounds, max_memory))
    return rows


def write_trace_index(traces: Path, result: dict) -> None:
    """traces/<variant>/index.json: whether the growth was traced and which files a person opens (record attaches
    them); always written, so the stage's output folder is never empty (git keeps no empty folder)."""
    from pipelines.core.io import write_json

    cause = result.get("growth_cause") or {}
    write_json(traces / TRACES_INDEX, {"variant": result.get("variant"), "traced": bool(cause.get("tracer")),
                                       "class": cause.get("class"),
                                       "artifacts": sorted(f.name for f in traces.iterdir() if f.name in TRACE_ARTIFACTS)})


def main(variant: str, failed_because: str | None = None, inject_leak_bytes: int = 0,
         inject_leak_rounds: int | None = None) -> int:
    """Stage `memory@<variant>`: measure one variant's memory in a fresh process; a variant that failed earlier is
    recorded as failed."""
    import shutil

    from pipelines.core.io import write_json
    from pipelines.core.params import load_params
    from pipelines.core.paths import MEMORY_RESULTS, MEMORY_TRACES, VARIANTS_DIR
    from pipelines.models.loading import NOT_MEASURED, endpoint_of, no_model_here, resolve_device

    params = load_params()
    params.model_under_test(variant)
    device = resolve_device(params.device)
    traces = MEMORY_TRACES / variant  # an output of the stage even when nothing grew: then only its index
    shutil.rmtree(traces, ignore_errors=True)
    traces.mkdir(parents=True)
    if failed_because:  # `quantgate fanout` records a run that died outside the stage (docs/fanout.md)
        write_json(MEMORY_RESULTS / f"{variant}.json", {"variant": variant, "device": device, "status": "failed",
                                                        "error": failed_because})
        write_trace_index(traces, {})
        log.warning("memory %s: recorded as FAILED (%s)", variant, failed_because)
        return 0
    if no_model_here(VARIANTS_DIR / variant):  # a sample log or an endpoint (pipelines/evaluation/): no weights here
        endpoint = endpoint_of(VARIANTS_DIR / variant)
        why = (f"served at {endpoint['base_url']} by another engine: its footprint and growth are not measured here "
               "against fp16's" if endpoint else "its evidence is an lm-eval sample log: no model here to load")
        row = {"variant": variant, "device": None, "status": NOT_MEASURED, "reason": why}
        if endpoint:  # what can be seen from outside, labelled so: never the numbers the verdict compares
            from pipelines.measure.served import observe

            row["observed_from_outside"] = observe(endpoint)
        write_json(MEMORY_RESULTS / f"{variant}.json", row)
        write_trace_index(traces, {})
        log.info("memory %s: not measured (%s)", variant, why)
        return 0
    p = params.memory
    with logs.progress(total=1 + len(p.compare_allocators) * (device == "cuda"), desc=f"memory {variant} ({device})",
                       bar_format="{desc}: {n}/{total} {elapsed}") as bar:
        with cuda_allocator(p.allocator if device == "cuda" else None) as setting:
            result = measure_isolated(str(VARIANTS_DIR / variant), p, device, inject_leak_bytes,
                                      inject_leak_rounds, params.gpus.shares(), str(traces))
        if device == "cuda":
            result["allocator_setting"] = setting
        bar.update()
        if inject_leak_bytes:
            result["injected_leak"] = {"bytes_per_round": inject_leak_bytes, "rounds": inject_leak_rounds}
        write_json(MEMORY_RESULTS / f"{variant}.json", result)  # kept if a comparison below is killed
        if result["status"] == "ok":
            result["allocators"] = compare_allocators(str(VARIANTS_DIR / variant), p, device, result,
                                                      params.gpus.shares(), inject_leak_bytes, inject_leak_rounds)
            bar.update(len(p.compare_allocators) * (device == "cuda"))
            write_json(MEMORY_RESULTS / f"{variant}.json", result)
    write_trace_index(traces, result)
    if result["status"] == "ok":
        sw = result["sweep"]
        log.info("memory %s: footprint %s B, KV %.0f B/token fitted (theory %d), soak: %s",
                 variant, f"{result['load']['footprint_bytes']:,}", sw["fitted_bytes_per_token"],
                 sw["theoretical_kv_bytes_per_token"], result["leak"]["reason"])
    else:
        log.warning("memory %s: FAILED (%s)", variant, result["error"])
    return 0
