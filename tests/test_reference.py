"""The reference stage's own pieces on the tests' tiny model: tokenizer, determinism, skill report."""

from __future__ import annotations

import json

import pytest

from pipelines import reference
from pipelines.core.io import sha256_file
from pipelines.models import training
from pipelines.models.skills import greedy_exact_match
from pipelines.text import arithmetic, synthetic
from pipelines.text.corpus import build_corpus


def test_tokenizer_splits_every_digit(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    pieces = tok.tokenize("1234+56=1290")
    assert pieces == ["1", "2", "3", "4", "+", "5", "6", "=", "1", "2", "9", "0"]
    assert tok.decode(tok("√49=7 ×÷ 退款", add_special_tokens=False)["input_ids"]) == "√49=7 ×÷ 退款"


def test_checkpoint_is_safetensors_llama_with_quantizable_shapes(tiny_model, tiny_params):
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tiny_model / "model.safetensors").is_file()
    assert not list(tiny_model.glob("*.bin"))
    for width in (config["hidden_size"], config["intermediate_size"]):
        assert width % 64 == 0  # GPTQ-3 / AWQ-4 group size 64 divides every input width


def test_held_out_additions_are_never_trained_on(tiny_params):
    corpus = build_corpus(tiny_params)
    trained = set(corpus.documents)
    held = corpus.held_out_additions
    assert len(held) == tiny_params.held_out_additions
    assert not any(arithmetic.addition_line(a, b) in trained for a, b in held)


def test_two_builds_give_identical_files(tmp_path, tiny_params, tiny_model):
    again = tmp_path / "model"
    reference.build(tiny_params, again, tmp_path / "reference.json")
    assert sha256_file(again / "model.safetensors") == sha256_file(tiny_model / "model.safetensors")
    first, second = (json.loads(p.read_text()) for p in (tiny_model.parent / "reference.json", tmp_path / "reference.json"))
    for report in (first, second):
        del report["train_seconds"], report["model"]  # wall time and where: the only things that may differ
    assert first == second


def test_skill_report_scores_a_perfect_and_a_wrong_answer(tiny_model):
    """greedy_exact_match must count an exact answer and reject a wrong one: check with a stub generator."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)

    class Oracle:
        device = torch.device("cpu")

        def __init__(self, wrong: bool):
            self.wrong = wrong

        def generate(self, input_ids, **_):
            rows = []
            for row in input_ids:
                a, b = tok.decode(row, skip_special_tokens=True).rstrip("=").split("+")
                answer = str(int(a) + int(b) + self.wrong)
                rows.append(row.tolist() + tok(answer + "</s>", add_special_tokens=False)["input_ids"])
            width = max(map(len, rows))
            return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])

    pairs = [(f"{a}+{b}=", str(a + b)) for a, b in [(12, 34), (99, 99), (50, 50)]]
    assert greedy_exact_match(Oracle(False), tok, pairs, 4) == 1.0
    assert greedy_exact_match(Oracle(True), tok, pairs, 4) == 0.0


def test_report_has_every_skill_figure(tiny_model):
    report = json.loads((tiny_model.parent / "reference.json").read_text())
    assert report["status"] == "built"
    assert report["addition_items"] == 50 and report["code_comment_items"] == 20 and report["chat_items"] == 20
    for key in ("addition_exact_match", "code_comment_accuracy", "chat_accuracy"):
        assert 0.0 <= report[key] <= 1.0
    from pipelines.core import sandbox

    if sandbox.isolation_available():
        assert report["function_items"] == 20 and 0.0 <= report["function_pass_rate"] <= 1.0
    else:
        assert report["function_pass_rate"] is None  # never runs model-written code unisolated


def test_held_out_functions_are_never_trained_on(tiny_params):
    corpus = build_corpus(tiny_params)
    _, held_out = synthetic.split_function_cases(tiny_params.seed)
    trained = set(corpus.documents)
    assert held_out and not any(synthetic.function_source(t, n) in trained for t, n in held_out)


def test_shipped_weights_are_used_only_for_their_own_recipe(tmp_path, tiny_params):
    """`quantgate reference` copies reference_model/ when params ask for the recipe it was trained from,
    trains when they ask for another, and refuses shipped weights that are not the ones recorded."""
    from pipelines.core.errors import QuantgateError

    shipped = tmp_path / "shipped"
    report = reference.ship(tiny_params, shipped)
    recipe = json.loads((shipped / "recipe.json").read_text())
    assert recipe["weights_sha256"] == sha256_file(shipped / "model.safetensors")
    assert recipe["recipe"] == reference.recipe(tiny_params)

    copied = reference.from_shipped(tiny_params, tmp_path / "models/reference", tmp_path / "reference.json", shipped)
    assert copied["source"] == "shipped" and copied["addition_exact_match"] == report["addition_exact_match"]
    assert sha256_file(tmp_path / "models/reference/model.safetensors") == recipe["weights_sha256"]
    assert not (tmp_path / "models/reference/recipe.json").exists()

    other = tiny_params.model_copy(update={"seed": 1})
    assert reference.from_shipped(other, tmp_path / "elsewhere", tmp_path / "r.json", shipped) is None

    (shipped / "tokenizer.json").write_text((shipped / "tokenizer.json").read_text().replace("<pad>", "<pqd>"))
    with pytest.raises(QuantgateError, match="tokenizer.json: is missing or not the file"):
        reference.from_shipped(tiny_params, tmp_path / "again", tmp_path / "r2.json", shipped)
    reference.ship(tiny_params, shipped)
    (shipped / "extra.py").write_text("import os\n")
    with pytest.raises(QuantgateError, match="extra.py: is not one of the files"):
        reference.from_shipped(tiny_params, tmp_path / "again", tmp_path / "r2.json", shipped)
    assert not (tmp_path / "again").exists()


def test_training_batches_pack_every_document_in_a_seeded_order():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    first = [b.tolist() for b in training.batches(docs, seq_len=3, batch_size=2, steps=3, seed=1)]
    assert first == [b.tolist() for b in training.batches(docs, seq_len=3, batch_size=2, steps=3, seed=1)]
    assert first != [b.tolist() for b in training.batches(docs, seq_len=3, batch_size=2, steps=3, seed=2)]
    flat = [t for b in first for row in b for t in row]
    assert len(flat) == 18 and sorted(flat[:9]) == list(range(1, 10))  # one epoch: every document once
