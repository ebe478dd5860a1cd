"""The one object every admission check reads and fills: a candidate folder and what is known about it so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.checkpoints.shards import Shard
    from pipelines.checkpoints.tensors import TensorPlan


@dataclass
class Candidate:
    """A checkpoint under admission. Checks read what earlier checks set; `reasons` holds theirs, in order."""

    folder: Path
    base_dir: str  # the base model the candidate must match
    copy_to: Path | None = None  # the data pass copies the accepted files here; None only validates
    reasons: list[str] = field(default_factory=list)
    step: str = ""  # what is being checked now (names the file if a check fails unexpectedly)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> kind, in copy order
    docs: dict = field(default_factory=dict)  # parsed JSON files
    config: dict | None = None  # config.json
    checked: dict[str, str] = field(default_factory=dict)  # non-weights file -> sha256 of the bytes checked
    sizes: dict[str, int] = field(default_factory=dict)  # non-weights file -> its size when checked
    quant: dict = field(default_factory=dict)  # method, bits, group_size, checkpoint_format
    details: dict = field(default_factory=dict)  # notes, tensor and shard counts: copied into the report
    shards: dict[str, Shard] = field(default_factory=dict)
    tensors: dict[str, tuple[str, dict]] = field(default_factory=dict)  # tensor -> (shard, header entry)
    plan: TensorPlan | None = None
    hashes: dict[str, str] = field(default_factory=dict)  # file -> sha256 of the bytes read (and copied)


Check = Callable[[Candidate], list[str]]


def could_not_check(where: str, err: Exception) -> str:
    """The reason recorded when a check itself fails: a malformed candidate is refused, never a crashed stage."""
    return f"admission could not check {where}: {type(err).__name__}: {err}"
