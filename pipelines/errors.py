"""The one exception type that reaches the user as a one-line message instead of a traceback, and the line
between "this machine could not measure" and "the model failed"."""

from __future__ import annotations

import re


class QuantgateError(Exception):
    """Bad input or a failed precondition; the message names the file, line or key and what was expected."""


# A measurement that did not happen because of the machine, not the model: these make a row `inconclusive`
# (the gate exits 2 with the remedy), never `fail`. Crashes, NaN, out-of-memory and timeouts are the model's.
ENVIRONMENT = "environment"
_NO_CUDA = re.compile(r"CUDA is not available|Torch not compiled with CUDA|No CUDA GPUs are available|"
                      r"found no NVIDIA driver|(requires|needs) (a )?(CUDA|GPU)|only supports? (CUDA|GPU)", re.IGNORECASE)
_OUT_OF_MEMORY = re.compile(r"out of memory", re.IGNORECASE)


def environment_cause(err: BaseException) -> dict | None:
    """{"cause": "environment", "reason", "remedy"} when `err` says a library, kernel or device is missing on this
    machine; None when the failure is the model's own (any other exception, out of memory included)."""
    message = f"{type(err).__name__}: {err}".strip()
    if isinstance(err, ImportError):
        missing = getattr(err, "name", None) or "a library"
        return {"cause": ENVIRONMENT, "reason": f"{missing} cannot be imported here ({message[:300]})",
                "remedy": f"install it into quantgate's environment (bash scripts/setup.sh), then check with "
                          f"`quantgate doctor`"}
    if _NO_CUDA.search(message) and not _OUT_OF_MEMORY.search(message):
        return {"cause": ENVIRONMENT, "reason": f"the kernel needs CUDA, which this machine lacks ({message[:300]})",
                "remedy": "run this variant on a CUDA machine (device: cuda), or remove it from params.yaml's variants"}
    return None
