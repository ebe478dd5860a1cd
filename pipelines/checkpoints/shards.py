"""Safetensors shards and their index, parsed from the headers alone: each header validated by the safetensors
library and parsed again by hand (offsets, duplicates), the index against the shards, one copy of each tensor."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.checkpoints.context import Candidate
from pipelines.checkpoints.files import open_member

INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class Shard:
    """One safetensors file: its header as read (raw bytes kept, so the data pass can prove it unchanged)."""

    name: str
    size: int
    header: bytes  # the 8-byte length and the JSON header, exactly as on disk
    tensors: dict[str, dict] = field(default_factory=dict)  # name -> {dtype, shape, data_offsets}


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"tensor {key} appears twice in the header")
        seen[key] = value
    return seen


def read_header(folder: Path, rel: str) -> tuple[Shard | None, list[str]]:
    """The shard's header, validated by the safetensors library, plus a hand parse for what it does not give.

    safe_open already refuses a too-large or non-UTF-8 header, unknown dtypes, offsets that overlap,
    leave gaps or do not match shape x dtype, and a data section that does not end at the end of the
    file. The hand parse is kept for two things it does not do: its Python API does not expose the
    offsets (the data pass needs them to stream tensor by tensor), and its JSON parser keeps the last
    of two entries with the same name instead of refusing the header.
    """
    from safetensors import SafetensorError, safe_open

    with open_member(folder, rel) as fh:  # the file, or the hub blob its link points to (files.py)
        try:  # safe_open opens by name: this one's /proc name is the very file opened here, never a link's new target
            with safe_open(f"/proc/self/fd/{fh.fileno()}" if os.path.isdir("/proc/self/fd") else str(folder / rel),
                           framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            return None, [f"{rel}: refused by safetensors ({err})"]
        size = os.fstat(fh.fileno()).st_size
        raw_len = fh.read(8)
        (n,) = struct.unpack("<Q", raw_len)
        raw = fh.read(n)
    try:
        table = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as err:
        return None, [f"{rel}: {err}"]
    if not isinstance(table, dict):
        return None, [f"{rel}: header is not a JSON object"]
    table.pop("__metadata__", None)
    shard = Shard(rel, size, raw_len + raw, table)
    # The data pass streams by these offsets; safe_open validated the file through another open, so
    # the bytes kept here are checked again (tiled from 0 to the end, size = shape x dtype).
    end = 0
    for name, entry in table.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and isinstance(entry.get("dtype"), str) and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)):
            return None, [f"{rel}: tensor {name}: header entry {entry!r} is not {{dtype, shape, data_offsets}}"]
    for name, entry in sorted(table.items(), key=lambda kv: kv[1]["data_offsets"]):
        start, stop = entry["data_offsets"]
        width = DTYPE_BYTES.get(entry.get("dtype"))
        if start != end or stop < start or (width and stop - start != width * math.prod(entry["shape"])):
            return None, [f"{rel}: tensor {name}: data_offsets {entry['data_offsets']} do not follow the previous "
                          "tensor or disagree with its shape and dtype (changed while being read)"]
        end = stop
    if len(raw_len + raw) + end != shard.size:
        return None, [f"{rel}: the data section ends at {len(raw_len + raw) + end}, the file at {shard.size} "
                      "(changed while being read)"]
    return shard, []


def check_index(docs: dict, shards: dict[str, Shard]) -> list[str]:
    """model.safetensors.index.json must describe the shards exactly; without it, one model.safetensors."""
    index = docs.get(INDEX)
    if index is None:
        if list(shards) != ["model.safetensors"]:
            return [f"{', '.join(shards) or 'no weights'}: without {INDEX}, transformers loads only "
                    "model.safetensors"]
        return []
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return [f"{INDEX}: no weight_map"]
    odd = [name for name, shard in weight_map.items() if not isinstance(shard, str)]
    if odd:
        return [f"{INDEX}: weight_map entry {odd[0]} is not a file name"]
    reasons = []
    listed = set(weight_map.values())
    for shard in sorted(listed):
        if "/" in shard or "\\" in shard or shard not in shards:
            reasons.append(f"{INDEX}: lists shard {shard!r}, which is not in the folder")
    for shard in shards:
        if shard not in listed:
            reasons.append(f"{shard}: not listed in {INDEX}")
    for name, shard in weight_map.items():
        if shard in shards and name not in shards[shard].tensors:
            actual = [s for s in shards if name in shards[s].tensors]
            reasons.append(f"{INDEX}: puts tensor {name} in {shard}, but it is in "
                           f"{', '.join(actual) if actual else 'no shard'}")
    for shard in shards.values():
        for name in shard.tensors:
            if name not in weight_map:
                reasons.append(f"{shard.name}: tensor {name} is not listed in {INDEX}")
    return reasons


def collect_tensors(shards: dict[str, Shard]) -> tuple[dict[str, tuple[str, dict]], list[str]]:
    """{tensor: (shard, entry)}; a name in two shards is refused (which copy loads depends on the loader)."""
    tensors: dict[str, tuple[str, dict]] = {}
    reasons = []
    for shard in shards.values():
        for name, entry in shard.tensors.items():
            if name in tensors:
                reasons.append(f"tensor {name}: in both {tensors[name][0]} and {shard.name}")
            else:
                tensors[name] = (shard.name, entry)
    return tensors, reasons


def shard_headers(c: Candidate) -> list[str]:
    """Check: there are safetensors weights and every header is valid (sets c.shards)."""
    weights = [rel for rel, kind in c.files.items() if kind == "weights"]
    reasons = [] if weights else ["no .safetensors weights in the checkpoint"]
    for rel in weights:
        c.step = rel
        shard, bad = read_header(c.folder, rel)
        reasons += bad
        if shard:
            c.shards[rel] = shard
    return reasons


def index_matches_shards(c: Candidate) -> list[str]:
    """Check: the index describes the shards exactly."""
    return check_index(c.docs, c.shards)


def one_copy_per_tensor(c: Candidate) -> list[str]:
    """Check: no tensor in two shards (sets c.tensors, every tensor's shard and header entry)."""
    c.tensors, reasons = collect_tensors(c.shards)
    return reasons
