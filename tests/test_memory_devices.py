"""The CUDA probe across several GPUs, without a GPU: a fake per-device reader stands in for torch.cuda and NVML.
The sums, the per-device breakdown and the log lines are tested here; a real multi-GPU run is not (docs/memory.md)."""

from __future__ import annotations

from pipelines.measure import probes

MiB = 2**20


def _device(allocated, reserved, peak, process=None, used=None, ooms=0):
    return {"allocated": allocated, "reserved": reserved, "inactive_split": reserved - allocated,
            "peak_allocated": peak, "peak_reserved": reserved, "process": process, "device_used": used,
            "alloc_retries": 0, "ooms": ooms}


class FakeGpus:
    """What each GPU reports; tests change `state` between snapshots."""

    def __init__(self, state):
        self.state = state
        self.read = []

    def __call__(self, index):
        self.read.append(index)
        return dict(self.state[index])


def test_snapshot_sums_the_devices_and_keeps_each_ones_numbers():
    gpus = FakeGpus({0: _device(100 * MiB, 128 * MiB, 110 * MiB, 300 * MiB, 400 * MiB),
                     1: _device(60 * MiB, 64 * MiB, 70 * MiB, 200 * MiB, 250 * MiB, ooms=1),
                     2: _device(5 * MiB, 8 * MiB, 5 * MiB)})
    probe = probes.CudaProbe(devices=[0, 1], reader=gpus)
    snap = probe.snapshot()
    assert gpus.read == [0, 1]  # only the devices the model occupies
    assert snap["allocated"] == 160 * MiB and snap["reserved"] == 192 * MiB and snap["inactive_split"] == 32 * MiB
    assert snap["peak_allocated"] == 180 * MiB and snap["process"] == 500 * MiB and snap["device_used"] == 650 * MiB
    assert snap["ooms"] == 1 and snap["alloc_retries"] == 0 and snap["peak_process"] is None
    assert list(snap["devices"]) == ["cuda:0", "cuda:1"] and snap["devices"]["cuda:1"]["allocated"] == 60 * MiB
    # the keys a CPU snapshot has, plus the breakdown: peak_of and the phases read the sums unchanged
    assert set(snap) - {"devices"} == {"allocated", "reserved", "inactive_split", "peak_allocated", "peak_reserved",
                                       "peak_process", "process", "device_used", "alloc_retries", "ooms"}
    assert probes.peak_of(snap) == 180 * MiB


def test_nvml_missing_on_every_device_stays_none():
    probe = probes.CudaProbe(devices=[0, 1], reader=FakeGpus({0: _device(1, 2, 1), 1: _device(3, 4, 3)}))
    snap = probe.snapshot()
    assert snap["process"] is None and snap["device_used"] is None and snap["allocated"] == 4


def test_use_devices_narrows_what_is_read():
    gpus = FakeGpus({i: _device(i, i + 1, i) for i in range(4)})
    probe = probes.CudaProbe(devices=[0, 1, 2, 3], reader=gpus)
    probe.use_devices([2, 0])
    assert list(probe.snapshot()["devices"]) == ["cuda:0", "cuda:2"]


def test_one_gpu_gives_the_totals_it_always_did():
    probe = probes.CudaProbe(devices=[0], reader=FakeGpus({0: _device(100, 128, 110, 7, 9)}))
    snap = probe.snapshot()
    assert {k: snap[k] for k in ("allocated", "reserved", "peak_allocated", "process", "device_used")} == {
        "allocated": 100, "reserved": 128, "peak_allocated": 110, "process": 7, "device_used": 9}


def test_breakdown_and_log_say_per_device_what_was_seen():
    gpus = FakeGpus({0: _device(1 * MiB, 2 * MiB, 1 * MiB), 1: _device(0, 0, 0)})
    probe = probes.CudaProbe(devices=[0, 1], reader=gpus)
    before = probe.snapshot()
    gpus.state = {0: _device(700 * MiB, 768 * MiB, 700 * MiB, 900 * MiB, 1000 * MiB),
                  1: _device(500 * MiB, 512 * MiB, 500 * MiB, 600 * MiB, 700 * MiB)}
    after = probe.snapshot()
    gpus.state[1] = _device(520 * MiB, 576 * MiB, 560 * MiB, ooms=0)
    end = probe.snapshot()
    breakdown = probes.device_breakdown(before, after, end)
    assert breakdown["cuda:0"]["footprint_bytes"] == 699 * MiB and breakdown["cuda:1"]["footprint_bytes"] == 500 * MiB
    assert sum(d["footprint_bytes"] for d in breakdown.values()) == after["allocated"] - before["allocated"]
    assert breakdown["cuda:1"]["allocated_end"] == 520 * MiB and breakdown["cuda:1"]["reserved_end"] == 576 * MiB
    assert breakdown["cuda:0"]["device_used_after_load"] == 1000 * MiB
    lines = probes.describe_devices(breakdown)
    assert lines[0].startswith("cuda:0: load footprint 699.0 MiB") and lines[1].startswith("cuda:1: load footprint 500.0")
    assert lines[2] == "2 GPUs (cuda:0, cuda:1): load footprint 1199.0 MiB in all"
    assert len(probes.describe_devices({"cuda:0": breakdown["cuda:0"]})) == 1  # no total line for one GPU


def test_cpu_snapshots_have_no_breakdown():
    probe = probes.CpuProbe()
    try:
        snap = probe.snapshot()
    finally:
        probe.close()
    assert "devices" not in snap and probes.device_breakdown(snap, snap, snap) == {}
