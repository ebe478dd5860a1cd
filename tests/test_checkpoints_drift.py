"""Config drift: only DRIFT_ALLOWED keys may differ from the base model's config."""

from __future__ import annotations

import pytest

from pipelines.checkpoints import admission, drift
from tests.checkpoint_helpers import broken_copy, edit_config, reasons_of


def test_cosmetic_config_keys_may_differ(tmp_path, direct_checkpoints, tiny_model):
    """DRIFT_ALLOWED: what real writers change (autoawq: use_cache; GPTQModel: dtype) and how the file was saved."""
    ok = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(ok, lambda c: c.update(use_cache=False, dtype="bfloat16", transformers_version="4.57.1",
                                       _name_or_path="/somewhere/else"))
    assert admission.validate(ok, str(tiny_model))["admitted"]
    assert set(drift.DRIFT_ALLOWED) == {"transformers_version", "_name_or_path", "dtype", "torch_dtype",
                                             "use_cache"}


def test_legacy_rope_spelling_is_not_drift(tmp_path, direct_checkpoints, tiny_model):
    ok = broken_copy(direct_checkpoints["awq"], tmp_path / "c")
    edit_config(ok, lambda c: (c.pop("rope_parameters"), c.update(rope_theta=10000.0, rope_scaling=None)))
    assert admission.validate(ok, str(tiny_model))["admitted"]


@pytest.mark.parametrize("change,reason", [
    (lambda c: c["rope_parameters"].update(rope_theta=500000.0),
     "config.json: rope_theta is 500000.0, the base model has 10000.0"),
    (lambda c: c["rope_parameters"].update(rope_type="linear", factor=4.0),
     "config.json: rope_scaling is {'rope_type': 'linear', 'factor': 4.0}, the base model has None"),
    (lambda c: c.update(tie_word_embeddings=True), "config.json: tie_word_embeddings is True, the base model has False"),
    (lambda c: c.update(vocab_size=520), "config.json: vocab_size is 520, the base model has 512"),
    (lambda c: c.update(num_key_value_heads=1), "config.json: num_key_value_heads is 1, the base model has 2"),
    (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"]),
     "config.json: model_type is 'mistral', the base model has 'llama'"),
    # behaviour, not shapes: every key outside DRIFT_ALLOWED is compared
    (lambda c: c.update(hidden_act="relu"), "config.json: hidden_act is 'relu', the base model has 'silu'"),
    (lambda c: c.update(rms_norm_eps=1.0), "config.json: rms_norm_eps is 1.0, the base model has 1e-06"),
    (lambda c: c.update(eos_token_id=7), "config.json: eos_token_id is 7, the base model has 2"),
    (lambda c: c.update(bos_token_id=5), "config.json: bos_token_id is 5, the base model has 1"),
    (lambda c: c.update(attention_bias=True), "config.json: attention_bias is True, the base model has False"),
])
def test_config_drift_fails(tmp_path, direct_checkpoints, tiny_model, change, reason):
    bad = broken_copy(direct_checkpoints["gptq"], tmp_path / "c")
    edit_config(bad, change)
    assert reason in reasons_of(bad, tiny_model)
