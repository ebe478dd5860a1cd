"""Why memory grows (pipelines/measure/attribution.py): known growth traced to its site, a cache told from a leak.

The soaks run on the tests' tiny model in the memory stage's own isolated process, with memray tracing for real;
the classification rules are also checked on series whose answer is known.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipelines import memory
from pipelines.core.params_sections import MemoryParams
from pipelines.gate import render_report
from pipelines.measure import attribution, phases, probes, verdict

LEAK = 64 << 10
FAST = MemoryParams(seq_fractions=[0.5, 1.0], warmup_rounds=1, rounds=10, max_rounds=12, tail_rounds=6,
                    alternations=2, burst_size=2, trace_rounds=9)


@pytest.fixture(scope="module")
def traced(tiny_variants, tmp_path_factory):
    """The soaks below, each with its tracer's folder, measured once for the content they depend on
    (tests/content_cache.py): fp16 clean, int8 leaking, and int8 growing until two traced rounds in (a cache)."""
    from tests.content_cache import cached

    def build(folder) -> dict:
        out = {}
        for name, variant, leak, rounds in (("clean", "fp16", 0, None), ("leaking", "int8", LEAK, None),
                                            ("cache", "int8", LEAK, FAST.max_rounds + 2)):
            (folder / name).mkdir()
            out[name] = (memory.measure_isolated(str(tiny_variants[variant]), FAST, "cpu", leak_bytes_per_round=leak,
                                                 leak_rounds=rounds, trace_dir=str(folder / name)), folder / name)
        return out

    return cached(tmp_path_factory, "memory_traces", build, code=["memory"], helpers=["tests/test_memory_attribution.py"],
                  inputs=[next(iter(tiny_variants.values())).parent], settings=[FAST.model_dump(), LEAK])


@pytest.fixture(scope="module")
def clean(traced):
    return traced["clean"]


@pytest.fixture(scope="module")
def leaking(traced):
    return traced["leaking"]


def test_a_clean_soak_pays_nothing(clean):
    r, out = clean
    assert r["status"] == "ok" and r["soak"]["growth_bytes_per_round"] == 0
    assert r["leak"]["leak"] is False
    # no tracer ran (nothing written); at most the heap's own fragmentation is named, which costs nothing
    assert r["growth_cause"] is None or r["growth_cause"]["class"] == "fragmentation"
    assert not list(out.iterdir())


def test_the_injected_leak_is_traced_to_the_injecting_function(leaking):
    r, out = leaking
    cause = r["growth_cause"]
    assert cause["status"] == "ok" and cause["class"] == "leak", cause
    top = cause["sites"][0]
    assert top["frame"].startswith("after_round (pipelines/measure/phases.py:") and top["library"] == "quantgate"
    assert top["share"] > 0.6 and "ones" in " ".join(top["stack"])  # torch.ones, through c10's CPU allocator
    assert cause["traced_rounds"] == FAST.trace_rounds
    per_round = cause["alive_bytes_by_round"][-1] / FAST.trace_rounds
    assert LEAK <= per_round <= 1.5 * LEAK  # the injected bytes, plus what the Python allocators keep meanwhile
    assert r["leak"]["leak"] is True and "; leak: still growing" in r["leak"]["reason"]
    html = (out / "flamegraph.html").read_text()
    assert "after_round" in html and cause["artifact"] == "flamegraph.html"
    assert sorted(p.name for p in out.iterdir()) == ["flamegraph.html"]  # the capture lived in a temporary folder
    assert "cdn.jsdelivr" not in html  # --no-web: it opens without the internet
    assert cause["capture_bytes"] > 0
    line = verdict.describe("int8", cause)
    assert line.startswith("int8 grows 0.0") and "a leak:" in line and "after_round" in line


def test_growth_that_stops_under_the_tracer_is_a_bounded_cache(traced, clean):
    """Grows through the whole soak (so it is traced), stops two traced rounds later: a cache whose final size is
    what was injected, judged as growth against fp16 and not as a leak."""
    r = traced["cache"][0]
    cause = r["growth_cause"]
    assert cause["class"] == "cache", cause
    assert cause["stopped_at_traced_round"] <= 3
    injected = (FAST.max_rounds + 2) * LEAK  # an upper bound: state the first traced round replaced counts too
    assert injected - 2 * LEAK <= cause["size_bytes"] <= injected + 4 * LEAK
    assert cause["sites"][0]["frame"].startswith("after_round (") and cause["sites"][0]["share"] > 0.6
    assert r["leak"]["leak"] is False and r["leak"]["class"] == "cache"
    summary = verdict.summarize({"fp16": clean[0], "int8": r}, FAST)
    row = summary["variants"]["int8"]
    assert row["growth_class"] == "cache" and "a bounded cache of" in row["growth_cause"]
    assert row["growth_excess_pct"] == pytest.approx(100 * cause["size_bytes"] / clean[0]["load"]["footprint_bytes"])


@pytest.fixture(scope="module")
def hooked(tiny_variants, tmp_path_factory):
    """int8 in this process with a forward hook that keeps a copy of every output, soaked and traced; kept by content
    (tests/content_cache.py) as the soaks above are."""
    from pipelines.models.loading import load_variant
    from tests.content_cache import cached

    def build(folder) -> dict:
        model, _ = load_variant(str(tiny_variants["int8"]), "cpu")
        kept = []

        def keep_output(_module, _inputs, output):
            kept.append(output.detach().clone())

        model.model.layers[0].mlp.register_forward_hook(keep_output)
        probe = probes.make_probe("cpu")
        context = min(model.config.max_position_embeddings, 128)
        try:
            soaked = phases.soak(model, probe, FAST, context, model.config.vocab_size, "cpu")
            cause = attribution.explain(model, FAST, context, model.config.vocab_size, "cpu", soaked, folder) \
                if soaked["growth_bytes_per_round"] > 0 else None
        finally:
            probe.close()
        return {"growth_bytes_per_round": soaked["growth_bytes_per_round"], "cause": cause}

    return cached(tmp_path_factory, "memory_hooked", build, code=["memory"], helpers=["tests/test_memory_attribution.py"],
                  inputs=[next(iter(tiny_variants.values())).parent], settings=FAST.model_dump())


def test_native_growth_inside_the_forward_is_traced_to_its_caller(hooked):
    """On this CPU int8 does not grow; a forward hook that keeps a copy of every output stands in for a kernel whose
    workspace cache grows: the top site is the hook, the native caller torch's clone."""
    assert hooked["growth_bytes_per_round"] > 0
    cause = hooked["cause"]
    assert cause["class"] == "leak", cause
    top = cause["sites"][0]
    assert top["frame"].startswith("keep_output (") and top["library"] == "test_memory_attribution.py"
    assert "clone" in " ".join(top["stack"]).lower()


def test_classification_rules_on_known_series():
    p = FAST
    site = {"frame": "f (x.py:1)", "native": None, "library": "x", "share": 0.9, "stack": []}
    soak = {"growth_last_minus_first": 100_000, "growth_bytes_per_round": 10_000.0}
    grows = [10_000 * i for i in range(9)]
    assert attribution.classify(grows, [[30_000], [30_000], [20_000]], [site], soak, p)["class"] == "leak"
    stops = [0, 10_000, 20_000] + [20_000] * 6
    cache = attribution.classify(stops, [[20_000], [0], [0]], [site], soak, p)
    assert cache["class"] == "cache" and cache["size_bytes"] == 120_000 and cache["stopped_at_traced_round"] == 2
    # the soak grew 10 KB a round, the tracer saw nothing grow (an allocator it does not hook): no evidence of a stop
    blind = attribution.classify([5_000] * 9, [[0], [0], [0]], [site], soak, p)
    assert blind["class"] == "unbounded" and "grew only 0 B" in blind["evidence"]
    # one spike (a mark that caught a round's temporaries) is not growth the tracer saw
    spike = attribution.classify([5_000, 5_000, 2_000_000] + [5_000] * 6, [[0], [0], [0]], [site], soak, p)
    assert spike["class"] == "unbounded"
    # it grew under the tracer, but far slower than the soak measured: not evidence enough that it stopped
    slow = attribution.classify([0, 1_000, 2_000] + [2_000] * 6, [[2_000], [0], [0]], [site], soak, p)
    assert slow["class"] == "unbounded"
    # grows, but the top site did not grow in the last third: not called a leak at that site
    assert attribution.classify(grows, [[30_000], [30_000], [0]], [site], soak, p)["class"] == "unbounded"
    spread = {**site, "share": 0.3}
    assert attribution.classify(grows, [[1], [1], [1]], [spread], soak, p)["class"] == "unbounded"


def test_fragmentation_is_reserved_growth_while_in_use_settles():
    flat = [{"allocated": 1_000_000, "reserved": 2_000_000 + 50_000 * i, "process": 0} for i in range(12)]
    soak = {"signal": "allocated", "growth_bytes_per_round": 0.0, "rounds": flat, "warmup_end_round": 0,
            "fragmentation": {"one_minus_allocated_over_reserved": 0.6}}
    frag = attribution.fragmentation(soak, 1_000_000, FAST, "cpu")
    assert frag["class"] == "fragmentation" and frag["reserved_growth_bytes_per_round"] == pytest.approx(50_000)
    assert frag["reserved_growth_pct_of_footprint"] == pytest.approx(50.0)  # 50 KB x 10 rounds of 1 MB
    still = [{**s, "reserved": 2_000_000} for s in flat]
    assert attribution.fragmentation({**soak, "rounds": still}, 1_000_000, FAST, "cpu") is None
    assert attribution.fragmentation({**soak, "growth_bytes_per_round": 10.0}, 1_000_000, FAST, "cpu") is None
    assert attribution.fragmentation(soak, 10**9, FAST, "cpu") is None  # 0.05 % of a large footprint: under tolerance
    judged = {**soak, "rounds": flat, "tail_rounds": 6}
    # on a CPU the heap's arena is reported only; on CUDA a reserve that keeps growing is judged as growth
    assert verdict.leak_verdict(judged, 1_000_000, FAST, frag)["leak"] is False
    cuda = attribution.fragmentation(soak, 1_000_000, FAST, "cuda")
    on_cuda = verdict.leak_verdict(judged, 1_000_000, FAST, cuda)
    assert on_cuda["leak"] is True and on_cuda["class"] == "fragmentation" and "reserve" in on_cuda["reason"]


def test_cuda_snapshot_blocks_and_sites():
    """The shape torch.cuda.memory._snapshot() returns: allocated blocks with their recorded frames."""
    snap = {"segments": [{"blocks": [
        {"address": 1, "size": 512, "state": "active_allocated",
         "frames": [{"name": "after_round", "filename": "/x/pipelines/measure/phases.py", "line": 121}]},
        {"address": 2, "size": 1024, "state": "inactive", "frames": []}]}]}
    snap["segments"][0]["blocks"].append({"address": 3, "size": 4096, "state": "active_allocated", "frames": []})
    blocks = attribution.cuda_alive_blocks(snap)  # the inactive block and the one from before the recording: out
    assert [k[:2] for k in blocks] == [(1, 512)]
    size, frames = next(iter(blocks.values()))
    site = attribution.site_of(frames)
    assert site["frame"] == "after_round (/x/pipelines/measure/phases.py:121)" and site["native"] is None


def test_library_names():
    assert attribution.library_of("/v/lib/python3.11/site-packages/bitsandbytes/functional.py") == "bitsandbytes"
    assert attribution.library_of(f"{attribution.PROJECT_ROOT}/pipelines/measure/phases.py") == "quantgate"
    assert attribution.library_of("/usr/lib/python3.11/threading.py") == "python"


def test_allocator_settings_are_cuda_only_and_restored(monkeypatch, tmp_path):
    for name in attribution.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    with memory.cuda_allocator("expandable_segments:True") as setting:
        assert setting == "expandable_segments:True"
        assert all(os.environ[name] == setting for name in attribution.ALLOC_CONF_VARS)  # both names PyTorch reads
    assert not any(name in os.environ for name in attribution.ALLOC_CONF_VARS)
    with memory.cuda_allocator(None) as setting:
        assert setting == "default"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    with memory.cuda_allocator(None) as setting:
        assert setting == "backend:cudaMallocAsync"  # the environment's own, whichever name it came under
        cause = attribution.explain(torch.nn.Identity(), FAST, 8, 10, "cuda", {"growth_bytes_per_round": 5.0}, tmp_path)
    assert cause["status"] == "failed" and "cudaMallocAsync records no allocation history" in cause["error"]
    skipped = memory.compare_allocators("unused", FAST, "cpu", {}, None)
    assert list(skipped) == ["skipped"] and "CUDA caching allocator only" in skipped["skipped"]


def test_report_names_the_growth(leaking):
    line = verdict.describe("int8", leaking[0]["growth_cause"])
    result = {"verdict": "fail", "gated": ["int8"], "reasons": ["int8: memory leaks"], "results_digest": "x"}
    report = {"variants": {"int8": {"domains": {}, "memory": {"growth_cause": line}}}}
    text = render_report(result, report, None)
    assert "### Memory growth" in text and f"- {line}" in text


def test_a_tracer_that_fails_is_recorded_and_the_growth_judged_as_measured(monkeypatch, tmp_path):
    def broken(*_args):
        raise RuntimeError("no tracer here")

    monkeypatch.setattr(attribution, "_trace_cpu", broken)
    soak = {"rounds_run": 3, "growth_bytes_per_round": 5000.0}
    cause = attribution.explain(torch.nn.Identity(), FAST, 8, 10, "cpu", soak, tmp_path)
    assert cause["status"] == "failed" and cause["class"] == "unbounded" and "no tracer here" in cause["error"]
    assert "cause not traced" in verdict.describe("int8", cause)
    judged = verdict.leak_verdict({"growth_bytes_per_round": 5000.0, "rounds": [{}] * 12, "tail_rounds": 6,
                                   "warmup_end_round": None}, 100_000, FAST, cause)
    assert judged["leak"] is True  # 5000 x 10 rounds = 50 % of the footprint, as without a tracer

    def out_of_memory(*_args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(attribution, "_trace_cpu", out_of_memory)
    cause = attribution.explain(torch.nn.Identity(), FAST, 8, 10, "cpu", soak, tmp_path)
    assert cause["oom"].startswith("traced round: RuntimeError: DefaultCPUAllocator")  # the stage puts it in soak.oom


def test_a_cache_in_fp16_is_not_subtracted_from_the_variants_growth(leaking, clean):
    """fp16's cache size is no lower bound of what fp16 grows: subtracting it could hide a variant's leak."""
    base = {**clean[0], "leak": {"class": "cache", "projected_growth_bytes": 10**9, "leak": False}}
    summary = verdict.summarize({"fp16": base, "int8": leaking[0]}, FAST)
    expected = 100 * leaking[0]["soak"]["growth_bytes_per_round"] * FAST.rounds / clean[0]["load"]["footprint_bytes"]
    assert summary["variants"]["int8"]["growth_excess_pct"] == pytest.approx(expected)


def test_the_trace_folder_always_has_its_index(tmp_path):
    (tmp_path / "flamegraph.html").write_text("<html>")
    (tmp_path / "stray.tmp").write_text("")
    memory.write_trace_index(tmp_path, {"variant": "int8", "growth_cause": {"tracer": "memray", "class": "leak"}})
    index = json.loads((tmp_path / attribution.TRACES_INDEX).read_text())
    assert index == {"variant": "int8", "traced": True, "class": "leak", "artifacts": ["flamegraph.html"]}
    (tmp_path / "flamegraph.html").unlink()
    memory.write_trace_index(tmp_path, {})
    assert json.loads((tmp_path / attribution.TRACES_INDEX).read_text())["traced"] is False


def test_a_leak_the_tracer_confirmed_fails_under_the_tolerance():
    """The tolerance is for growth no site explains; one site growing in every third is a leak at any rate."""
    soak = {"growth_bytes_per_round": 1000.0, "rounds": [{}] * 12, "tail_rounds": 6, "warmup_end_round": None}
    confirmed = {"status": "ok", "class": "leak", "evidence": "grew in every third"}
    judged = verdict.leak_verdict(soak, 10**9, FAST, confirmed)
    assert judged["leak"] is True and "the tracer confirmed" in judged["reason"]
    assert verdict.leak_verdict(soak, 10**9, FAST, {**confirmed, "class": "unbounded"})["leak"] is False
    assert verdict.leak_verdict(soak, 10**9, FAST)["leak"] is False  # 0.001 %: under the 1 % tolerance


def test_a_trace_that_would_run_past_the_deadline_is_cut_and_recorded(tiny_variants, tmp_path):
    """Too few rounds before memory.timeout_seconds: a recorded failure, the soak's own result kept."""
    import time

    from pipelines.models.loading import load_variant

    model, _ = load_variant(str(tiny_variants["int8"]), "cpu")
    soak = {"rounds_run": 5, "growth_bytes_per_round": 5000.0, "growth_last_minus_first": 50_000}
    cause = attribution.explain(model, FAST, min(model.config.max_position_embeddings, 128), model.config.vocab_size,
                                "cpu", soak, tmp_path, deadline=time.monotonic())
    assert cause["status"] == "failed" and cause["error"].startswith("TraceCut: memory.timeout_seconds")
