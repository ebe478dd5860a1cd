"""Training the reference model: its tokenizer, its Llama config, the reserved comment channels, the loop.

Deterministic for one seed on one machine (fixed shuffles, seeded noise, deterministic torch kernels set by
the caller); pipelines/reference.py calls it and ships what it makes.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import torch

from pipelines.core.logs import progress
from pipelines.core.params_sections import ReferenceParams

if TYPE_CHECKING:
    from pipelines.text.corpus import Corpus

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


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
