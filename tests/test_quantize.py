"""Quantize the tests' tiny model with every method, reload each through the one loader, check the numbers."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from pipelines import quantize
from pipelines.core.params_sections import VariantParams
from pipelines.models.loading import ModelSource, VariantFailed, load_variant

PROMPT = "47+38=85\nCustomer: I want a refund for order 12345.\nAgent: I am sorry"


@pytest.fixture(scope="module")
def logits(tiny_variants, tmp_path_factory):
    """Each variant's logits on PROMPT, loaded as the stages load it; kept by content (tests/content_cache.py)."""
    from safetensors.torch import load_file, save_file

    from tests.content_cache import cached

    def build(folder):
        out = {}
        for name, path in tiny_variants.items():
            model, tok = load_variant(path)
            ids = tok(PROMPT, return_tensors="pt").input_ids
            with torch.no_grad():
                out[name] = model(ids).logits.float()[0].contiguous()
        save_file(out, folder / "logits.safetensors")
        return folder / "logits.safetensors"

    return load_file(cached(tmp_path_factory, "variant_logits", build, code=["models.loading"],
                            helpers=["tests/test_quantize.py"], inputs=[next(iter(tiny_variants.values())).parent]))


def relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


# Loose bounds on the relative logit error: the tiny model's one barely trained layer adds little to the logits
# (docs/quantize.md and docs/evaluate.md have reference-model numbers).
@pytest.mark.parametrize("variant, bound", [("int8", 0.01), ("awq4", 0.15), ("gptq3", 0.15)])
def test_logits_close_to_fp16_within_method_bounds(logits, variant, bound):
    err = relative_error(logits[variant], logits["fp16"])
    assert 0 < err < bound, f"{variant}: relative logit error {err:.4f}"


def test_fp16_variant_matches_the_base_model(tiny_model, logits):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = base(ids).logits[0]
    assert relative_error(logits["fp16"], ref) < 2e-3


def test_manifests_record_what_was_done(tiny_variants, tiny_calibration):
    calib_sha = json.loads((tiny_calibration / "manifest.json").read_text())["mixed_sha256"]
    weights = {}
    for name, path in tiny_variants.items():
        m = json.loads((path / "quantgate.json").read_text())
        assert m["status"] == "ok"
        if m["method"] in ("awq", "gptq"):  # the methods that read a calibration set record which one
            assert m["calibration"] == {"sha256": calib_sha, "samples": 32}
        else:
            assert "calibration" not in m
        assert m["libraries"]["torch"].startswith("2.13.0") and m["libraries"]["gptqmodel"] == "7.6.0"
        assert "quantize_seconds" not in m and "peak_memory_bytes" not in m  # volatile: the metrics file holds them
        # every file hashed, and the tokenizer travels with every checkpoint (autoawq saves none)
        assert set(m["files"]) == {p.name for p in path.iterdir()} - {"quantgate.json"}
        assert (path / "tokenizer.json").is_file()
        theory, disk = m["theoretical_weight_bytes"]["total"], m["disk_bytes"]["weights"]
        assert abs(disk - theory) / theory < 0.03, (name, disk, theory)
        weights[name] = disk
    assert weights["fp16"] > weights["int8"] > weights["awq4"] > weights["gptq3"]


def test_theoretical_bytes_by_hand(tiny_model):
    """One decoder layer of 64-wide hidden, 128-wide MLP, 2 KV heads of 32: count GPTQ-3 bytes by hand."""
    cfg = json.loads((tiny_model / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    packed = sum(n_in * n_out * 3 / 8 + (n_in // 64) * n_out * (2 + 3 / 8) + 4 * n_in for n_in, n_out in linears)
    rest = (2 * v * h + 3 * h) * 2  # embeddings, lm_head, 3 norms in fp16
    got = quantize.theoretical_weight_bytes(str(tiny_model), VariantParams(method="gptq", bits=3, group_size=64))
    assert got == {"quantized_layers": int(packed), "unquantized": rest, "total": int(packed + rest)}


def test_a_failing_quantizer_is_recorded_and_loader_refuses(tmp_path, tiny_model, tiny_calibration):
    bad = VariantParams(method="gptq", bits=3, group_size=48)  # 48 does not divide the 64-wide layers
    source = ModelSource("local", str(tiny_model))
    m, _ = quantize.quantize_variant("gptq3g48", bad, source, tiny_calibration, "cpu", tmp_path)
    assert m["status"] == "failed" and m["error"] and "cause" not in m  # the variant's own failure, not the machine's
    assert [p.name for p in (tmp_path / "gptq3g48").iterdir()] == ["quantgate.json"]
    with pytest.raises(VariantFailed, match="gptq3g48 is not usable"):
        load_variant(tmp_path / "gptq3g48")


def test_a_backend_this_machine_lacks_is_recorded_as_the_machines_failure(monkeypatch, tmp_path, tiny_model,
                                                                            tiny_calibration):
    """gptqmodel not importable: the manifest says so with the remedy (compare makes the rows `inconclusive`)."""
    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # `from gptqmodel import ...` now raises ImportError
    m, _ = quantize.quantize_variant("gptq3", VariantParams(method="gptq", bits=3, group_size=64),
                                     ModelSource("local", str(tiny_model)), tiny_calibration, "cpu", tmp_path)
    assert (m["status"], m["cause"]) == ("failed", "environment")
    assert m["reason"].startswith("gptqmodel cannot be imported here") and "quantgate doctor" in m["remedy"]


def test_missing_calibration_set_is_a_recorded_failure(tmp_path, tiny_model):
    m, timing = quantize.quantize_variant("gptq3", VariantParams(method="gptq", bits=3, group_size=64),
                                          ModelSource("local", str(tiny_model)), tmp_path / "nowhere", "cpu", tmp_path)
    assert m["status"] == "failed" and "by_method/gptq.jsonl: no calibration set for method 'gptq'" in m["error"]
    assert timing == {}


def test_methods_without_calibration_need_none_and_time_goes_to_metrics(tmp_path, tiny_model):
    m, timing = quantize.quantize_variant("int8", VariantParams(method="bnb-int8"), ModelSource("local", str(tiny_model)),
                                          tmp_path / "nowhere", "cpu", tmp_path)
    assert m["status"] == "ok" and "calibration" not in m
    assert timing["quantize_seconds"] > 0 and timing["peak_memory_bytes"]["peak_rss"] > 50 * 2**20
    again, _ = quantize.quantize_variant("int8", VariantParams(method="bnb-int8"), ModelSource("local", str(tiny_model)),
                                         tmp_path / "nowhere", "cpu", tmp_path / "again")
    assert again == m  # the same inputs give the same manifest: nothing downstream re-runs


def test_awq_rejects_bits_it_cannot_make():
    with pytest.raises(ValueError, match="method 'awq' takes bits 4, got 3"):
        VariantParams(method="awq", bits=3)


def test_awq_duo_scaling_is_passed_to_autoawq_as_set(monkeypatch, tmp_path, tiny_model, tiny_calibration):
    from awq.models.base import BaseAWQForCausalLM

    seen = []

    def record_and_stop(self, tokenizer=None, quant_config=None, **kwargs):
        seen.append(kwargs.get("duo_scaling", "autoawq's default"))
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(BaseAWQForCausalLM, "quantize", record_and_stop)
    for n, value in enumerate((False, True, None)):
        settings = VariantParams(method="awq", bits=4, group_size=32, duo_scaling=value)
        manifest, _ = quantize.quantize_variant(f"awq{n}", settings, ModelSource("local", str(tiny_model)),
                                                tiny_calibration, "cpu", tmp_path)
        assert "stopped by the test" in manifest["error"]
    assert seen == [False, True, "autoawq's default"]


def test_awq_duo_scaling_changes_the_weights(tmp_path, tiny_model, tiny_variants, tiny_calibration):
    """The default awq4 searches activation-only scales (duo_scaling: false); autoawq's own default gives other weights."""
    from safetensors.torch import load_file

    assert json.loads((tiny_variants["awq4"] / "quantgate.json").read_text())["settings"]["duo_scaling"] is False
    settings = VariantParams(method="awq", bits=4, group_size=32, duo_scaling=True)
    manifest, _ = quantize.quantize_variant("awq4", settings, ModelSource("local", str(tiny_model)), tiny_calibration,
                                            "cpu", tmp_path)
    assert manifest["status"] == "ok", manifest.get("error")
    ours, duo = load_file(tiny_variants["awq4"] / "model.safetensors"), load_file(tmp_path / "awq4" / "model.safetensors")
    assert ours.keys() == duo.keys()
    assert any(not torch.equal(ours[k], duo[k]) for k in ours if k.endswith("scales"))


def test_awq_clip_tokens_sizes_the_clipping_search(monkeypatch, tmp_path, tiny_model, tiny_calibration):
    """clip_tokens: 0 turns autoawq's clipping search off; N samples N tokens per layer in it (autoawq's own
    `_compute_best_clip`, through its `quantizer_cls` hook); null leaves autoawq's 512. Each gives a usable checkpoint."""
    from awq.quantize.quantizer import AwqQuantizer

    sampled = []
    original = AwqQuantizer._compute_best_clip

    def spy(self, w, input_feat, n_grid=20, max_shrink=0.5, n_sample_token=512):
        sampled.append(n_sample_token)
        return original(self, w, input_feat, n_grid, max_shrink, n_sample_token)

    monkeypatch.setattr(AwqQuantizer, "_compute_best_clip", spy)
    made = {}
    for tokens in (0, 16, None):
        sampled.clear()
        settings = VariantParams(method="awq", bits=4, group_size=32, clip_tokens=tokens)
        manifest, _ = quantize.quantize_variant(f"awq-{tokens}", settings, ModelSource("local", str(tiny_model)),
                                                tiny_calibration, "cpu", tmp_path)
        assert manifest["status"] == "ok", manifest.get("error")
        made[tokens] = sorted(set(sampled))
    assert made == {0: [], 16: [16], None: [512]}


def test_theory_counts_a_tied_embedding_once(tmp_path, tiny_model):
    """SmolLM2 ties lm_head to the embedding (one tensor, stored once): its theory is every unique parameter, as for an
    untied model every parameter. The theory used to subtract the tied head a second time (int8: 107 MB of theory
    against 220 MB measured on SmolLM2-135M)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for tied in (False, True):
        config = AutoConfig.from_pretrained(tiny_model)
        config.tie_word_embeddings = tied
        folder = tmp_path / f"tied-{tied}"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        model.save_pretrained(folder)  # what a checkpoint stores: a tied tensor once
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as fh:
            stored = sum(fh.get_tensor(k).numel() * 4 for k in fh.keys())
        unique = stored // 4
        theory = quantize.theoretical_weight_bytes(str(folder), VariantParams(method="none", dtype="float32"))
        assert theory["total"] == theory["unquantized"] == stored
        int8 = quantize.theoretical_weight_bytes(str(folder), VariantParams(method="bnb-int8", dtype="float32"))
        linear = sum(m.in_features * m.out_features for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n != "lm_head")
        assert int8["unquantized"] == 4 * (unique - linear)


def test_clip_tokens_belongs_to_autoawq():
    with pytest.raises(ValueError, match="clip_tokens applies to awq with backend autoawq"):
        VariantParams(method="gptq", bits=3, clip_tokens=64)
    with pytest.raises(ValueError, match="clip_tokens applies to awq with backend autoawq"):
        VariantParams(method="awq", bits=4, backend="gptqmodel", clip_tokens=64)
    with pytest.raises(ValueError):
        VariantParams(method="awq", bits=4, clip_tokens=-1)


def test_duo_scaling_belongs_to_autoawq():
    with pytest.raises(ValueError, match="duo_scaling applies to awq, not gptq"):
        VariantParams(method="gptq", bits=3, duo_scaling=False)
    with pytest.raises(ValueError, match="needs backend autoawq"):
        VariantParams(method="awq", bits=4, duo_scaling=False, backend="gptqmodel")


def test_gptq_on_a_cpu_runs_eager_and_builds_no_kernel(tiny_variants):
    """GPTQModel's CPU kernel would hand its dequantization to inductor, which builds C++ at the first forward (a
    compiler needed at run time, seconds of building in every loading process): the loader runs it eager."""
    from torch._dynamo.utils import counters

    model, tok = load_variant(tiny_variants["gptq3"])
    graphs = counters["stats"]["unique_graphs"]  # (the process's count: whatever ran before in this worker)
    with torch.no_grad():
        model(tok(PROMPT, return_tensors="pt").input_ids)
    assert torch._dynamo.config.disable and counters["stats"]["unique_graphs"] == graphs
