"""fp16 and int8 across several GPUs, tested without a GPU: the decision (device_map_for), the budget
(gpu_budget), and the placement on the meta device (plan_placement: accelerate's infer_auto_device_map with a
fake max_memory for 2-4 GPUs). No test here loads weights on a GPU; a real multi-GPU run is
scripts/gpu_memory_check.sh's (docs/memory.md says what has and has not run)."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import init_empty_weights
from accelerate.utils import compute_module_sizes
from transformers import AutoModelForCausalLM, LlamaConfig

from pipelines.core.errors import QuantgateError
from pipelines.core.params import load_params
from pipelines.core.params_gpus import GpusParams
from pipelines.models import loading as models

GiB = 2**30
CONFIG = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def meta():
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float16)
    return model, compute_module_sizes(model, dtype=torch.float16)


# ---- the decision --------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "bnb-int8"])
def test_one_gpu_without_a_budget_loads_as_before(method):
    assert models.device_map_for(method, "cuda", 1, None) == ("cuda", None)


@pytest.mark.parametrize("method", ["none", "bnb-int8"])
@pytest.mark.parametrize("n_gpus", [2, 3, 4])
def test_fp16_and_int8_spread_over_several_gpus(method, n_gpus):
    assert models.device_map_for(method, "cuda", n_gpus, None) == ("sequential", None)
    budget = {i: 40 * GiB for i in range(n_gpus)}
    assert models.device_map_for(method, "cuda", n_gpus, budget) == ("sequential", budget)


def test_a_budget_on_one_gpu_caps_it():
    assert models.device_map_for("none", "cuda", 1, {0: 10 * GiB}) == ("sequential", {0: 10 * GiB})


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_keep_their_backends_placement(method):
    assert models.device_map_for(method, "cuda", 4, {0: GiB, 1: GiB}) == ("cuda", None)


def test_the_cpu_ignores_gpus():
    assert models.device_map_for("none", "cpu", 0, {0: GiB}) == ("cpu", None)


# ---- the budget ------------------------------------------------------------------------------

def test_budget_from_params():
    totals = [80 * GiB, 80 * GiB, 40 * GiB]
    assert models.gpu_budget(None, totals) is None
    assert models.gpu_budget(GpusParams(max_memory="70GiB").shares(), totals) == {0: 70 * GiB, 1: 70 * GiB, 2: 70 * GiB}
    assert models.gpu_budget(GpusParams(max_memory=0.5).shares(), totals) == {0: 40 * GiB, 1: 40 * GiB, 2: 20 * GiB}
    assert models.gpu_budget(GpusParams(max_memory={0: "10GiB", 2: 0.25}).shares(), totals) == {0: 10 * GiB,
                                                                                                  2: 10 * GiB}
    with pytest.raises(QuantgateError, match="names GPU 3, but torch sees 3 GPU"):
        models.gpu_budget(GpusParams(max_memory={3: "1GiB"}).shares(), totals)


def test_gpus_params_are_checked(tmp_path):
    def load(text):
        path = tmp_path / "params.yaml"
        path.write_text(text)
        return load_params(path)

    assert load("model: reference\n").gpus.max_memory is None
    assert load("gpus: {max_memory: {0: 70GiB, 1: 70GiB}}\n").gpus.shares() == {0: 70 * GiB, 1: 70 * GiB}
    with pytest.raises(QuantgateError, match=r"params.yaml:1: unknown key 'gpus.max_mem'"):
        load("gpus: {max_mem: 70GiB}\n")
    with pytest.raises(QuantgateError, match="gpus.max_memory.*'70 gigs'"):
        load("gpus: {max_memory: {0: 70 gigs}}\n")
    with pytest.raises(QuantgateError, match=r"fraction .* must be in \(0, 1\]"):
        load("gpus: {max_memory: 1.5}\n")


# ---- the placement, on the meta device ---------------------------------------------------------

def _layer_order(model, device_map):
    """Each module's GPU, in the model's own module order."""
    order = [name for name, _ in model.named_modules()]
    return [device_map[name] for name in sorted(device_map, key=order.index)]


@pytest.mark.parametrize("n_gpus", [2, 3, 4])
def test_a_model_too_big_for_one_gpu_is_split_in_layer_order(meta, n_gpus):
    model, sizes = meta
    total = sizes[""]
    share = int(total * 1.3 / n_gpus) + sizes["model.layers.0"]  # no one GPU holds it; together they do
    budget = {i: share for i in range(n_gpus)}
    device_map = models.plan_placement(model, budget, torch.float16)
    gpus = _layer_order(model, device_map)
    assert gpus == sorted(gpus), "GPUs must follow layer order"
    assert len(set(gpus)) > 1 and all(isinstance(g, int) and 0 <= g < n_gpus for g in gpus)
    assert gpus[0] == 0
    assert not any(k.startswith("model.layers.0.") for k in device_map), "decoder layers stay whole"
    for gpu in set(gpus):
        assert sum(sizes[m] for m, g in device_map.items() if g == gpu) <= share


def test_a_model_that_fits_one_gpu_stays_on_gpu_0(meta):
    model, sizes = meta
    for n_gpus in (2, 4):
        device_map = models.plan_placement(model, {i: 10 * sizes[""] for i in range(n_gpus)}, torch.float16)
        assert set(device_map.values()) == {0}


def test_an_impossible_budget_names_the_budget_and_the_size(meta):
    model, sizes = meta
    with pytest.raises(QuantgateError) as err:
        models.plan_placement(model, {0: sizes[""] // 4, 1: sizes[""] // 4}, torch.float16)
    text = str(err.value)
    assert f"{sizes['']} bytes" in text and "gpus.max_memory allows" in text and "cuda:0" in text and "cuda:1" in text


def test_a_layer_bigger_than_any_share_is_refused_even_when_the_total_fits(meta):
    model, sizes = meta
    share = sizes["model.layers.0"] // 2  # the total fits over enough GPUs, but no GPU holds one layer
    n = sizes[""] // share + 2
    with pytest.raises(QuantgateError, match="layer by layer"):
        models.plan_placement(model, {i: share for i in range(n)}, torch.float16)


# ---- load_variant's decisions on a checkpoint folder, transformers' loader replaced ----------------

@pytest.fixture
def variant(tmp_path):
    def make(method):
        folder = tmp_path / method
        CONFIG.save_pretrained(folder)
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)
        (folder / "quantgate.json").write_text(json.dumps({"status": "ok", "method": method, "dtype": "float16",
                                                           "variant": method}))
        return folder
    return make


@pytest.fixture
def fake_gpus(monkeypatch):
    """n GPUs of 80 GiB for load_variant, and a from_pretrained that records what it was asked."""
    calls = []

    class Loaded:
        def eval(self):
            return self

        def save_pretrained(self, out):
            pass

    def fake_load(location, **kwargs):
        calls.append(kwargs)
        return Loaded()

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", fake_load)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)

    def set_gpus(n):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(models, "gpu_totals", lambda: [80 * GiB] * n)
        monkeypatch.setattr(models, "free_gpu_memory", lambda: {i: 79 * GiB for i in range(n)})
        return calls
    return set_gpus


def test_load_variant_on_one_gpu_is_unchanged(variant, fake_gpus):
    calls = fake_gpus(1)
    models.load_variant(variant("none"), "cuda")
    models.load_variant(variant("bnb-int8"), "cuda")
    assert calls == [{"dtype": torch.float16, "device_map": "cuda"}, {"device_map": "cuda"}]


def test_load_variant_spreads_fp16_with_the_meta_plan_and_int8_with_the_budget(variant, fake_gpus):
    calls = fake_gpus(2)
    models.load_variant(variant("none"), "cuda", GpusParams(max_memory="70GiB").shares())
    assert calls[0]["dtype"] == torch.float16 and set(calls[0]["device_map"].values()) == {0}  # fits GPU 0
    models.load_variant(variant("bnb-int8"), "cuda", GpusParams(max_memory="70GiB").shares())
    assert calls[1] == {"device_map": "sequential", "max_memory": {0: 70 * GiB, 1: 70 * GiB}}
    models.load_variant(variant("bnb-int8"), "cuda")  # no budget: accelerate's own figure
    assert calls[2] == {"device_map": "sequential", "max_memory": None}


def test_load_variant_refuses_an_impossible_budget_before_loading(variant, fake_gpus):
    calls = fake_gpus(2)
    with pytest.raises(QuantgateError, match=r"variant bnb-int8 needs .*4096 bytes.* allows .*cuda:0.*cuda:1"):
        models.load_variant(variant("bnb-int8"), "cuda", {0: 1000, 1: 1000})
    assert calls == []


def test_int8_quantize_loads_the_base_model_across_gpus(fake_gpus, tmp_path):
    from pipelines import quantize
    from pipelines.core.params_sections import VariantParams
    from pipelines.models.loading import ModelSource

    calls = fake_gpus(2)
    job = quantize.Job(ModelSource("local", str(tmp_path)), VariantParams(method="bnb-int8"), [], "cuda", 8,
                       GpusParams(max_memory="10GiB").shares())
    quantize._bnb_int8(job, tmp_path)
    assert calls[0]["device_map"] == "sequential" and calls[0]["max_memory"] == {0: 10 * GiB, 1: 10 * GiB}
    fake_gpus(1)
    quantize._bnb_int8(quantize.Job(ModelSource("local", str(tmp_path)), VariantParams(method="bnb-int8"), [],
                                    "cuda", 8), tmp_path)
    assert calls[1]["device_map"] == "cuda" and "max_memory" not in calls[1]  # one GPU: as before
