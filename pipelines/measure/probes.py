"""What a memory measurement reads: one snapshot shape for a CPU (glibc heap, RSS) and for CUDA (allocator, NVML).

Both probes answer `snapshot()` with the same keys, so every phase (pipelines/measure/phases.py) and the
stage (pipelines/memory.py) read the numbers without asking which device they came from.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import threading

import psutil
import torch

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2_function():
    """glibc's mallinfo2, looked up once: a CDLL made per reading kept ~1.7 KB alive each soak round (the tracer
    found it, pipelines/measure/attribution.py)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    fn.restype = _MallInfo2
    return fn


def _mallinfo2() -> _MallInfo2 | None:
    fn = _mallinfo2_function()
    return fn() if fn is not None else None


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
