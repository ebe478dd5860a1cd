"""Why memory grows: the soak goes on under a tracer, the bytes that grew are attributed to allocation sites, and
the growth is called a leak, a bounded cache or fragmentation, with the evidence beside the label.

Only a variant whose soak did not settle pays for this (pipelines/memory.py calls `explain` then). It runs
`memory.trace_rounds` more rounds of the same traffic on the same model, in the same process, so a leak goes on
leaking from where it did:
- CPU: memray with native traces (Python and C/C++ frames) over all traced rounds. After each round the stage
  collects garbage and pauses; a memray memory snapshot taken inside that pause marks the round's end (none
  inside it: the trace cannot be read, and says so). Its temporal records then give, per allocation site, the
  bytes alive at each round's end, counting only what was allocated under the tracer (memray's own bookkeeping and
  the bytes held before it started are not in it). Direct mmaps (pymalloc's arenas) are left out, as the soak's
  glibc heap figure leaves them out; Python's own allocators are not traced one object at a time, since objects
  parked on CPython's free lists would look alive forever. The flame graph of what is still alive is memray's HTML.
- CUDA: the caching allocator's recorded history (`torch.cuda.memory._record_memory_history`) and one snapshot per
  round: blocks allocated under the recording (they carry its stacks) alive at each round's end, grouped by stack;
  the last snapshot is written for PyTorch's memory_viz (https://pytorch.org/memory_viz). cudaMallocAsync records
  no history: there the growth is not traced, and the result says so.

The class (`classify`): alive bytes that the tracer saw grow at about the soak's rate and that then stop within
the traced rounds are a bounded cache (its size is judged against the policy as growth,
pipelines/measure/verdict.py); bytes that grow in every third of the traced rounds at the same site are a leak;
anything else that grows is unbounded growth (judged as a leak). Fragmentation needs no tracer: the memory the
allocator holds grows while the bytes in use settled (judged as growth on CUDA, reported on a CPU).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from pipelines.core.params_sections import MemoryParams
from pipelines.measure.growth import growth_rate, median3, warmup_end

log = logging.getLogger(__name__)

SNAPSHOT_MS = 10  # memray's memory snapshot interval
PAUSE_S = 0.05  # after each traced round: memray snapshots that fall between rounds, not inside one
MEMORY_RECORDS = 10_000_000  # memray's reader keeps only every k-th snapshot beyond its default 10,000 (100 s)
SEEN_RATE = 0.5  # a cache: under the tracer it grew at least this share of the soak's rate until it stopped
FLAMEGRAPH_S = 300  # drawing the flame graph: at most this long
MIN_ROUNDS = 6  # fewer traced rounds (cut by the deadline) are not read: too few to tell a stop from a pause
TOP_SITES = 5
LEAK_SITE_SHARE = 0.5  # a leak: one site holds at least this share of the growth, and grows in every third
STACK_FRAMES = 12  # frames kept per site in the results (the flame graph has them all)
# Native frames that allocate rather than say who asked: skipped when naming the native caller.
ALLOCATOR_FRAME = re.compile(r"alloc|malloc|memalign|operator new|empty|make_tensor|TensorImpl|_PyObject_|PyMem_|"
                             r"obmalloc|^<unknown>$", re.IGNORECASE)
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # PyTorch reads either (newer: the second)
TRACE_ARTIFACTS = ("flamegraph.html", "cuda_snapshot.pickle")  # what a person opens; record attaches these
TRACES_INDEX = "index.json"  # always written, so the folder (a DVC output that git keeps) is never empty


def library_of(path: str) -> str:
    """The package a Python file belongs to: site-packages/<package>/..., quantgate for this project's code,
    python for the standard library, else the file's name."""
    if "site-packages/" in path or "dist-packages/" in path:
        rest = re.split(r"(?:site|dist)-packages/", path)[-1]
        return rest.split("/")[0].removesuffix(".py")
    if path.startswith(f"{PROJECT_ROOT}/pipelines/") or path.startswith("pipelines/"):
        return "quantgate"
    if re.search(r"/python3\.\d+/", path):
        return "python"
    return Path(path).name


def site_of(frames: list[tuple[str, str, int]]) -> dict:
    """Where an allocation was made, innermost frame first: the innermost Python frame (function, file:line) and
    its library, and the innermost native frame that is not the allocator itself (the C/C++ call behind it)."""
    python = next((f for f in frames if f[1].endswith(".py")), None)
    native = next((f[0] for f in frames if not f[1].endswith(".py") and not ALLOCATOR_FRAME.search(f[0])), None)
    where = re.split(r"(?:site|dist)-packages/", python[1])[-1].removeprefix(PROJECT_ROOT + "/") if python else None
    return {"frame": f"{python[0]} ({where}:{python[2]})" if python else None,
            "library": library_of(python[1]) if python else "native",
            "native": native[:160] if native else None,
            "stack": [f"{n[:120]} ({Path(f).name}:{line})" for n, f, line in frames[:STACK_FRAMES]]}


def top_sites(growth: list[tuple[int, dict]], total: int) -> list[dict]:
    """Growth per site (the same Python frame and native caller), largest first, each with its share of `total`."""
    merged: dict[tuple, dict] = {}
    for size, site in growth:
        key = (site["frame"], site["native"])
        row = merged.setdefault(key, {**site, "bytes": 0})
        row["bytes"] += size
    rows = sorted(merged.values(), key=lambda r: -r["bytes"])[:TOP_SITES]
    for r in rows:
        r["share"] = r["bytes"] / total if total > 0 else None
    return rows


def fragmentation(soak: dict, footprint: int, p: MemoryParams, device: str) -> dict | None:
    """Fragmentation: the bytes in use settled while the heap (CPU) or the allocator's reserve (CUDA) kept growing,
    by more than leak_tolerance_pct of the footprint over `rounds` rounds. None when that is not what the soak shows.
    `judged` on CUDA, where the reserve is what runs a GPU out of memory; a CPU heap's arena is reported only."""
    rounds = soak.get("rounds") or []
    if soak.get("signal") != "allocated" or soak.get("growth_bytes_per_round") != 0 or footprint <= 0:
        return None
    reserved = [s["reserved"] for s in rounds if s.get("reserved") is not None]
    if len(reserved) < 2 or warmup_end(reserved, p.tail_rounds, p.noise_floor_bytes) is not None:
        return None
    rate = growth_rate(reserved, p.tail_rounds, p.noise_floor_bytes)
    pct = 100 * rate * p.rounds / footprint
    if pct <= p.leak_tolerance_pct:
        return None
    end = soak["fragmentation"]["one_minus_allocated_over_reserved"]
    return {"class": "fragmentation", "growth_bytes_per_round": 0.0, "reserved_growth_bytes_per_round": rate,
            "reserved_growth_pct_of_footprint": pct, "sites": [], "judged": device == "cuda",
            "evidence": f"bytes in use settled at round {soak['warmup_end_round']}, while the memory the allocator "
                        f"holds grew {rate:,.0f} B/round over the last {p.tail_rounds} of {len(rounds)} rounds "
                        f"({pct:.2f} % of the footprint over {p.rounds}); 1 - allocated/reserved at the end: "
                        + ("n/a" if end is None else f"{end:.3f}")}


def classify(series: list[int], per_third: list[list[int]], sites: list[dict], soak: dict, p: MemoryParams) -> dict:
    """The class of growth the traced rounds show, with its evidence.

    `series`: bytes alive (allocated under the tracer) at each traced round's end; `per_third`: growth per site
    (the order of `sites`) in each third of the traced rounds. Cache: the series settles (warmup_end, the soak's own
    rule) at traced round s >= 1, after growing at least SEEN_RATE x the soak's rate x s between round ends (else the
    tracer did not see the growth, and a flat series is no evidence that it stopped); its size is the growth from
    the first measured soak round plus what was alive under the tracer. Leak: it never settles and the
    top site holds >= LEAK_SITE_SHARE of the growth and grew in every third. Otherwise unbounded growth.
    The size leaves out what grew in the soak's unmeasured warm-up rounds and counts whole what the first traced round
    allocated, state it only replaced included."""
    settled = warmup_end(series, min(p.tail_rounds, max(2, len(series) - 1)), p.noise_floor_bytes) if series else None
    rate = growth_rate(series, p.tail_rounds, p.noise_floor_bytes) if len(series) >= 2 else None
    added = max(series) if series else 0  # alive under the tracer: 0 when it started
    soak_growth = max(0, soak.get("growth_last_minus_first") or 0)
    soak_rate = soak.get("growth_bytes_per_round") or 0
    top = sites[0] if sites else None
    where = f"{top['share']:.0%} under {top['frame'] or top['native']} in {top['library']}" if top and top.get("share") \
        else "no site holds it"
    smooth = median3(series)
    seen = smooth[settled] - smooth[0] if settled else 0  # what it grew, between round ends, before it stopped
    if settled and seen >= SEEN_RATE * soak_rate * settled:
        size = soak_growth + added
        return {"class": "cache", "growth_bytes_per_round": 0.0, "size_bytes": size, "stopped_at_traced_round": settled,
                "evidence": f"it stopped: under the tracer it grew {seen:,.0f} B over {settled} round(s) (the soak: "
                            f"{soak_rate:,.0f} B/round), then settled at traced round {settled} of {len(series)} "
                            f"(rises under the {p.noise_floor_bytes:,} B floor after it); {soak_growth:,} B grew from "
                            f"the first measured soak round and {added:,} B were alive under the tracer: a bounded "
                            f"cache of {size:,} B ({where})"}
    if settled is not None:  # the soak grew, the tracer did not see it grow before it 'stopped': no evidence
        return {"class": "unbounded", "growth_bytes_per_round": soak_rate,
                "evidence": f"the soak grew {soak_rate:,.0f} B/round, but under the tracer the alive bytes grew only "
                            f"{seen:,.0f} B before settling at traced round {settled}: growth the tracer does not see "
                            f"(an allocator memray does not hook) or one that stopped as it started is no evidence of "
                            f"a bounded cache; judged as measured"}
    consistent = bool(top and top.get("share") and top["share"] >= LEAK_SITE_SHARE and per_third
                      and all(third[0] > 0 for third in per_third))
    kind = "leak" if consistent else "unbounded"
    thirds = ", ".join(f"{third[0]:,}" for third in per_third) if per_third and sites else "n/a"
    return {"class": kind, "growth_bytes_per_round": rate,
            "evidence": f"still growing at the last of {len(series)} traced rounds ({rate:,.0f} B/round); "
                        + (f"the top site grew in every third of them ({thirds} B): {where}" if consistent else
                           f"no one site holds it in every third (top site per third: {thirds} B): {where}")}


class TraceCut(RuntimeError):
    """The traced rounds would run past the measuring process's deadline."""


def explain(model, p: MemoryParams, max_len: int, vocab: int, device: str, soak: dict, out_dir: Path,
            inject=None, deadline: float | None = None) -> dict:
    """`p.trace_rounds` more rounds under the tracer, after a soak that did not settle: the growth's sites, its
    class and evidence, and the flame graph or snapshot written to `out_dir`. A tracer that fails, or traffic that
    runs out of memory under it (`oom`), is recorded; the growth is then judged as the soak measured it.
    `deadline` (time.monotonic()): no round starts that would leave too little time to read the trace before it,
    so a long trace cannot cost the variant the result it already measured; cut before MIN_ROUNDS, it is a
    recorded failure."""
    import gc

    from pipelines.measure.phases import is_oom, run_round

    out_dir.mkdir(parents=True, exist_ok=True)
    first = soak.get("rounds_run", 0)
    in_rounds = [0.0]

    done_rounds = [0]

    def one_round(r: int) -> None:
        if deadline is not None and done_rounds[0]:  # this round, and reading all of them (~1/4 of a traced round each)
            per_round = in_rounds[0] / done_rounds[0]
            if time.monotonic() + per_round + 0.5 * per_round * (done_rounds[0] + 1) > deadline:
                raise TraceCut(f"memory.timeout_seconds: the trace stops after {done_rounds[0]} round(s)")
        started = time.perf_counter()
        run_round(model, p, max_len, vocab, device, r)
        if inject:
            inject.after_round(r, device)
        in_rounds[0] += time.perf_counter() - started
        done_rounds[0] += 1
        gc.collect()  # as the soak does before each reading: garbage in cycles is not growth

    started = time.perf_counter()
    failed = {"status": "failed", "class": "unbounded", "soak_growth_bytes_per_round": soak["growth_bytes_per_round"]}
    if device == "cuda" and "cudaMallocAsync" in " ".join(os.environ.get(k, "") for k in ALLOC_CONF_VARS):
        return {**failed, "error": "not traced: cudaMallocAsync records no allocation history "
                                   "(torch.cuda.memory._record_memory_history needs the caching allocator)"}
    try:
        traced = _trace_cuda if device == "cuda" else _trace_cpu
        found = traced(one_round, range(first, first + p.trace_rounds), out_dir)
    except Exception as err:  # noqa: BLE001 - a tracer that fails leaves the growth judged as it was measured
        if is_oom(err):
            return {**failed, "oom": f"traced round: {type(err).__name__}: {err}"[:300], "error": "out of memory"}
        log.warning("memory: tracing the growth failed", exc_info=True)
        return {**failed, "error": f"{type(err).__name__}: {err}"[:500]}
    series = found["series"]
    total = max(series[-1] - series[0], sum(size for size, _ in found["growth"])) if series else 0  # between round ends
    sites = top_sites(found["growth"], total)
    keys = [(s["frame"], s["native"]) for s in sites]
    thirds = [[third.get(k, 0) for k in keys] for third in found["per_third"]]
    cause = classify(series, thirds, sites, soak, p)
    tracer = ("torch.cuda.memory._record_memory_history" if device == "cuda"
              else "memray (native traces; heap allocations, not mmap)")
    cause.update({"status": "ok", "soak_growth_bytes_per_round": soak["growth_bytes_per_round"],
                  "traced_rounds": len(series), "tracer": tracer, "seconds": round(time.perf_counter() - started, 1),
                  "seconds_in_rounds": round(in_rounds[0], 2), "capture_bytes": found.get("capture_bytes"),
                  "cut_by_deadline": len(series) < p.trace_rounds,
                  "alive_bytes_by_round": series, "sites": sites,
                  "artifact": found["artifact"].name if found["artifact"] else None})
    log.info("memory: growth traced: %s; %s", cause["class"], cause["evidence"])
    return cause


def _round_in_time(one_round, r: int, done: int) -> bool:
    """Run round `r`; False when the deadline cut it and enough rounds ran to read, TraceCut when too few did."""
    try:
        one_round(r)
    except TraceCut:
        if done < MIN_ROUNDS:
            raise
        return False
    return True


def _thirds(n: int) -> list[range]:
    cut = [0, n // 3, 2 * n // 3, n]
    return [range(cut[i], cut[i + 1]) for i in range(3)]


def _per_third(n: int, values: list[int], key: tuple, per_third: list[dict]) -> None:
    """Add one site's growth in each third of the rounds (from the end of the round before the third)."""
    for third, span in zip(per_third, _thirds(n)):
        if span:
            third[key] = third.get(key, 0) + values[span[-1]] - values[max(0, span[0] - 1)]


def _trace_cpu(one_round, rounds: range, out_dir: Path) -> dict:
    """memray over the rounds: alive bytes per round end and per site, growth per site per third, the flame graph.
    The capture lives in a temporary folder (hundreds of MB on a large model), gone however this ends."""
    import tempfile

    import memray

    with tempfile.TemporaryDirectory(prefix="quantgate-memray-") as tmp:
        capture = Path(tmp) / "trace.bin"
        pauses = []
        with memray.Tracker(capture, native_traces=True, memory_interval_ms=SNAPSHOT_MS):
            for r in rounds:
                if not _round_in_time(one_round, r, len(pauses)):
                    break
                begin = time.time() * 1000
                time.sleep(PAUSE_S)  # a snapshot taken now sees this round's bytes, not the next round's
                pauses.append((begin, time.time() * 1000))
        reader = memray.FileReader(capture, max_memory_records=MEMORY_RECORDS)
        times = [snap.time for snap in reader.get_memory_snapshots()]
        marks = []
        for k, (begin, end) in enumerate(pauses):  # the last snapshot strictly inside the pause (ms resolution)
            inside = bisect.bisect_left(times, end - 1) - 1
            if inside < 0 or times[inside] <= begin + 1:
                raise RuntimeError(f"no memray snapshot fell inside the pause after traced round {k + 1} of "
                                   f"{len(pauses)}: its round ends cannot be told apart, so the trace is not read")
            marks.append(inside)
        n = len(marks)
        totals = [0] * n
        growth, per_third = [], [{} for _ in range(3)]
        for record in reader.get_temporal_allocation_records(merge_threads=True):
            if record.allocator == memray.AllocatorType.MMAP:  # pymalloc arenas, files: the soak's heap never saw them
                continue
            alive = [0] * (n + 1)
            for iv in record.intervals:  # alive at mark m: allocated before snapshot m, freed after it (or never)
                lo = bisect.bisect_left(marks, iv.allocated_before_snapshot)
                hi = n if iv.deallocated_before_snapshot is None else bisect.bisect_left(marks, iv.deallocated_before_snapshot)
                if lo < hi:
                    alive[lo] += iv.n_bytes
                    alive[hi] -= iv.n_bytes
            running, values = 0, []
            for k in range(n):
                running += alive[k]
                values.append(running)
                totals[k] += running
            if values and values[-1] > values[0]:
                site = site_of(record.hybrid_stack_trace())
                growth.append((values[-1] - values[0], site))
                _per_third(n, values, (site["frame"], site["native"]), per_third)
        html = out_dir / "flamegraph.html"
        try:  # for a person only: a flame graph that fails or takes too long costs the picture, not the result
            done = subprocess.run([sys.executable, "-m", "memray", "flamegraph", "--leaks", "--no-web", "--force",
                                   "--max-memory-records", str(MEMORY_RECORDS), "-o", str(html), str(capture)],
                                  capture_output=True, text=True, timeout=FLAMEGRAPH_S)
            if done.returncode != 0:
                log.warning("memory: memray flamegraph failed: %s", done.stderr[-500:])
        except subprocess.TimeoutExpired:
            log.warning("memory: memray flamegraph ran past %d s; the trace is kept without it", FLAMEGRAPH_S)
            html.unlink(missing_ok=True)
        return {"series": totals, "growth": growth, "per_third": per_third, "capture_bytes": capture.stat().st_size,
                "artifact": html if html.is_file() else None}


def cuda_alive_blocks(snapshot: dict) -> dict[tuple, tuple[int, list[tuple[str, str, int]]]]:
    """(address, size, stack) -> (size, frames innermost first) of every block a CUDA memory snapshot shows
    allocated under the history recording (blocks from before it carry no frames: the weights, the soak's own)."""
    out = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            frames = [(f.get("name", "?"), f.get("filename", "?"), int(f.get("line", 0))) for f in block.get("frames") or []]
            if block.get("state") == "active_allocated" and frames:
                out[(block["address"], block["size"], tuple(frames))] = (block["size"], frames)
    return out


def _trace_cuda(one_round, rounds: range, out_dir: Path) -> dict:
    """The CUDA caching allocator's history over the rounds: a snapshot per round end, the recorded blocks alive at
    each grouped by stack, the last snapshot for memory_viz. Not run on a GPU yet (docs/memory.md)."""
    import pickle

    import torch

    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        alive_by_round, series = [], []
        for r in rounds:
            if not _round_in_time(one_round, r, len(series)):
                break
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            alive = cuda_alive_blocks(snap)
            alive_by_round.append(alive)
            series.append(sum(size for size, _ in alive.values()))
        tmp = out_dir / "cuda_snapshot.pickle.tmp"
        with open(tmp, "wb") as fh:
            pickle.dump(snap, fh)
        os.replace(tmp, out_dir / "cuda_snapshot.pickle")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    n = len(alive_by_round)
    by_site: dict[tuple, list[int]] = {}
    sites: dict[tuple, dict] = {}
    for k, alive in enumerate(alive_by_round):
        for size, frames in alive.values():
            site = site_of(frames)
            key = (site["frame"], site["native"])
            sites.setdefault(key, site)
            by_site.setdefault(key, [0] * n)[k] += size
    growth, per_third = [], [{} for _ in range(3)]
    for key, values in by_site.items():
        if values[-1] > values[0]:
            growth.append((values[-1] - values[0], sites[key]))
            _per_third(n, values, key, per_third)
    return {"series": series, "growth": growth, "per_third": per_third, "artifact": out_dir / "cuda_snapshot.pickle"}
