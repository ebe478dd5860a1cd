"""The phases run on a loaded model: peak against sequence length (`sweep`) and growth under mixed traffic (`soak`).

An out-of-memory error in a phase is a result, recorded with where it happened; any other error is the
variant's failure and propagates. The theory the sweep is set against (KV bytes per token) lives here too.
"""

from __future__ import annotations

import torch

from pipelines.core.params_sections import MemoryParams
from pipelines.measure.growth import growth_rate, slope, warmup_end
from pipelines.measure.probes import peak_of


def kv_bytes_per_token(config, element_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_bytes


def tensor_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _cache_bytes(past) -> int:
    """Bytes of the key/value tensors a transformers cache object holds."""
    total = 0
    for layer in getattr(past, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _ids(n_tokens: int, batch: int, vocab: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n_tokens), generator=g).to(device)


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError, MemoryError)


def is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError when it cannot allocate."""
    if isinstance(err, _oom_types()):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text
                                              or "out of memory" in text)


def _increase(peak: int | None, before: dict) -> int | None:
    base = before["allocated"] if before["peak_allocated"] is not None else before["process"]
    return None if peak is None or base is None else peak - base


@torch.no_grad()
def sweep(model, probe, lengths: list[int], decode_tokens: int, vocab: int, device: str, batch: int) -> dict:
    """Peak per length for prefill and decode; bytes a prefill leaves held (the KV cache), per sequence.

    Prefill keeps the cache and the last token's logits only, so what stays allocated is the cache;
    it runs `batch` sequences at once so the per-token cache stands well above heap noise.
    Decode runs one sequence and generates `decode_tokens` tokens.
    """
    rows = []
    try:  # warm-up at the longest length: first-call allocations (kernels, caches) are not a length's cost
        model.generate(_ids(max(lengths), 1, vocab, device, 0), max_new_tokens=1, do_sample=False, pad_token_id=0)
    except Exception as err:  # noqa: BLE001 - an OOM here shows again at that length, where it is recorded
        if not is_oom(err):
            raise
    for n in lengths:
        row: dict = {"tokens": n}
        try:
            probe.sync()
            probe.reset_peak()
            before = probe.snapshot()
            out = model(_ids(n, batch, vocab, device, n), use_cache=True, logits_to_keep=1)
            probe.sync()
            held = probe.snapshot()
            row["prefill_peak"] = peak_of(held)
            row["prefill_peak_increase"] = _increase(peak_of(held), before)
            row["kv_cache_bytes"] = _cache_bytes(out.get("cache") or out.get("past_key_values")) // batch
            row["retained_bytes"] = ((held["allocated"] - before["allocated"]) // batch
                                     if held["allocated"] is not None else None)
            del out
            probe.sync()
            probe.reset_peak()
            prompt = max(1, n - decode_tokens)
            model.generate(_ids(prompt, 1, vocab, device, n + 1), max_new_tokens=n - prompt, min_new_tokens=n - prompt,
                           do_sample=False, pad_token_id=0)
            probe.sync()
            row["decode_peak"] = peak_of(probe.snapshot())
            row["decode_peak_increase"] = _increase(row["decode_peak"], before)
        except Exception as err:  # noqa: BLE001 - only an OOM is a result; anything else is the variant's failure
            if not is_oom(err):
                raise
            row["oom"] = f"{type(err).__name__}: {err}"[:300]
            probe.sync()
        rows.append(row)
    ok = [r for r in rows if "oom" not in r and r.get("retained_bytes") is not None]
    return {"lengths": rows,
            "fitted_bytes_per_token": slope([r["tokens"] for r in ok], [r["retained_bytes"] for r in ok]),
            "kv_cache_bytes_per_token": slope([r["tokens"] for r in ok], [r["kv_cache_bytes"] for r in ok])}


class Injection:
    """The self-test's leak: `bytes_per_round` kept alive after each round (only while `round < until`, if set).
    Held here, not in the soak, so the traced rounds that follow (pipelines/measure/attribution.py) go on leaking
    from the same place: the tracer must name this method as the site."""

    def __init__(self, bytes_per_round: int = 0, until: int | None = None):
        self.bytes_per_round, self.until, self.kept = bytes_per_round, until, []

    def after_round(self, r: int, device: str) -> None:
        if self.bytes_per_round and (self.until is None or r < self.until):
            self.kept.append(torch.ones(self.bytes_per_round // 4, dtype=torch.float32, device=device))


@torch.no_grad()
def run_round(model, p: MemoryParams, max_len: int, vocab: int, device: str, r: int) -> None:
    """One round of mixed traffic: a burst of long requests batched together, then short and long requests
    alternating (which leaves holes in the cache). `r` seeds the token ids."""
    long_len = max(2, int(max_len * p.long_fraction))
    short_len = max(2, int(max_len * p.short_fraction))
    model(_ids(long_len - p.decode_tokens, p.burst_size, vocab, device, r), use_cache=True, logits_to_keep=1)
    for k in range(p.alternations):
        n = long_len if k % 2 else short_len
        model.generate(_ids(n - p.decode_tokens, 1, vocab, device, 1000 * r + k), max_new_tokens=p.decode_tokens,
                       do_sample=False, pad_token_id=0)


@torch.no_grad()
def soak(model, probe, p: MemoryParams, max_len: int, vocab: int, device: str, inject: Injection | None = None) -> dict:
    """Warm-up rounds, then measured rounds of mixed traffic (run_round) until growth has stopped or max_rounds is
    reached.

    After `rounds` measured rounds, while memory has not settled (warmup_end), more rounds run, up to `max_rounds`:
    caches that fill up stop growing, a leak does not. `inject` (the self-test) keeps bytes alive per round.
    `rounds_run` in the result counts every round, warm-up included: the traced rounds go on from there.
    """
    long_len = max(2, int(max_len * p.long_fraction))
    short_len = max(2, int(max_len * p.short_fraction))
    samples = []
    oom = None
    r = 0
    signal = None
    while True:
        try:
            run_round(model, p, max_len, vocab, device, r)
            if inject:
                inject.after_round(r, device)
        except Exception as err:  # noqa: BLE001 - only an OOM is a result; anything else is the variant's failure
            if not is_oom(err):
                raise
            oom = f"soak round {r}: {type(err).__name__}: {err}"[:300]
            break
        probe.sync()
        r += 1
        if r <= p.warmup_rounds:
            continue
        snap = probe.snapshot()
        samples.append({"round": len(samples), "allocated": snap["allocated"], "reserved": snap["reserved"],
                        "process": snap["process"]})
        signal = signal or ("allocated" if snap["allocated"] is not None else "process")
        values = [s[signal] for s in samples]
        if len(values) >= p.max_rounds or (len(values) >= p.rounds
                                           and warmup_end(values, p.tail_rounds, p.noise_floor_bytes) is not None):
            break
    values = [s[signal] for s in samples] if signal else []
    end = probe.snapshot()
    requests = p.burst_size + p.alternations
    return {
        "signal": signal,
        "rounds": samples,
        "rounds_run": r,
        "requests_per_round": requests,
        "long_tokens": long_len,
        "short_tokens": short_len,
        "tail_rounds": min(p.tail_rounds, len(values)),
        "growth_bytes_per_round": growth_rate(values, p.tail_rounds, p.noise_floor_bytes),
        "warmup_end_round": warmup_end(values, p.tail_rounds, p.noise_floor_bytes),
        "growth_last_minus_first": (values[-1] - values[0]) if len(values) >= 2 else None,
        "fragmentation": {
            "one_minus_allocated_over_reserved": (1 - end["allocated"] / end["reserved"])
            if end["allocated"] is not None and end["reserved"] else None,
            "inactive_split_over_reserved": (end["inactive_split"] / end["reserved"])
            if end["inactive_split"] is not None and end["reserved"] else None,
        },
        "oom": oom,
    }
