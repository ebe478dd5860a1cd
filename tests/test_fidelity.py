"""Fidelity statistics against a direct computation with torch, and fp16 against itself."""

from __future__ import annotations

import math

import pytest
import torch

from pipelines.evaluation import fidelity
from pipelines.models.loading import load_variant

TEXTS = {"math": ["47+38=85", "√49=7\n\\frac{3}{4}\\times 8=6"],
         "chat": ["Customer: Where is my order 12345?\nAgent: It ships tomorrow."]}


@pytest.fixture(scope="module")
def models(tiny_variants):
    return {v: load_variant(tiny_variants[v]) for v in ("fp16", "gptq3")}


def test_fp16_against_itself_is_identical(models, tmp_path):
    model, tok = models["fp16"]
    path = tmp_path / "base.safetensors"
    fidelity.save_base(fidelity.base_record(model, tok, TEXTS, top_k=16), path)
    report = fidelity.compare(model, fidelity.load_base(path), list(TEXTS))
    for row in report.values():
        assert row["kl"]["max"] == pytest.approx(0, abs=1e-3) and row["same_top1"] == 1.0
        assert row["rms_delta_p"] == pytest.approx(0, abs=1e-3) and row["ppl_ratio"] == pytest.approx(1, abs=1e-3)


def test_statistics_match_a_direct_torch_computation(models):
    (base_model, tok), (q_model, _) = models["fp16"], models["gptq3"]
    vocab = base_model.config.vocab_size
    base = fidelity.base_record(base_model, tok, {"math": TEXTS["math"]}, top_k=vocab)  # exact KL
    report = fidelity.compare(q_model, base, ["math"])["math"]

    kls, same, dps, nll_p, nll_q = [], [], [], [], []
    with torch.no_grad():
        for text in TEXTS["math"]:
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            p = torch.log_softmax(base_model(ids).logits[0, :-1].float(), -1)
            q = torch.log_softmax(q_model(ids).logits[0, :-1].float(), -1)
            kls.append(torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1))
            same.append((p.argmax(-1) == q.argmax(-1)).float())
            tgt = ids[0, 1:]
            pc, qc = p[torch.arange(len(tgt)), tgt], q[torch.arange(len(tgt)), tgt]
            dps.append(qc.exp() - pc.exp())
            nll_p.append(-pc)
            nll_q.append(-qc)
    kl = torch.cat(kls)
    assert report["tokens"] == len(kl)
    assert report["kl"]["mean"] == pytest.approx(kl.mean().item(), rel=0.02, abs=1e-4)
    assert report["kl"]["max"] == pytest.approx(kl.max().item(), rel=0.02, abs=1e-4)
    assert report["kl"]["stderr"] == pytest.approx((kl.std() / math.sqrt(len(kl))).item(), rel=0.05, abs=1e-4)
    assert report["same_top1"] == pytest.approx(torch.cat(same).mean().item())
    assert report["rms_delta_p"] == pytest.approx(torch.cat(dps).pow(2).mean().sqrt().item(), rel=0.01, abs=1e-4)
    ratio = math.exp(torch.cat(nll_q).mean().item() - torch.cat(nll_p).mean().item())
    assert report["ppl_ratio"] == pytest.approx(ratio, rel=1e-3)
    assert report["kl"]["mean"] > 0


def test_top_k_kl_is_a_lower_bound_of_the_exact_kl(models):
    (base_model, tok), (q_model, _) = models["fp16"], models["gptq3"]
    exact = fidelity.compare(q_model, fidelity.base_record(base_model, tok, TEXTS, top_k=10**6), ["chat"])["chat"]
    top8 = fidelity.compare(q_model, fidelity.base_record(base_model, tok, TEXTS, top_k=8), ["chat"])["chat"]
    assert top8["kl"]["mean"] <= exact["kl"]["mean"] + 1e-6


def test_the_baselines_own_rows_are_what_a_second_forward_pass_gives(models, tmp_path):
    """The baseline scores itself from the pass that makes the base file (harness): the same rows, bit for bit, as
    `compare` of the same model against the saved file, which runs the model again."""
    model, tok = models["fp16"]
    path = tmp_path / "base.safetensors"
    own: dict = {}
    fidelity.save_base(fidelity.base_record(model, tok, TEXTS, top_k=16, own_rows=own), path)
    base = fidelity.load_base(path)
    assert fidelity.report(own, base) == fidelity.compare(model, base, list(TEXTS))
    assert [r["text"] for r in own["math"]] == [0, 1] and own["math"][1]["tokens"] > 0
