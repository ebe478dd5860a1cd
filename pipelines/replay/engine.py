"""One model's replay, run in its own process: greedy decoding of the parent's token ids, timed and measured.

A manual KV-cache loop rather than `generate()`: the prefill (time to first token) and every decode step (time per
output token) are timed on their own, and every model sees the same batches, built the same way, so fp16 against
itself agrees exactly. Each prompt is prefilled alone (left-padding a batch of mixed lengths computed 2.4 times the
prompt tokens on the production sample), then the batch decodes together over one left-padded cache. One batch is
replayed untimed first: kernels and allocator pools start up there, not in the first request's latency or the
replay's memory growth. Memory is read the way the memory stage reads it (pipelines/measure/probes.py): on CUDA the
allocator's bytes, on a CPU the weights' tensor bytes plus the most heap bytes (glibc mallinfo2) one batch holds
after its last step, over what was in use before it (the CPU runtime's own caches are not the model's): the peak.
Growth is across the whole replay (a leak from batch to batch): bytes in use (CUDA: allocated; CPU: heap) after the
last batch minus before the first.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _prefill(model, rows: list[list[int]], device: str, sync) -> tuple[object, object, list[float]]:
    """Each row's prompt on its own (no padding to compute), then one left-padded cache for the batch's decoding.

    Returns (first new token per row, the batch's cache, each row's time to first token in seconds: the prompts of
    a batch are prefilled one after another, so a row waits for the rows before it)."""
    import torch
    from transformers import DynamicCache

    width = max(len(r) for r in rows)
    firsts, per_layer, ttft = [], [], []
    started = time.perf_counter()
    for row in rows:
        own = DynamicCache()  # filled in place by the forward (transformers 5: the `cache` argument)
        out = model(input_ids=torch.tensor([row], device=device), cache=own, use_cache=True, logits_to_keep=1)
        firsts.append(out.logits[0, -1, :].argmax(-1))
        sync()
        ttft.append(time.perf_counter() - started)
        layers = [(layer.keys, layer.values) for layer in own.layers]
        pad = width - len(row)
        per_layer.append([(torch.nn.functional.pad(k, (0, 0, pad, 0)), torch.nn.functional.pad(v, (0, 0, pad, 0)))
                          for k, v in layers])
    cache = DynamicCache([(torch.cat([r[i][0] for r in per_layer]), torch.cat([r[i][1] for r in per_layer]))
                          for i in range(len(per_layer[0]))])
    return torch.stack(firsts), cache, ttft


def _decode(model, rows: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: list[int], device: str,
            sync, at_end=None) -> tuple[list[list[int]], list[float], list[float]]:
    """(new token ids per row, each row's time to first token, seconds of each decode step); a row stops at any of
    `eos_ids`; `at_end()` runs after the last step, while the batch's cache is at its largest."""
    import torch

    stops = torch.tensor(eos_ids, dtype=torch.long, device=device)

    width = max(len(r) for r in rows)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        mask[i, width - len(row):] = 1
    token, cache, prefill = _prefill(model, rows, device, sync)
    new, steps = [token], []
    done = torch.isin(token, stops)
    position = torch.tensor([[len(r) - 1] for r in rows], device=device)
    for _ in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        started = time.perf_counter()
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                    cache=cache, use_cache=True)
        token = out.logits[:, -1, :].argmax(-1)
        sync()
        steps.append(time.perf_counter() - started)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        new.append(token)
        done = done | torch.isin(token, stops)
    if at_end is not None:
        at_end()
    generated = torch.stack(new, dim=1).tolist()
    answers = []
    for row in generated:
        cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers, prefill, steps


def _eos_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the tokenizer's eos and the model's generation_config eos (an id or a list)."""
    ids: list[int] = []
    config = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        for token in (value if isinstance(value, (list, tuple)) else [value]):
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def replay(variant_dir: str, batches: list[list[list[int]]], max_new_tokens: int, device: str, threads: int,
           waits: list[float] | None = None) -> dict:
    """Greedy answers to every batch (lists of token ids) and the numbers of the replay; JSON only.

    `waits`: per batch, seconds after the replay's start before it may run (time compression); None: back to back.
    A model that fails to load or to run raises: the isolated process reports it as this model's failure."""
    import torch

    from pipelines.core.timing import library_call
    from pipelines.measure.phases import tensor_bytes
    from pipelines.measure.probes import make_probe
    from pipelines.models.loading import load_variant

    torch.set_num_threads(threads)
    started = time.perf_counter()
    probe = make_probe(device)
    try:
        model, tokenizer = load_variant(variant_dir, device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos_ids = _eos_ids(model, tokenizer)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        with torch.inference_mode():
            _decode(model, batches[0], max_new_tokens, pad_id, eos_ids, device, sync)  # warm-up, untimed
        probe.sync()
        probe.reset_peak()
        loaded = probe.snapshot()
        answers, ttft, tpot, tokens, busy, held, before = [], [], [], 0, 0.0, [0], [0]
        heap = device != "cuda" and loaded["allocated"] is not None

        def at_end():  # CPU: heap bytes the batch holds with its cache alive (RSS and runtime caches are noise here)
            if heap:
                held.append(probe.snapshot()["allocated"] - before[0])

        clock = time.perf_counter()
        with torch.inference_mode(), library_call("forward (replay decode)"):
            for k, rows in enumerate(batches):
                if waits is not None:
                    time.sleep(max(0.0, waits[k] - (time.perf_counter() - clock)))
                if heap:
                    before[0] = probe.snapshot()["allocated"]
                began = time.perf_counter()
                out, prefill, steps = _decode(model, rows, max_new_tokens, pad_id, eos_ids, device, sync, at_end)
                busy += time.perf_counter() - began
                answers.extend(out)
                ttft.extend(t * 1000 for t in prefill)
                tpot.extend(s * 1000 for s in steps)
                tokens += sum(len(a) for a in out)
        probe.sync()
        end = probe.snapshot()
        if device == "cuda":
            start_bytes, peak = loaded["allocated"], end["peak_allocated"]
        else:  # safetensors maps the weights: count them as the memory stage does, plus the heap the replay held
            start_bytes = tensor_bytes(model)
            peak = start_bytes + max(held)
        # growth across the whole replay (a leak from batch to batch): in use after the last batch minus before the
        # first; None where the probe cannot read the bytes in use
        growth = (end["allocated"] - loaded["allocated"]
                  if end["allocated"] is not None and loaded["allocated"] is not None else None)
    finally:
        probe.close()
    return {"variant": Path(variant_dir).name, "answers": answers, "ttft_ms": ttft, "tpot_ms": tpot,
            "tokens": tokens, "busy_seconds": busy, "seconds": time.perf_counter() - started,
            "memory": {"measure": "cuda" if device == "cuda" else "heap", "start_bytes": int(start_bytes),
                       "peak_bytes": int(peak), "batch_peak_growth_bytes": int(peak - start_bytes),
                       "growth_bytes": None if growth is None else int(growth),
                       "growth_pct": 100 * growth / start_bytes if start_bytes and growth is not None else None}}
