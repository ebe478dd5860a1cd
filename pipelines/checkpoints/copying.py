"""The data pass: each accepted file read once, in bounded chunks; each chunk hashed (sha256, in a second
thread), value-checked and, when admitting, written to the copy. The copy therefore holds exactly the bytes
that were hashed and checked, with no second read of a shard and no re-hash (docs/quantize.md,
benchmarks/admission_cost.py); a small file whose sha256 differs from phase 1's, or a shard whose header
differs, changed in between and is refused. A hub cache snapshot's link is read through `files.open_member`:
the blob it points to is what is hashed and copied (as a regular file, never a link)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pipelines.checkpoints.context import Candidate, could_not_check
from pipelines.checkpoints.files import open_member
from pipelines.checkpoints.shards import Shard
from pipelines.checkpoints.tensors import TensorPlan, ValueCheck

CHUNK_BYTES = 8 << 20  # bounded memory per read (two buffers per file being read)


class Sink:
    """A file's copy and sha256, fed chunk by chunk from a worker thread while the reading thread reads on."""

    def __init__(self, dest: Path | None):
        self.digest = hashlib.sha256()
        self.out = dest.open("wb") if dest else None

    def write(self, view: memoryview) -> None:
        if self.out:
            self.out.write(view)

    def consume(self, view: memoryview) -> None:
        """Copy and hash one chunk, off the reading thread (both release the GIL)."""
        self.write(view)
        self.hash(view)

    def hash(self, view: memoryview) -> None:
        self.digest.update(view)  # hashlib releases the GIL: this overlaps the reading, checking and writing

    def close(self) -> str:
        # No fsync, like every checkpoint the quantize stage writes: atomic_dir's rename publishes the folder
        # and DVC hashes it next; an fsync would add a full disk write to the stage's time.
        if self.out and not self.out.closed:
            self.out.close()
        return self.digest.hexdigest()


def stream_file(folder: Path, rel: str, dest: Path | None, shard: Shard | None, check: ValueCheck | None,
                pool: ThreadPoolExecutor) -> tuple[str, list[str]]:
    """(sha256, reasons) after reading folder/rel once: hash, value checks and copy share each chunk.

    Two buffers alternate: while the worker thread writes and hashes one, the next is read and checked.
    A safetensors file is read tensor by tensor in header order, so each chunk holds whole elements of one
    tensor; its header bytes must equal those phase 1 validated, or the file changed in between.
    """
    sink = Sink(dest)
    buffers, pending, turn = [bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES)], [None, None], 0

    def read_chunk(fh, count: int) -> memoryview:
        nonlocal turn
        turn ^= 1
        if pending[turn] is not None:
            pending[turn].result()  # the worker is done with this buffer
        view = memoryview(buffers[turn])[:count]
        return view[:fh.readinto(view)]

    def hand_off(view: memoryview) -> None:
        pending[turn] = pool.submit(sink.consume, view)

    try:
        with open_member(folder, rel) as fh:
            if hasattr(os, "posix_fadvise"):  # larger read-ahead from a cold disk (Linux)
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if shard is None:
                while view := read_chunk(fh, CHUNK_BYTES):
                    hand_off(view)
                return sink_result(sink, pending, [])
            if fh.read(len(shard.header)) != shard.header:
                return sink_result(sink, pending, [f"{shard.name}: header changed while being read"])
            sink.hash(memoryview(shard.header))
            sink.write(memoryview(shard.header))
            for name, entry in sorted(shard.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = entry["dtype"]
                left = entry["data_offsets"][1] - entry["data_offsets"][0]
                step = CHUNK_BYTES - CHUNK_BYTES % 8  # whole elements of every dtype
                while left:
                    view = read_chunk(fh, min(step, left))
                    if len(view) < min(step, left):
                        return sink_result(sink, pending, [f"{shard.name}: ends inside tensor {name} "
                                                           "(changed while being read)"])
                    hand_off(view)
                    if check is not None:
                        check(shard.name, name, dtype, view)
                    left -= len(view)
            if fh.read(1):
                return sink_result(sink, pending, [f"{shard.name}: longer than its header says "
                                                   "(changed while being read)"])
            return sink_result(sink, pending, [])
    except BaseException:
        for job in pending:
            if job is not None:
                job.exception()  # wait for the worker before closing its file
        sink.close()
        raise


def sink_result(sink: Sink, pending: list, reasons: list[str]) -> tuple[str, list[str]]:
    """Wait for the worker, close the copy and return (sha256, reasons)."""
    for job in pending:
        if job is not None:
            job.result()
    return sink.close(), reasons


def stream_all(folder: Path, files: dict[str, str], shards: dict[str, Shard], plan: TensorPlan | None,
               copy_to: Path | None, checked: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """({file: sha256}, reasons) over every accepted file, each read exactly once.

    sha256 runs at about 1.7 GB/s per core, slower than a warm read, so files are streamed in parallel
    (one per core, each with its own hashing thread): the shards of a large checkpoint then hash about as
    fast as a disk delivers them (benchmarks/admission_cost.py).
    """
    check = ValueCheck(plan) if plan is not None else None
    if copy_to is not None:
        for rel in files:
            (copy_to / rel).parent.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(len(files), 2 * cores))  # more files than cores: a shard count that does not divide
    # evenly over the cores still keeps every core hashing (measured: 3 shards on 2 cores)

    def one(rel: str) -> tuple[str, list[str]]:
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="admit-hash") as pool:
                digest, reasons = stream_file(folder, rel, copy_to / rel if copy_to else None, shards.get(rel),
                                              check, pool)
            if rel not in shards and digest != checked.get(rel):  # the copy must be the bytes phase 1 checked
                reasons.append(f"{rel}: changed while being read (its bytes differ from those checked)")
            return digest, reasons
        except OSError as err:  # vanished, unreadable, or (for the copy) no space: this candidate's failure
            return "", [f"{rel}: {err.strerror or err} ({err.filename})"]
        except Exception as err:  # noqa: BLE001 - whatever a file does, it is refused, never a crash
            return "", [could_not_check(rel, err)]

    sizes = {rel: shards[rel].size if rel in shards else 0 for rel in files}
    order = sorted(files, key=lambda rel: -sizes[rel])  # largest (the shards) first: balanced workers
    # One torch thread: the value checks already run one file per core, and torch's own thread pool fighting
    # these threads made aminmax 16x slower here (16 GiB/s with one thread, under 1 GiB/s with two).
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="admit-file") as files_pool:
            results = dict(zip(order, files_pool.map(one, order)))
    finally:
        torch.set_num_threads(torch_threads)
    hashes = {rel: results[rel][0] for rel in files}
    reasons = [reason for rel in files for reason in results[rel][1]]
    if check is not None:
        reasons += check.reasons()
    return hashes, reasons


def copy_and_hash(c: Candidate) -> list[str]:
    """Check: every byte read once, hashed, value-checked and copied to c.copy_to (sets c.hashes)."""
    c.hashes, reasons = stream_all(c.folder, c.files, c.shards, c.plan, c.copy_to, c.checked)
    return reasons
