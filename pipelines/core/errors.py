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
                      r"found no NVIDIA driver|(requires|needs) (a )?(CUDA|GPU)|only supports? (CUDA|GPU)|"
                      r"No GPU found|GPU is (needed|required)|No compatible CUDA binary|no kernel image is available",
                      re.IGNORECASE)
_MODEL_FAILURE = re.compile(r"out of memory|\bnan\b|\binf\b", re.IGNORECASE)


class CannotRunHere(Exception):
    """The installed libraries cannot run this checkpoint's format on this machine, as a probe just showed (the
    doctor runs the same probe): 'could not measure', with the remedy, never the model's failure."""

    def __init__(self, reason: str, remedy: str):
        super().__init__(reason)
        self.remedy = remedy


def environment_cause(err: BaseException) -> dict | None:
    """{"cause": "environment", "reason", "remedy"} when `err` says a library, kernel or device is missing on this
    machine, and the machine agrees (the module really cannot be found; CUDA really is unavailable); None when the
    failure is the model's own (any other exception, out of memory and NaN included)."""
    message = f"{type(err).__name__}: {err}".strip()
    if isinstance(err, CannotRunHere):
        return {"cause": ENVIRONMENT, "reason": str(err), "remedy": err.remedy}
    if isinstance(err, ImportError):
        missing = (getattr(err, "name", None) or "").split(".")[0]
        if not missing or _importable(missing):  # a module that is there but fails to import is a bug, not the machine
            return None
        return {"cause": ENVIRONMENT, "reason": f"{missing} cannot be imported here ({message[:300]})",
                "remedy": "install it into quantgate's environment (bash scripts/setup.sh), then check with "
                          "`quantgate doctor`"}
    if _NO_CUDA.search(message) and not _MODEL_FAILURE.search(message) and not _cuda_available():
        return {"cause": ENVIRONMENT, "reason": f"the kernel needs CUDA, which this machine lacks ({message[:300]})",
                "remedy": "run this variant on a CUDA machine (device: cuda), or remove it from params.yaml's variants"}
    return None


def _importable(module: str) -> bool:
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
