"""Stage `memory@<variant>`: load footprint, peak against sequence length, growth under soak, fragmentation.

The incident behind this stage: a GPTQ checkpoint grew GPU memory 3-5 % more than FP16 under real
traffic and services ran out of memory hours later. Each variant is measured in a fresh process
(`measure_isolated`), so one variant's allocator state cannot leak into another's numbers.

Both devices report the same JSON shape. On CUDA the numbers come from `torch.cuda.memory_stats()`
(allocated = live tensors, the leak signal; reserved = allocator cache; inactive split = fragments)
and NVML (process and device memory, which also counts the CUDA context and kernel workspaces). On a
CPU, `allocated` and `reserved` come from glibc's `mallinfo2()` (bytes in use vs bytes the heap
holds, so 1 - allocated/reserved is the same fragmentation ratio), and `process` is the RSS.

This module measures; `pipelines/measure/memory_verdict.py` judges (leak verdict, growth against fp16) and
`pipelines/measure/memory_plots.py` draws the charts.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from scipy import stats

from pipelines.core import logs
from pipelines.core.isolation import run_isolated
from pipelines.measure.memory_verdict import leak_verdict
from pipelines.models.loading import load_variant, model_devices, variant_manifest
from pipelines.core.params import MemoryParams

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Probes: one snapshot shape for both devices
# --------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> _MallInfo2 | None:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    fn.restype = _MallInfo2
    return fn()


class CpuProbe:
    """Heap bytes in use / held (glibc mallinfo2), RSS, and a sampled peak RSS that can be reset."""

    device = "cpu"
    method = ("glibc mallinfo2 (allocated = uordblks + hblkhd, reserved = arena + hblkhd), "
              "psutil RSS, peak RSS sampled every 2 ms")

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, self.proc.memory_info().rss)

    def reset_peak(self) -> None:
        self._peak = self.proc.memory_info().rss

    def sync(self) -> None:
        gc.collect()

    def snapshot(self) -> dict:
        rss = self.proc.memory_info().rss
        info = _mallinfo2()
        allocated = reserved = None
        if info is not None:
            allocated = info.uordblks + info.hblkhd
            reserved = info.arena + info.hblkhd
        self._peak = max(self._peak, rss)
        return {"allocated": allocated, "reserved": reserved, "inactive_split": None, "peak_allocated": None,
                "peak_reserved": None, "peak_process": self._peak, "process": rss,
                "device_used": None, "alloc_retries": None, "ooms": None}

    def close(self) -> None:
        self._stop.set()


DEVICE_SUMS = ("allocated", "reserved", "inactive_split", "peak_allocated", "peak_reserved", "process", "device_used",
               "alloc_retries", "ooms")


def combine_devices(per_device: dict[str, dict]) -> dict:
    """One snapshot from each GPU's: every number summed over the devices (None where no device has it), and
    the devices' own snapshots under `devices`. Peaks are summed too, so on several GPUs `peak_allocated` is
    an upper bound of the simultaneous peak (each device's peak may fall at a different moment)."""
    snap: dict = {}
    for key in DEVICE_SUMS:
        values = [d[key] for d in per_device.values() if d.get(key) is not None]
        snap[key] = sum(values) if values else None
    snap["peak_process"] = None
    snap["devices"] = {name: dict(d) for name, d in per_device.items()}
    return snap


class CudaProbe:
    """torch.cuda.memory_stats() plus NVML process and device memory, on every GPU the model occupies.

    `devices`: CUDA indices to read (default: every visible GPU; `measure` narrows it to the model's after the
    first load). Each snapshot sums the devices and keeps each one's numbers under `devices`. `reader`
    (index -> that device's snapshot) replaces torch and NVML, for tests without a GPU."""

    device = "cuda"
    method = ("torch.cuda.memory_stats per device (allocated/reserved/inactive split, peaks reset per phase) + NVML, "
              "summed over the devices the model occupies")

    def __init__(self, devices: list[int] | None = None, reader=None) -> None:
        self.nvml = None
        self.handles: dict[int, object] = {}
        self.reader = reader or self._read_device
        self.devices = list(range(torch.cuda.device_count())) if devices is None else list(devices)
        if reader is not None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - NVML is optional; the allocator numbers still stand
            log.debug("NVML unavailable", exc_info=True)

    def use_devices(self, devices: list[int]) -> None:
        """Read these CUDA indices from now on (the devices the loaded model occupies)."""
        self.devices = sorted(devices)

    def reset_peak(self) -> None:
        for index in self.devices:
            torch.cuda.reset_peak_memory_stats(index)

    def sync(self) -> None:
        gc.collect()
        for index in self.devices:
            torch.cuda.synchronize(index)

    def _handle(self, index: int):
        if index not in self.handles:
            try:  # NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them for torch
                nvml_index = torch.cuda._get_nvml_device_index(index)
            except Exception:  # noqa: BLE001 - private helper; the plain index is right without the variable
                nvml_index = index
            self.handles[index] = self.nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        return self.handles[index]

    def _nvml(self, index: int) -> tuple[int | None, int | None]:
        if self.nvml is None:
            return None, None
        import os

        try:
            handle = self._handle(index)
            used = self.nvml.nvmlDeviceGetMemoryInfo(handle).used
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001 - NVML is optional; the allocator numbers still stand
            log.debug("NVML failed for cuda:%d", index, exc_info=True)
            return None, None
        mine = next((p.usedGpuMemory for p in procs if p.pid == os.getpid()), None)
        return mine, used

    def _read_device(self, index: int) -> dict:
        s = torch.cuda.memory_stats(index)
        process, device_used = self._nvml(index)
        return {"allocated": s.get("allocated_bytes.all.current", 0), "reserved": s.get("reserved_bytes.all.current", 0),
                "inactive_split": s.get("inactive_split_bytes.all.current", 0),
                "peak_allocated": s.get("allocated_bytes.all.peak", 0), "peak_reserved": s.get("reserved_bytes.all.peak", 0),
                "process": process, "device_used": device_used,
                "alloc_retries": s.get("num_alloc_retries", 0), "ooms": s.get("num_ooms", 0)}

    def snapshot(self) -> dict:
        return combine_devices({f"cuda:{i}": self.reader(i) for i in self.devices})

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.nvmlShutdown()


def device_breakdown(before: dict, after: dict, end: dict | None = None) -> dict[str, dict]:
    """Per GPU: the load footprint (allocated after the load minus before), what it held after the load, and at
    the end of the run (allocated, reserved, NVML process and device memory, allocator OOMs). {} on a CPU."""
    out: dict[str, dict] = {}
    for name, a in (after.get("devices") or {}).items():
        b = (before.get("devices") or {}).get(name, {})
        e = ((end or {}).get("devices") or {}).get(name, {})
        out[name] = {"footprint_bytes": a["allocated"] - (b.get("allocated") or 0),
                     "allocated_after_load": a["allocated"], "reserved_after_load": a["reserved"],
                     "process_after_load": a.get("process"), "device_used_after_load": a.get("device_used"),
                     "allocated_end": e.get("allocated"), "reserved_end": e.get("reserved"),
                     "peak_allocated_last_phase": e.get("peak_allocated"), "ooms": e.get("ooms")}
    return out


def describe_devices(breakdown: dict[str, dict]) -> list[str]:
    """One log line per GPU, and a total when there are several."""
    def mib(n):
        return "n/a" if n is None else f"{n / 2**20:.1f} MiB"

    lines = [f"{name}: load footprint {mib(d['footprint_bytes'])}, after load allocated "
             f"{mib(d['allocated_after_load'])} reserved {mib(d['reserved_after_load'])} (NVML process "
             f"{mib(d['process_after_load'])}, device used {mib(d['device_used_after_load'])}); end allocated "
             f"{mib(d['allocated_end'])} reserved {mib(d['reserved_end'])}, OOMs {d['ooms']}"
             for name, d in breakdown.items()]
    if len(breakdown) > 1:
        total = sum(d["footprint_bytes"] for d in breakdown.values())
        lines.append(f"{len(breakdown)} GPUs ({', '.join(breakdown)}): load footprint {mib(total)} in all")
    return lines


def make_probe(device: str):
    return CudaProbe() if device == "cuda" else CpuProbe()


def peak_of(snap: dict) -> int | None:
    """The phase peak a person compares: peak allocated on CUDA, peak RSS on a CPU."""
    return snap["peak_allocated"] if snap["peak_allocated"] is not None else snap["peak_process"]


# --------------------------------------------------------------------------------------------
# Theory and fits
# --------------------------------------------------------------------------------------------


def kv_bytes_per_token(config, element_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_bytes


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (bytes per token, bytes per round)."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def tensor_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _cache_bytes(past) -> int:
    """Bytes of the key/value tensors a transformers cache object holds."""
    total = 0
    for layer in getattr(past, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------


def _ids(n_tokens: int, batch: int, vocab: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n_tokens), generator=g).to(device)


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError, MemoryError)


def is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError when it cannot allocate."""
    if isinstance(err, _oom_types()):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text
                                              or "out of memory" in text)


def _increase(peak: int | None, before: dict) -> int | None:
    base = before["allocated"] if before["peak_allocated"] is not None else before["process"]
    return None if peak is None or base is None else peak - base


@torch.no_grad()
def sweep(model, probe, lengths: list[int], decode_tokens: int, vocab: int, device: str, batch: int) -> dict:
    """Peak per length for prefill and decode; bytes a prefill leaves held (the KV cache), per sequence.

    Prefill keeps the cache and the last token's logits only, so what stays allocated is the cache;
    it runs `batch` sequences at once so the per-token cache stands well above heap noise.
    Decode runs one sequence and generates `decode_tokens` tokens.
    """
    rows = []
    try:  # warm-up at the longest length: first-call allocations (kernels, caches) are not a length's cost
        model.generate(_ids(max(lengths), 1, vocab, device, 0), max_new_tokens=1, do_sample=False, pad_token_id=0)
    except Exception as err:  # noqa: BLE001 - an OOM here shows again at that length, where it is recorded
        if not is_oom(err):
            raise
    for n in lengths:
        row: dict = {"tokens": n}
        try:
            probe.sync()
            probe.reset_peak()
            before = probe.snapshot()
            out = model(_ids(n, batch, vocab, device, n), use_cache=True, logits_to_keep=1)
            probe.sync()
            held = probe.snapshot()
            row["prefill_peak"] = peak_of(held)
            row["prefill_peak_increase"] = _increase(peak_of(held), before)
            row["kv_cache_bytes"] = _cache_bytes(out.get("cache") or out.get("past_key_values")) // batch
            row["retained_bytes"] = ((held["allocated"] - before["allocated"]) // batch
                                     if held["allocated"] is not None else None)
            del out
            probe.sync()
            probe.reset_peak()
            prompt = max(1, n - decode_tokens)
            model.generate(_ids(prompt, 1, vocab, device, n + 1), max_new_tokens=n - prompt, min_new_tokens=n - prompt,
                           do_sample=False, pad_token_id=0)
            probe.sync()
            row["decode_peak"] = peak_of(probe.snapshot())
            row["decode_peak_increase"] = _increase(row["decode_peak"], before)
        except Exception as err:  # noqa: BLE001 - only an OOM is a result; anything else is the variant's failure
            if not is_oom(err):
                raise
            row["oom"] = f"{type(err).__name__}: {err}"[:300]
            probe.sync()
        rows.append(row)
    ok = [r for r in rows if "oom" not in r and r.get("retained_bytes") is not None]
    return {"lengths": rows,
            "fitted_bytes_per_token": slope([r["tokens"] for r in ok], [r["retained_bytes"] for r in ok]),
            "kv_cache_bytes_per_token": slope([r["tokens"] for r in ok], [r["kv_cache_bytes"] for r in ok])}


def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of the pairwise slopes: one spike (a one-off allocation) cannot move it, unlike least squares."""
    if len(xs) < 2:
        return float("nan")
    return float(stats.theilslopes(np.asarray(ys, float), np.asarray(xs, float))[0])


def _median3(values: list[float]) -> list[float]:
    """Running median of three: one-off spikes (a single allocation in one round) vanish, steps stay."""
    if len(values) < 3:
        return list(values)
    return [values[0]] + [float(np.median(values[i - 1 : i + 2])) for i in range(1, len(values) - 1)] + [values[-1]]


def warmup_end(values: list[float], tail: int, floor: float) -> int | None:
    """First measured round after which memory never rises more than `floor` above the lowest level seen
    since that round (one-off spikes ignored), with at least `tail` rounds to show it. None: it never
    settled. Rises are measured from the running minimum, so memory that drops (a pool handed back) and
    then grows again is growth. What comes before the returned round is warm-up: caches and pools filling,
    which stops; a leak never settles. A leak that grows in steps rarer than every `tail` rounds can look
    settled: raise `memory.tail_rounds` to look for slower ones."""
    smooth = _median3(values)
    for start in range(0, len(smooth) - tail + 1):
        low, rise = smooth[start], 0.0
        for value in smooth[start:]:
            low = min(low, value)
            rise = max(rise, value - low)
        if rise <= floor:
            return start
    return None


def growth_rate(values: list[float], tail: int, floor: float) -> float | None:
    """Bytes per round memory still grows by: 0 once it has settled (warmup_end), else the Theil-Sen slope
    of the last `tail` rounds (never below 0)."""
    if len(values) < 2:
        return None
    if warmup_end(values, tail, floor) is not None:
        return 0.0
    window = values[-tail:]
    return max(0.0, theil_sen(list(range(len(window))), window))


@torch.no_grad()
def soak(model, probe, p: MemoryParams, max_len: int, vocab: int, device: str, leak_bytes_per_round: int = 0,
         leak_rounds: int | None = None) -> dict:
    """Warm-up rounds, then measured rounds of mixed traffic until growth has stopped or max_rounds is reached.

    A round is what hurts allocators in production: a burst of long requests batched together, then
    short and long requests alternating (which leaves holes in the cache). After `rounds` measured rounds,
    while memory has not settled (warmup_end), more rounds run, up to `max_rounds`: caches that fill up
    stop growing, a leak does not. `leak_bytes_per_round` keeps
    that many bytes alive per round (for the first `leak_rounds` rounds only, if given): the self-test
    that a leak is caught and a warm-up that plateaus is not.
    """
    long_len = max(2, int(max_len * p.long_fraction))
    short_len = max(2, int(max_len * p.short_fraction))
    kept: list[torch.Tensor] = []
    samples = []
    oom = None
    r = 0
    signal = None
    while True:
        try:
            model(_ids(long_len - p.decode_tokens, p.burst_size, vocab, device, r), use_cache=True, logits_to_keep=1)
            for k in range(p.alternations):
                n = long_len if k % 2 else short_len
                model.generate(_ids(n - p.decode_tokens, 1, vocab, device, 1000 * r + k), max_new_tokens=p.decode_tokens,
                               do_sample=False, pad_token_id=0)
            if leak_bytes_per_round and (leak_rounds is None or r < p.warmup_rounds + leak_rounds):
                kept.append(torch.ones(leak_bytes_per_round // 4, dtype=torch.float32, device=device))
        except Exception as err:  # noqa: BLE001 - only an OOM is a result; anything else is the variant's failure
            if not is_oom(err):
                raise
            oom = f"soak round {r}: {type(err).__name__}: {err}"[:300]
            break
        probe.sync()
        r += 1
        if r <= p.warmup_rounds:
            continue
        snap = probe.snapshot()
        samples.append({"round": len(samples), "allocated": snap["allocated"], "reserved": snap["reserved"],
                        "process": snap["process"]})
        signal = signal or ("allocated" if snap["allocated"] is not None else "process")
        values = [s[signal] for s in samples]
        if len(values) >= p.max_rounds or (len(values) >= p.rounds
                                           and warmup_end(values, p.tail_rounds, p.noise_floor_bytes) is not None):
            break
    values = [s[signal] for s in samples] if signal else []
    end = probe.snapshot()
    requests = p.burst_size + p.alternations
    result = {
        "signal": signal,
        "rounds": samples,
        "requests_per_round": requests,
        "long_tokens": long_len,
        "short_tokens": short_len,
        "tail_rounds": min(p.tail_rounds, len(values)),
        "growth_bytes_per_round": growth_rate(values, p.tail_rounds, p.noise_floor_bytes),
        "warmup_end_round": warmup_end(values, p.tail_rounds, p.noise_floor_bytes),
        "growth_last_minus_first": (values[-1] - values[0]) if len(values) >= 2 else None,
        "fragmentation": {
            "one_minus_allocated_over_reserved": (1 - end["allocated"] / end["reserved"])
            if end["allocated"] is not None and end["reserved"] else None,
            "inactive_split_over_reserved": (end["inactive_split"] / end["reserved"])
            if end["inactive_split"] is not None and end["reserved"] else None,
        },
        "oom": oom,
    }
    del kept
    return result


def measure(variant_dir: str, p: MemoryParams, device: str, leak_bytes_per_round: int = 0,
            leak_rounds: int | None = None, max_memory: dict | None = None) -> dict:
    """All phases for one variant, in this process; failures are recorded, never raised.

    `max_memory`: `gpus.max_memory` parsed (GpusParams.shares()), for variants that load across GPUs. On CUDA the
    probe reads every GPU the model occupies, the totals are sums over them, and `devices` holds each one's."""
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
        result["sweep"] = sweep(model, probe, lengths, p.decode_tokens, config.vocab_size, device, p.sweep_batch)
        result["sweep"]["theoretical_kv_bytes_per_token"] = kv_bytes_per_token(config, element)
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
