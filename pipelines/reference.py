"""The embedded default model: a tiny Llama trained here, deterministically, on the text we ship.

It exists so that every later stage runs offline on a CPU and its numbers mean something: it adds
two-digit numbers, has seen the shipped code with its comments, and answers customer-service
requests in English and Chinese. Quantization can then cost it measurable skill.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelines.text import synthetic
from pipelines.text.code_comments import CommentSample, extract
from pipelines.core.io import atomic_dir, write_json
from pipelines.core.logs import progress
from pipelines.core.params import ReferenceParams
from pipelines.text.probes import chat_items
from pipelines.core.paths import CODE_SOURCES, SHIPPED_REFERENCE_DIR as SHIPPED_DIR

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def code_samples(root: Path = CODE_SOURCES) -> list[CommentSample]:
    """Every (comment, code) sample in the shipped code snapshot, in a stable order."""
    found: list[CommentSample] = []
    for path in sorted(root.rglob("*.py")):
        found.extend(extract(path.read_text(encoding="utf-8"), path.name))
    return found


@dataclass
class Corpus:
    """The training documents and the held-out items the skill figures are measured on."""

    documents: list[str]
    held_out_additions: list[tuple[int, int]]
    code: list[CommentSample]
    chat: list[dict]
    code_files: list[str]
    commented: list[str]  # the Chinese-commented functions among the documents


def build_corpus(p: ReferenceParams, code_root: Path = CODE_SOURCES) -> Corpus:
    train_pairs, held_out = synthetic.split_addition_pairs(p.seed, p.held_out_additions)
    code = code_samples(code_root)
    chat = synthetic.dialogues(p.seed, p.dialogues)
    files = [path.read_text(encoding="utf-8") for path in sorted(code_root.rglob("*.py"))]
    docs = [synthetic.addition_line(a, b) for a, b in train_pairs] * p.addition_repeats
    docs += synthetic.math_lines(p.seed + 1, p.math_lines)
    docs += [s.text for s in code] * p.code_repeats
    docs += files
    docs += [synthetic.dialogue_text(d) for d in chat]
    trained_functions, _ = synthetic.split_function_cases(p.seed)
    docs += [synthetic.function_source(t, n) for t, n in trained_functions] * p.function_repeats
    trained_commented, _ = synthetic.split_commented_cases(p.seed)
    commented = ["".join(synthetic.commented_function(*case)[:2]) for case in trained_commented[: p.commented_functions]]
    docs += commented * p.commented_repeats
    return Corpus(docs, held_out, code, chat, files, commented)


# --------------------------------------------------------------------------------------------
# Tokenizer and model
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE that splits every digit into its own token (arithmetic needs it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )


def model_config(p: ReferenceParams, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,

        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def comment_only_tokens(tokenizer, corpus: Corpus) -> list[int]:
    """Token ids that occur in the Chinese code comments and nowhere else in the training text."""
    commented = set(corpus.commented)
    others = {t for ids in tokenizer([d for d in set(corpus.documents) if d not in commented],
                                     add_special_tokens=False)["input_ids"] for t in ids}
    mine = {t for ids in tokenizer(corpus.commented, add_special_tokens=False)["input_ids"] for t in ids}
    return sorted(mine - others)


def embedding_mask(vocab: int, hidden: int, comment_tokens: list[int], channels: int) -> torch.Tensor:
    """1 where an embedding may be non-zero: the last `channels` hidden channels belong to the comment-only
    tokens (and they to nothing else), so the first layer reads comment words through weights that no
    other text excites. A calibration set without comments leaves exactly those weights unseen."""
    mask = torch.ones(vocab, hidden)
    if channels:
        mask[:, hidden - channels:] = 0
        mask[comment_tokens] = 0
        mask[comment_tokens, hidden - channels:] = 1
    return mask


def token_stream(docs: list[str], tokenizer) -> list[list[int]]:
    """Each document's token ids followed by </s> (`batches` shuffles them per epoch)."""
    eos = tokenizer.eos_token_id
    return [ids + [eos] for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]]


def batches(encoded: list[list[int]], seq_len: int, batch_size: int, steps: int, seed: int):
    """Yield `steps` batches of packed rows; documents reshuffled each epoch with a fixed seed."""
    rng = random.Random(seed)
    buf: list[int] = []
    order: list[int] = []
    need = seq_len * batch_size
    for _ in range(steps):
        while len(buf) < need:
            if not order:
                order = list(range(len(encoded)))
                rng.shuffle(order)
            buf.extend(encoded[order.pop()])
        chunk, buf = buf[:need], buf[need:]
        yield torch.tensor(chunk, dtype=torch.long).view(batch_size, seq_len)


def keep_channels_reserved(model, mask: torch.Tensor | None, channels: int) -> None:
    """Apply the embedding mask, and keep every layer from writing into the reserved channels (the rows of
    o_proj and down_proj for them stay 0): the residual stream's reserved channels then hold the comment
    words' embeddings and nothing else, in every layer, and are exactly 0 for every other token."""
    if mask is None:
        return
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(mask)
        if channels:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[-channels:] = 0
                layer.mlp.down_proj.weight[-channels:] = 0


@torch.no_grad()
def _perturb(weights: list[torch.Tensor], scale: float) -> list[torch.Tensor] | None:
    """Add Gaussian noise of `scale` x each row's largest |weight| (about what 3-4 bit rounding adds), keep
    the clean weights: the gradient is taken at the noisy point and applied to the clean one, so the model
    learns weights whose neighbourhood works, as real models' redundancy makes 4-bit cheap for them."""
    if not scale:
        return None
    clean = [w.detach().clone() for w in weights]
    for w in weights:
        w.add_(torch.randn_like(w) * w.abs().amax(dim=1, keepdim=True) * scale)
    return clean


@torch.no_grad()
def _restore(weights: list[torch.Tensor], clean: list[torch.Tensor] | None) -> None:
    if clean is not None:
        for w, c in zip(weights, clean):
            w.copy_(c)


def train(model, encoded: list[list[int]], p: ReferenceParams, mask: torch.Tensor | None = None) -> list[float]:
    """AdamW with warm-up and cosine decay; returns the loss per step. `mask` (embedding_mask) and the
    reserved channels are enforced at the start and after every step (keep_channels_reserved)."""
    keep_channels_reserved(model, mask, p.comment_channels)
    opt = torch.optim.AdamW(model.parameters(), lr=p.learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, p.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, p.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses = []
    model.train()
    bar = progress(batches(encoded, p.seq_len, p.batch_size, p.steps, p.seed), total=p.steps, desc="train reference")
    linears = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    for batch in bar:
        clean = _perturb(linears, p.weight_noise)
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        _restore(linears, clean)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        keep_channels_reserved(model, mask, p.comment_channels)
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if len(losses) % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------
# Skill figures
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, until: tuple[str, ...] = ("\n",),
                       batch_size: int = 64) -> list[str]:
    """Each prompt's greedy completion, cut at </s> and at the first of `until` (left padding, restored after)."""
    completions = []
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            for row in out[:, batch["input_ids"].shape[1] :]:
                text = tokenizer.decode(row, skip_special_tokens=False)
                for stop in (tokenizer.eos_token or "</s>", *until):
                    text = text.split(stop)[0]
                completions.append(text)
    finally:
        tokenizer.padding_side = side
    return completions


def greedy_exact_match(model, tokenizer, pairs: list[tuple[str, str]], max_new_tokens: int, batch_size: int = 64) -> float:
    """Share of prompts whose greedy completion, up to </s> or a newline, equals the answer (spaces ignored)."""
    completions = greedy_completions(model, tokenizer, [p for p, _ in pairs], max_new_tokens, ("\n",), batch_size)
    return sum(c.replace(" ", "") == want.replace(" ", "") for c, (_, want) in zip(completions, pairs)) / len(pairs)


@torch.no_grad()
def choice_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log-probabilities of `continuation` after `context` (what lm-eval's acc uses)."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logprobs[torch.arange(len(targets)), targets]
    return picked[len(ctx) - 1 :].sum().item()


def multiple_choice_accuracy(model, tokenizer, items: list[dict]) -> float:
    """Share of items whose gold choice has the highest byte-normalised log-likelihood (acc_norm)."""
    correct = 0
    for item in items:
        scores = [
            choice_logprob(model, tokenizer, item["context"], c) / max(1, len(c.encode()))
            for c in item["choices"]
        ]
        correct += max(range(len(scores)), key=scores.__getitem__) == item["gold"]
    return correct / len(items)


def skill_report(model, tokenizer, corpus: Corpus, p: ReferenceParams) -> dict:
    """The figures results/reference.json holds, with the chance level beside each."""
    _, held_out_functions = synthetic.split_function_cases(p.seed)
    pass_rate = function_pass_rate(model, tokenizer, held_out_functions[: p.eval_items])
    talk_items = chat_items(corpus.chat, p.seed, p.eval_items)
    _, held_commented = synthetic.split_commented_cases(p.seed)
    commented = [synthetic.commented_function(*case)[:2] for case in held_commented[: p.eval_items]]
    additions = [(f"{a}+{b}=", str(a + b)) for a, b in corpus.held_out_additions]
    return {
        "addition_exact_match": round(greedy_exact_match(model, tokenizer, additions, 4, 256), 4),
        "addition_items": len(additions),
        "code_comment_accuracy": round(greedy_exact_match(model, tokenizer, commented, 12), 4),
        "code_comment_items": len(commented),
        "chat_accuracy": round(multiple_choice_accuracy(model, tokenizer, talk_items), 4),
        "chat_items": len(talk_items),
        "chat_chance": 0.25,
        "function_pass_rate": None if pass_rate is None else round(pass_rate, 4),
        "function_items": min(len(held_out_functions), p.eval_items),
    }


# --------------------------------------------------------------------------------------------
# Stage
# --------------------------------------------------------------------------------------------


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


@torch.no_grad()
def function_pass_rate(model, tokenizer, cases: list[tuple[str, int]], batch_size: int = 64) -> float:
    """Greedy completion of each held-out function's body, executed against its tests in the sandbox.

    None when the sandbox cannot isolate on this machine: model-written code never runs unisolated here.
    """
    from pipelines.core.sandbox import isolation_available, run_python

    if not isolation_available():
        return None
    passed = 0
    for start in range(0, len(cases), batch_size):
        chunk = cases[start : start + batch_size]
        for t, n in chunk:
            prompt = synthetic.function_source(t, n).rsplit("return", 1)[0] + "return"
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            completion = tokenizer.decode(out[0, ids.shape[1]:]).split("</s>")[0].split("\n")[0]
            program = prompt + completion + "\n" + synthetic.function_tests(t, n)
            passed += run_python(program).passed
    return passed / len(cases)


def main() -> int:
    """Stage `reference`: train the embedded reference model (or record that params.yaml names another model)."""
    from pipelines.core.params import load_params
    from pipelines.core.paths import REFERENCE_DIR, REFERENCE_REPORT
    from pipelines.models.loading import resolve_model

    params = load_params()
    source = resolve_model(params.model)
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
