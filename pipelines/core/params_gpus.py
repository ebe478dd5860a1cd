"""params.yaml's `gpus:` section: how much of each visible GPU the fp16 and int8 variants may use across GPUs, and the
parser of one GPU's share (bytes, a size like '70GiB', or a fraction of its memory)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import field_validator

from pipelines.core.params_requests import Section

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$")
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_gpu_share(value: Any) -> int | float:
    """One GPU's share: bytes (an int, or a string like '70GiB' / '80GB'), or a fraction (0, 1] of its memory.

    Returns int bytes or a float fraction; anything else raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{value} bytes: a GPU's share must be positive")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"{value}: a fraction of a GPU's memory must be in (0, 1]")
        return value
    if isinstance(value, str):
        m = SIZE.match(value)
        if m:
            n = int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
            if n > 0:
                return n
        raise ValueError(f"{value!r}: write a size like '70GiB', '80GB' or '512MiB' (or bytes, or a fraction 0-1)")
    raise ValueError(f"{value!r} is not a size (bytes, '70GiB', or a fraction of the GPU's memory)")


class GpusParams(Section):
    """How much of each visible GPU the fp16 and int8 variants may use when they load across GPUs.

    `max_memory`: null (every visible GPU, accelerate's own free-memory figure), one share for every visible GPU
    ('70GiB', 0.9, bytes), or a mapping GPU index -> share ({0: 70GiB, 1: 70GiB}; GPUs left out get nothing).
    Setting it on a one-GPU machine caps that GPU too. GPTQ and AWQ keep their backends' own placement."""

    max_memory: int | float | str | dict[int, int | float | str] | None = None

    @field_validator("max_memory")
    @classmethod
    def _shares(cls, value):
        if isinstance(value, dict):
            if not value:
                raise ValueError("an empty mapping gives the model no GPU; leave max_memory null for every GPU")
            for index, share in value.items():
                if index < 0:
                    raise ValueError(f"GPU index {index}: indices start at 0")
                try:
                    parse_gpu_share(share)
                except ValueError as err:
                    raise ValueError(f"GPU {index}: {err}") from None
        elif value is not None:
            parse_gpu_share(value)
        return value

    def shares(self) -> dict[int | str, int | float] | None:
        """The setting parsed: {gpu index: bytes or fraction}, {"all": share}, or None."""
        if self.max_memory is None:
            return None
        if isinstance(self.max_memory, dict):
            return {i: parse_gpu_share(v) for i, v in sorted(self.max_memory.items())}
        return {"all": parse_gpu_share(self.max_memory)}
