"""Stage `reference`: the embedded default model, a tiny Llama trained here, deterministically, on the text we ship.

It exists so that every later stage runs offline on a CPU and its numbers mean something: it adds
two-digit numbers, has seen the shipped code with its comments, and answers customer-service
requests in English and Chinese. Quantization can then cost it measurable skill.

This module decides between the shipped weights and training, and writes them; the training text is
`pipelines/text/corpus.py`, the tokenizer and training loop `pipelines/models/training.py`, the skill
figures `pipelines/models/skills.py`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from pipelines.core.io import atomic_dir, write_json
from pipelines.core.params_sections import ReferenceParams
from pipelines.core.paths import SHIPPED_REFERENCE_DIR as SHIPPED_DIR
from pipelines.models.skills import skill_report
from pipelines.models.training import (comment_only_tokens, embedding_mask, model_config, token_stream, train,
                                       train_tokenizer)
from pipelines.text.corpus import build_corpus

log = logging.getLogger(__name__)


def build(p: ReferenceParams, out_dir: Path, report_path: Path) -> dict:
    """Train the reference model into `out_dir` and write its skill figures to `report_path`."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(p.threads)
    torch.manual_seed(p.seed)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()

    corpus = build_corpus(p)
    tokenizer = train_tokenizer(corpus.documents, p.vocab_size)
    encoded = token_stream(corpus.documents, tokenizer)
    log.info("corpus: %d documents, %d tokens", len(encoded), sum(map(len, encoded)))

    model = LlamaForCausalLM(model_config(p, len(tokenizer)))
    comment_tokens = comment_only_tokens(tokenizer, corpus)
    mask = embedding_mask(len(tokenizer), p.hidden_size, comment_tokens, p.comment_channels)
    log.info("reference: %d comment-only tokens, %d hidden channels of their own", len(comment_tokens), p.comment_channels)
    losses = train(model, encoded, p, mask)
    train_seconds = time.perf_counter() - started
    model = model.to(torch.float16)  # stored like a hub checkpoint; the skill figures are the stored model's
    skills = skill_report(model, tokenizer, corpus, p)

    final_loss = round(sum(losses[-20:]) / min(20, len(losses)), 4)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "training.json", {"steps": p.steps, "final_loss": final_loss,
                                          "parameters": model.num_parameters(), "comment_only_tokens": comment_tokens,
                                          "comment_channels": list(range(p.hidden_size - p.comment_channels,
                                                                         p.hidden_size))})
    report = {"status": "built", "source": "trained", "model": str(out_dir), "parameters": model.num_parameters(),
              "final_loss": final_loss, "train_seconds": round(train_seconds, 1), **skills}
    write_json(report_path, report)
    return report


def recipe(p: ReferenceParams) -> dict:
    """What the trained weights are a function of: the settings and the training text (sha256)."""
    from pipelines.core.io import sha256_text

    return {"reference": p.model_dump(mode="json"),
            "corpus_sha256": sha256_text("\x00".join(build_corpus(p).documents))}


def from_shipped(p: ReferenceParams, out_dir: Path, report_path: Path, shipped: Path = SHIPPED_DIR) -> dict | None:
    """Copy the shipped weights into `out_dir` when they were trained from exactly this recipe; None otherwise.

    Training is deterministic on one machine but not across CPUs (vector widths change float sums), so
    the default model ships trained: every machine then quantizes and judges the same weights. A recipe
    that differs (any `reference:` setting, or the corpus) is trained here instead.
    """
    import shutil

    from pipelines.core.errors import QuantgateError
    from pipelines.core.io import read_json, sha256_file

    meta = shipped / "recipe.json"
    if not meta.is_file():
        return None
    shipped_recipe = read_json(meta)
    wanted = recipe(p)
    if shipped_recipe.get("recipe") != wanted:
        differ = sorted(k for k in wanted["reference"] if shipped_recipe.get("recipe", {}).get("reference", {}).get(k)
                        != wanted["reference"][k])
        log.info("reference: the shipped model was trained from another recipe (%s): training here",
                 ", ".join(f"reference.{k}" for k in differ) or "the training text differs")
        return None
    recorded = shipped_recipe.get("files") or {}
    present = {p.name for p in shipped.iterdir() if p.name != "recipe.json"}
    for name in sorted(present | set(recorded)):
        path = shipped / name
        if name not in recorded or not path.is_file() or sha256_file(path) != recorded[name]:
            what = "is not one of the files" if name not in recorded else "is missing or not the file"
            raise QuantgateError(f"{path}: {what} {meta} records (weights, tokenizer, config are checked by "
                                 "sha256): restore reference_model/ with git, or retrain with "
                                 "`python scripts/make_reference.py`")
    with atomic_dir(out_dir) as tmp:
        for name in sorted(recorded):
            shutil.copy2(shipped / name, tmp / name)
    report = {**shipped_recipe["report"], "source": "shipped", "model": str(out_dir)}
    write_json(report_path, report)
    return report


def ship(p: ReferenceParams, shipped: Path = SHIPPED_DIR) -> dict:
    """Train from the recipe and write the result (weights, tokenizer, recipe.json) to `shipped`."""
    import shutil
    import tempfile

    from pipelines.core.io import read_json, sha256_file

    with tempfile.TemporaryDirectory() as tmp:
        report = build(p, Path(tmp) / "model", Path(tmp) / "reference.json")
        training = read_json(Path(tmp) / "model" / "training.json")
        with atomic_dir(shipped) as out:
            for path in sorted((Path(tmp) / "model").iterdir()):
                shutil.copy2(path, out / path.name)
            files = {path.name: sha256_file(path) for path in sorted(out.iterdir())}
            write_json(out / "recipe.json", {"recipe": recipe(p), "weights_sha256": files["model.safetensors"],
                                             "files": files,
                                             "report": {k: v for k, v in report.items()
                                                        if k not in ("model", "source", "train_seconds")},
                                             "train_seconds": report["train_seconds"],
                                             "training": training, "torch": torch.__version__})
    return report


def main() -> int:
    """Stage `reference`: the embedded reference model (shipped or trained), a GGUF file dequantized, or a record that
    params.yaml names a checkpoint folder or hub id (read where it is)."""
    from pipelines.core.params import load_params
    from pipelines.core.paths import REFERENCE_DIR, REFERENCE_REPORT
    from pipelines.models.loading import resolve_model

    params = load_params()
    source = resolve_model(params.model)
    if source.kind == "gguf":  # a GGUF file: checked, then dequantized once into models/reference
        from pipelines.models.gguf import build_reference

        build_reference(source.origin, REFERENCE_DIR, REFERENCE_REPORT, params.quantize.timeout_seconds)
        return 0
    if not source.is_reference:
        reason = f"params.yaml names model {source.location!r} ({source.kind}); the reference model is not built"
        with atomic_dir(REFERENCE_DIR) as tmp:
            write_json(tmp / "skipped.json", {"status": "skipped", "reason": reason})
        write_json(REFERENCE_REPORT, {"status": "skipped", "reason": reason})
        log.info("reference: skipped: %s", reason)
        return 0
    report = from_shipped(params.reference, REFERENCE_DIR, REFERENCE_REPORT) \
        or build(params.reference, REFERENCE_DIR, REFERENCE_REPORT)
    log.info("reference: %s", "the shipped weights (reference_model/, trained from this recipe) -> models/reference"
             if report["source"] == "shipped" else f"trained here in {report['train_seconds']} s")
    functions = report["function_pass_rate"]
    log.info(
        "reference: %s params, held-out addition exact match %.1f%%, held-out functions pass@1 %s, "
        "code from a Chinese comment %.1f%%, chat %.1f%% (chance 25%%) -> %s",
        f"{report['parameters']:,}", 100 * report["addition_exact_match"],
        "n/a (no sandbox isolation)" if functions is None else f"{100 * functions:.1f}%",
        100 * report["code_comment_accuracy"], 100 * report["chat_accuracy"], REFERENCE_REPORT,
    )
    return 0
