"""The evaluate stage on the tests' tiny model: item counts, stable ids, code isolation, bad input."""

from __future__ import annotations

import pytest

from pipelines import evaluate, fidelity, sandbox
from pipelines.models import load_variant

LIMIT = 8


@pytest.fixture(scope="module")
def base_path(tmp_path_factory, tiny_variants):
    model, tok = load_variant(tiny_variants["fp16"])
    path = tmp_path_factory.mktemp("fid") / "base.safetensors"
    fidelity.save_base(fidelity.base_record(model, tok, evaluate.fidelity_texts(list(evaluate.PROBES), 4), 16), path)
    return path


@pytest.fixture(scope="module")
def evaluated(tiny_variants, base_path):
    return {v: evaluate.evaluate_variant(str(tiny_variants[v]), base_path, list(evaluate.PROBES), 8, "cpu", LIMIT)
            for v in ("fp16", "gptq3")}


def test_every_domain_scored_on_every_item(evaluated):
    for result, items in evaluated.values():
        assert result["status"] == "ok", result.get("error")
        counts = {d: r["items"] for d, r in result["probes"].items()}
        assert counts == {"math": LIMIT, "code": LIMIT if sandbox.isolation_available() else 0, "chat": LIMIT,
                          "code_comment": LIMIT}
        for row in result["probes"].values():
            assert row["status"] != "ok" or 0.0 <= row["score"] <= 1.0
        assert len(items) == sum(counts.values())


def test_items_pair_across_variants_by_stable_id(evaluated):
    keys = {v: [(i["task"], i["item_id"], i["doc_hash"], i["prompt_hash"]) for i in items]
            for v, (_, items) in evaluated.items()}
    assert keys["fp16"] == keys["gptq3"]
    assert len({k[1] for k in keys["fp16"]}) == len(keys["fp16"])


@pytest.mark.skipif(not sandbox.isolation_available(), reason="needs the isolated sandbox")
def test_code_probes_run_in_the_isolated_sandbox(evaluated):
    result, items = evaluated["fp16"]
    assert result["probes"]["code"]["isolation"] == sandbox.FULL
    assert all(isinstance(i["correct"], bool) for i in items if i["domain"] == "code")


def test_fp16_fidelity_against_its_own_base_is_exact(evaluated):
    result, _ = evaluated["fp16"]
    assert all(f["kl"]["max"] < 1e-4 and f["same_top1"] == 1.0 for f in result["fidelity"].values())


def test_code_probes_refused_without_isolation(monkeypatch, tiny_variants, base_path):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    result, items = evaluate.evaluate_variant(str(tiny_variants["fp16"]), base_path, ["code", "math"], 8, "cpu", 2)
    assert result["probes"]["code"]["status"] == "refused" and "allow_unisolated_code" in result["probes"]["code"]["reason"]
    assert result["probes"]["math"]["items"] == 2 and not [i for i in items if i["domain"] == "code"]


def test_failed_variant_is_recorded(tmp_path, base_path):
    (tmp_path / "awq4").mkdir()
    (tmp_path / "awq4" / "quantgate.json").write_text('{"variant": "awq4", "status": "failed", "error": "boom"}')
    result, items = evaluate.evaluate_variant(str(tmp_path / "awq4"), base_path, ["math"], 8, "cpu", 2)
    assert result["status"] == "failed" and "awq4 is not usable: boom" in result["error"] and items == []


def test_item_without_target_is_a_clear_recorded_failure(tmp_path, monkeypatch, tiny_variants, base_path):
    import shutil

    eval_copy = tmp_path / "eval"
    shutil.copytree("eval", eval_copy)
    lines = (eval_copy / "math" / "items.jsonl").read_text().splitlines()
    lines[16] = lines[16].replace('"answer": ', '"answer_typo": ')
    (eval_copy / "math" / "items.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(evaluate, "EVAL_DIR", eval_copy)
    result, _ = evaluate.evaluate_variant(str(tiny_variants["fp16"]), base_path, ["math"], 8, "cpu", 2)
    assert result["status"] == "failed"
    assert result["error"] == f"QuantgateError: {eval_copy}/math/items.jsonl:17: item math-0016 has no answer"


def test_missing_probe_file_is_a_clear_recorded_failure(tmp_path, monkeypatch, tiny_variants, base_path):
    monkeypatch.setattr(evaluate, "EVAL_DIR", tmp_path)
    result, _ = evaluate.evaluate_variant(str(tiny_variants["fp16"]), base_path, ["chat"], 8, "cpu", 2)
    assert result["status"] == "failed" and result["error"] == f"QuantgateError: {tmp_path}/chat/items.jsonl: file not found"


def test_model_without_pad_token_still_evaluates(monkeypatch, tiny_variants, base_path):
    import pipelines.models as models

    real = models.load_variant

    def no_pad(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        tok.pad_token = None
        return model, tok

    monkeypatch.setattr(evaluate, "load_variant", no_pad)
    result, items = evaluate.evaluate_variant(str(tiny_variants["fp16"]), base_path, ["math"], 8, "cpu", 2)
    assert result["status"] == "ok" and "no pad token" in result["note"] and len(items) == 2
