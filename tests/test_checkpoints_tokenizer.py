"""The tokenizer (and generation config) must fit the model and behave like the base model's."""

from __future__ import annotations

import shutil

import pytest

from pipelines.checkpoints import admission, tokenizer
from tests.checkpoint_helpers import broken_copy, edit_config, reasons_of


def permute_vocab(t):
    vocab = t["model"]["vocab"]
    tokens = list(vocab)
    t["model"]["vocab"] = dict(zip(tokens, [vocab[k] for k in tokens][::-1]))


@pytest.mark.parametrize("kind,name,change,reason", [
    ("gptq", "tokenizer.json", permute_vocab, "the vocabulary differs from the base model's"),
    ("awq", "tokenizer_config.json", lambda c: c.update(eos_token="<pad>"), "eos_token is '<pad>' (id 0), the base "
     "model's is '</s>' (id 2)"),
    ("int8", "tokenizer_config.json", lambda c: c.update(chat_template="{{ 'x' }}"),
     "tokenizer_config.json: the chat template differs from the base model's"),
    ("gptq", "tokenizer.json", lambda t: t.update(normalizer={"type": "Lowercase"}), "encodes to"),
    ("gptq", "generation_config.json", lambda c: c.update(do_sample=True, temperature=5.0),
     "generation_config.json: temperature is 5.0, the base model's is None"),
    ("awq", "generation_config.json", lambda c: c.update(eos_token_id=5),
     "generation_config.json: eos_token_id is 5, the base model's is 2"),
])
def test_tokenizer_and_generation_config_must_match_the_base(tmp_path, direct_checkpoints, tiny_model, kind, name,
                                                              change, reason):
    """Evaluation tokenizes with the candidate's own tokenizer: a tampered one would be evaluated and registered."""
    bad = broken_copy(direct_checkpoints[kind], tmp_path / "c")
    if not (bad / "generation_config.json").exists():
        shutil.copy(tiny_model / "generation_config.json", bad / "generation_config.json")
    assert admission.validate(bad, str(tiny_model))["admitted"]
    edit_config(bad, change, name=name)
    reasons = reasons_of(bad, tiny_model)
    assert any(reason in r for r in reasons), reasons
    assert all(r.split(": ", 1)[0] for r in reasons)


def test_a_tokenizer_that_does_not_load_is_a_refusal_naming_the_files(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda t: t.update(pre_tokenizer={"type": "NoSuchPreTokenizer"}), name="tokenizer.json")
    reasons = reasons_of(bad, tiny_model)
    assert len(reasons) == 1 and reasons[0].startswith("tokenizer.json, tokenizer_config.json: transformers cannot "
                                                       "load the tokenizer ("), reasons


def test_a_checkpoint_without_a_tokenizer_fails_saying_so(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (bad / name).unlink(missing_ok=True)
    assert reasons_of(bad, tiny_model) == [
        "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): evaluation and serving tokenize with "
        "the checkpoint's own tokenizer; ship the base model's beside the weights"]


def test_tokenizer_longer_than_vocab_fails(tmp_path, direct_checkpoints, tiny_model):
    bad = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(bad, lambda t: t["added_tokens"].append(
        {"id": 512, "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}), name="tokenizer.json")
    assert reasons_of(bad, tiny_model) == [
        "tokenizer.json: token ids reach 512, past config.json vocab_size 512 (those tokens have no embedding row)"]


def test_reasons_name_the_tokenizer_files_the_checkpoint_has():
    assert tokenizer.tokenizer_files({"model.safetensors": "a", "tokenizer.json": "b", "merges.txt": "c"}) == \
        "tokenizer.json, merges.txt"
    assert tokenizer.tokenizer_files({"model.safetensors": "a"}) == "the tokenizer files"
