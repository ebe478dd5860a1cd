"""Config drift: a candidate must be the base model, quantized. Its config.json and generation_config.json are
compared with the base model's; only DRIFT_ALLOWED keys (how the file was written) may differ."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.checkpoints.context import Candidate

DRIFT_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings",
              "tie_word_embeddings")
# The only config keys a candidate may change (everything else is compared with the base's, docs/quantize.md):
# how the file was written, the dtype its weights were saved in (a quantizer loads fp16), the KV-cache switch.
DRIFT_ALLOWED = {"transformers_version": "written by whichever transformers saved it",
                 "_name_or_path": "where it was loaded from",
                 "dtype": "the dtype the weights were saved in; the tensor checks cover it",
                 "torch_dtype": "the older spelling of dtype",
                 "use_cache": "a runtime switch for the KV cache, not the model's function"}
# GPTQModel sets do_sample: true in every generation_config.json it saves (gptqmodel/utils/hf.py,
# _sanitize_generation_config); with every sampling parameter equal to the base's, that alone is tolerated
# (evaluation passes do_sample=False). Without a base generation_config.json, the candidate's may hold only
# the token ids (equal to config.json's), GPTQModel's do_sample and values equal to transformers' defaults.
GENERATION_IGNORED = {"transformers_version"}


def normalized_config(config: dict):
    """The config as transformers reads it (defaults filled in, legacy rope_theta/rope_scaling folded in)."""
    from transformers import AutoConfig

    clean = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    return AutoConfig.for_model(**clean)


def rope_of(cfg) -> tuple[object, dict]:
    """(rope_theta, the rest of the rope parameters) whichever way the config spells them."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(cfg, "rope_theta", None))
    scaling = params or dict(getattr(cfg, "rope_scaling", None) or {})
    if scaling.get("rope_type", scaling.get("type")) in (None, "default") and len(scaling) <= 1:
        scaling = {}  # "default" rope with nothing else is no scaling
    return theta, scaling


def config_drift(config: dict, base_dir: str) -> list[str]:
    """Reasons the candidate's config.json differs from the base model's where it changes the model."""
    from transformers import AutoConfig

    try:
        cand = normalized_config(config)
    except (ValueError, KeyError, TypeError) as err:
        return [f"config.json: transformers cannot read it ({err})"]
    base = AutoConfig.from_pretrained(base_dir)
    reasons = []
    for key in DRIFT_KEYS:
        mine, theirs = getattr(cand, key, None), getattr(base, key, None)
        if mine != theirs:
            reasons.append(f"config.json: {key} is {mine!r}, the base model has {theirs!r}")
    # Every other key too (hidden_act, rms_norm_eps, token ids, ...): they change what the model computes
    # without changing a shape. Only DRIFT_ALLOWED may differ; rope is compared above, spelling-independently.
    mine, theirs = cand.to_dict(), base.to_dict()
    skip = set(DRIFT_KEYS) | set(DRIFT_ALLOWED) | {"rope_parameters", "rope_theta", "rope_scaling"}
    for key in sorted((set(mine) | set(theirs)) - skip):
        if json.dumps(mine.get(key), sort_keys=True, default=str) != \
                json.dumps(theirs.get(key), sort_keys=True, default=str):
            reasons.append(f"config.json: {key} is {mine.get(key)!r}, the base model has {theirs.get(key)!r}")
    (theta, scaling), (base_theta, base_scaling) = rope_of(cand), rope_of(base)
    if theta != base_theta:
        reasons.append(f"config.json: rope_theta is {theta!r}, the base model has {base_theta!r}")
    if scaling != base_scaling:
        reasons.append(f"config.json: rope_scaling is {scaling or None!r}, the base model has {base_scaling or None!r}")
    return reasons


def generation_matches_base(config: dict, docs: dict, base_dir: str) -> list[str]:
    """generation_config.json must be the base model's (apart from GENERATION_IGNORED and GPTQModel's do_sample)."""
    mine = docs.get("generation_config.json")
    if mine is None:
        return []  # transformers derives one from config.json, which is compared with the base's
    if not isinstance(mine, dict):
        return [f"generation_config.json: a {type(mine).__name__}, not a JSON object"]
    path = Path(base_dir) / "generation_config.json"
    try:
        theirs = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError) as err:
        return [f"{path}: the base model's generation config cannot be read ({err})"]
    mine = {k: v for k, v in mine.items() if k not in GENERATION_IGNORED}
    if theirs is None:
        from transformers import GenerationConfig

        defaults = GenerationConfig().to_dict()
        expected = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        reasons = []
        for key, value in sorted(mine.items()):
            if key in expected:
                if value != expected[key]:
                    reasons.append(f"generation_config.json: {key} is {value!r}, config.json has {expected[key]!r}")
            elif key == "_from_model_config" or (key == "do_sample" and value is True) or \
                    (key in defaults and json.dumps(defaults[key], default=str) == json.dumps(value, default=str)):
                continue
            else:
                reasons.append(f"generation_config.json: {key} is {value!r}; the base model has no "
                               "generation_config.json, so only the token ids of config.json may be set")
        return reasons
    theirs = {k: v for k, v in theirs.items() if k not in GENERATION_IGNORED}
    if mine.get("do_sample") is True and not theirs.get("do_sample"):  # what GPTQModel writes on every save
        mine = {k: v for k, v in mine.items() if k != "do_sample"}
        theirs = {k: v for k, v in theirs.items() if k != "do_sample"}
    return [f"generation_config.json: {key} is {mine.get(key)!r}, the base model's is {theirs.get(key)!r}"
            for key in sorted(set(mine) | set(theirs))
            if json.dumps(mine.get(key), sort_keys=True) != json.dumps(theirs.get(key), sort_keys=True)]


def config_against_base(c: Candidate) -> list[str]:
    """Check: config.json changes nothing in the model against the base's."""
    return config_drift(c.config, c.base_dir)


def generation_against_base(c: Candidate) -> list[str]:
    """Check: generation_config.json is the base model's."""
    return generation_matches_base(c.config, c.docs, c.base_dir)
