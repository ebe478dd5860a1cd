"""Token-level fidelity against fp16, the way llama.cpp's `--kl-divergence` does it.

The fp16 baseline's next-token distributions over held-out domain text are computed once and stored
compactly (top-k float32 log-probabilities plus the log-probability of the correct token, safetensors);
each variant is compared against that file, never against a second fp16 forward pass.

With top-k storage, KL is computed over the base's k most likely tokens plus one bucket for all the
rest: KL(P_base || P_q) over that coarser partition. It is exact when k = vocabulary size and a
lower bound otherwise (merging outcomes never increases KL).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from pipelines.core.timing import library_call

PERCENTILES = {"max": 100, "p99_9": 99.9, "p99": 99, "p95": 95, "p90": 90, "median": 50, "p10": 10, "p5": 5,
               "p1": 1, "p0_1": 0.1, "min": 0}


@torch.no_grad()
def _log_probs(model, ids: list[int], device: str) -> torch.Tensor:
    """log-softmax of the next-token logits at every position but the last, float32."""
    out = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
    return torch.log_softmax(out, dim=-1).cpu()


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if len(ids) >= 2]


@torch.no_grad()
def base_record(model, tokenizer, texts_by_domain: dict[str, list[str]], top_k: int, device: str = "cpu",
                own_rows: dict[str, list[dict]] | None = None) -> dict:
    """The base's top-k log-probs, their token ids, and the correct token's log-prob, per scored token.
    `own_rows`, when given, is filled per domain with the base's own per-text rows (what `text_values` of the base
    model against this record gives) from the same forward pass: the baseline needs no second one to score itself."""
    tensors: dict[str, torch.Tensor] = {}
    for domain, texts in texts_by_domain.items():
        seqs = encode(tokenizer, texts)
        k = min(top_k, model.config.vocab_size)
        vals, idx, correct, lengths, ids_flat = [], [], [], [], []
        with library_call("forward (fidelity)"):
            for j, ids in enumerate(seqs):
                lp = _log_probs(model, ids, device)
                top = lp.topk(k, dim=-1)
                vals.append(top.values)  # float32: fp16 rounding (~1e-3) would swamp an int8 model's KL
                idx.append(top.indices.int())
                correct.append(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])])
                lengths.append(len(ids))
                ids_flat.extend(ids)
                if own_rows is not None:
                    own_rows.setdefault(domain, []).append(_row(lp, ids, top.values, top.indices.long(), domain, j))
        tensors[f"{domain}.top_logprobs"] = torch.cat(vals)
        tensors[f"{domain}.top_ids"] = torch.cat(idx)
        tensors[f"{domain}.correct_logprob"] = torch.cat(correct)
        tensors[f"{domain}.lengths"] = torch.tensor(lengths, dtype=torch.int32)
        tensors[f"{domain}.input_ids"] = torch.tensor(ids_flat, dtype=torch.int32)
    return tensors


def save_base(tensors: dict, path: Path) -> None:
    """Write through a temp file and rename, like every other output."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "quantgate-fidelity-v1"})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_base(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _stats(values: np.ndarray) -> dict:
    n = len(values)
    return {"mean": float(values.mean()), "stderr": float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
            **{name: float(np.percentile(values, q)) for name, q in PERCENTILES.items()}}


def _kl(q_lp: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per scored token: KL(base || variant) over the base's top-k plus one bucket, and whether the base's top
    token is (one of) the variant's most likely (ties count as agreement)."""
    p_top = top_lp.exp()
    q_top = q_lp.gather(1, top_ids).exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(0)
    q_rest = (1 - q_top.sum(-1)).clamp_min(1e-12)
    kl = (p_top * (top_lp - q_top.clamp_min(1e-12).log())).sum(-1)
    kl = kl + torch.where(p_rest > 1e-9, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(kl))
    same = (q_lp.gather(1, top_ids[:, :1]).squeeze(1) >= q_lp.max(dim=-1).values).float().numpy()
    return kl.clamp_min(0).numpy(), same


@torch.no_grad()
def text_values(model, base: dict, domain: str, indices: list[int] | None = None, device: str = "cpu") -> list[dict]:
    """Per stored text (all, or `indices`): its per-token KL, the variant's log-prob of each correct token and
    top-1 agreement. What evaluate records per text, and what `quantgate audit` re-measures on a sample."""
    lengths = base[f"{domain}.lengths"].tolist()
    flat = base[f"{domain}.input_ids"].tolist()
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()  # into input_ids
    scored = np.concatenate([[0], np.cumsum([n - 1 for n in lengths])]).tolist()  # into the per-token tensors
    rows = []
    for j in range(len(lengths)) if indices is None else indices:
        ids = flat[starts[j]: starts[j + 1]]
        a, b = scored[j], scored[j + 1]
        rows.append(_row(_log_probs(model, ids, device), ids, base[f"{domain}.top_logprobs"][a:b].float(),
                         base[f"{domain}.top_ids"][a:b].long(), domain, j))
    return rows


def _row(lp: torch.Tensor, ids: list[int], top_lp: torch.Tensor, top_ids: torch.Tensor, domain: str, j: int) -> dict:
    """One text's row: per-token KL against the base's top-k, the model's log-prob of each correct token, top-1."""
    kl, same = _kl(lp, top_lp, top_ids)
    return {"domain": domain, "text": j, "tokens": len(ids) - 1, "kl": kl.tolist(),
            "logprob": lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist(),
            "same_top1": same.astype(int).tolist()}


def summary(rows: list[dict], base: dict, domain: str) -> dict:
    """A domain's fidelity numbers from its per-text rows (all of them, in text order) and the base file: KL mean
    ± SE and percentiles, same top-1 ± SE, RMS Δp, PPL(Q)/PPL(base). The gate's audit recomputes it from the
    records, so a summary edited apart from its per-text rows is found."""
    kl = np.array([v for r in rows for v in r["kl"]], dtype=np.float32)
    same = np.array([v for r in rows for v in r["same_top1"]], dtype=np.float32)
    q_correct = torch.tensor([v for r in rows for v in r["logprob"]], dtype=torch.float32)
    base_correct = base[f"{domain}.correct_logprob"]
    if len(q_correct) != len(base_correct):
        raise ValueError(f"fidelity {domain}: {len(q_correct)} scored tokens recorded, the base file has "
                         f"{len(base_correct)}")
    dp = (q_correct.exp() - base_correct.exp()).numpy()
    n_tok = len(kl)
    ln_ratio = float((base_correct - q_correct).mean())  # mean NLL(Q) - mean NLL(base)
    return {
        "tokens": n_tok,
        "kl": _stats(kl),
        "same_top1": float(same.mean()),
        "same_top1_stderr": float(math.sqrt(same.mean() * (1 - same.mean()) / n_tok)),
        "rms_delta_p": float(np.sqrt((dp**2).mean())),
        "mean_delta_p": float(dp.mean()),
        "ppl_base": float(math.exp(-base_correct.mean())),
        "ppl_q": float(math.exp(-q_correct.mean())),
        "ln_ppl_ratio": ln_ratio,
        "ppl_ratio": float(math.exp(ln_ratio)),
    }


def compare(model, base: dict, domains: list[str], device: str = "cpu") -> dict:
    """Per domain: the summary (KL mean ± SE and percentiles, same top-1 ± SE, RMS Δp, PPL(Q)/PPL(base)) and,
    under `per_text`, the per-text rows it was computed from (evaluate writes those beside the per-item records)."""
    rows = {}
    for domain in domains:
        with library_call("forward (fidelity)"):
            rows[domain] = text_values(model, base, domain, None, device)
    return report(rows, base)


def report(rows: dict[str, list[dict]], base: dict) -> dict:
    """`compare`'s report from per-text rows already measured (the baseline's own, from `base_record`)."""
    return {domain: {**summary(texts, base, domain), "per_text": texts} for domain, texts in rows.items()}

