"""Console output a person can read; everything third-party libraries say goes to a log file.

Quantization and evaluation libraries print import warnings (torchao's missing CUDA kernels),
deprecation banners (autoawq) and their own progress bars. The console shows quantgate's own
messages and progress bars; the full story is kept in `logs/quantgate.log`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

LOG_FILE = Path("logs/quantgate.log")

# Set before any library import: quieter libraries, and the settings they read once at import.
QUIET_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "warning",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_POSITION": "0",
    # GPTQModel refuses to start on a 2-core machine without this (see docs/stack.md).
    "GPTQMODEL_CPU_WORKERS": str(max(2, os.cpu_count() or 2)),
}


def setup(log_file: Path = LOG_FILE, verbose: bool = False) -> None:
    """Route quantgate's messages to the console and every logger's messages to `log_file`."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_file, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    file_handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    root.handlers[:] = [file_handler]
    root.setLevel(logging.INFO)

    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(message)s"))
    console.setLevel(logging.DEBUG if verbose else logging.INFO)
    ours = logging.getLogger("pipelines")
    ours.handlers[:] = [console]
    ours.setLevel(logging.DEBUG if verbose else logging.INFO)
    ours.propagate = True  # also into the file

    logging.captureWarnings(True)
    warnings.simplefilter("default")
    import torch  # noqa: F401 - torch installs console handlers on import; import it now to take them back

    quiet_libraries()


def quiet_libraries() -> None:
    """Send libraries that install their own console handlers through the root (file) handler."""
    for name in ("transformers", "torchao", "gptqmodel", "awq", "datasets", "lm-eval", "lm_eval", "mlflow",
                 "accelerate", "bitsandbytes", "torch", "optimum", "urllib3", "filelock", "httpx"):
        lib = logging.getLogger(name)
        lib.handlers[:] = []
        lib.propagate = True
    try:
        import transformers.utils.logging as tlog

        tlog.disable_default_handler()
        tlog.enable_propagation()
        tlog.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        pass
