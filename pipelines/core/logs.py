"""Console output a person can read; everything third-party libraries say goes to a log file.

Quantization and evaluation libraries print import warnings (torchao's missing CUDA kernels),
deprecation banners (autoawq) and their own progress bars. The console shows quantgate's own
messages and progress bars; the full story is kept in `logs/quantgate.log`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from pipelines.core.paths import LOG_FILE

current_log_file = LOG_FILE  # where setup() sent the log; child processes log to the same file

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


def apply_library_env() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


# Commands whose own process imports no torch (their models load in isolated children, or never): importing it
# only to take back its console handlers would cost each of them 2 s (a no-op `quantgate repro` included).
NO_TORCH_COMMANDS = {"route lookup", "repro", "fanout", "quantize", "memory", "memory-report", "baseline", "evaluate",
                     "compare", "route", "profile"}


def setup(log_file: Path = LOG_FILE, verbose: bool = False, libraries: bool = True) -> None:
    """Route quantgate's messages to the console and every logger's messages to `log_file`.

    libraries=False skips importing torch and transformers to take back their console handlers: for
    commands that never import them (`route lookup`).
    """
    global current_log_file
    current_log_file = log_file
    apply_library_env()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_file, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    file_handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    for old in root.handlers:  # a second setup in one process (tests) must not leak the first file handle
        if isinstance(old, logging.FileHandler):
            old.close()
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
    if libraries:
        import torch  # noqa: F401 - torch installs console handlers on import; import it now to take them back

        quiet_libraries()


def quiet_libraries() -> None:
    """Send libraries that install their own console handlers through the root (file) handler."""
    for name in ("transformers", "torchao", "gptqmodel", "logbar", "awq", "tokenicer", "defuser", "datasets", "lm-eval", "lm_eval", "mlflow",
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


class _LogWriter(io.TextIOBase):
    """A text stream that sends each line it receives to a logger (for libraries that print)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.buffer = ""
        self.emitting = threading.local()  # set while this thread's logger call runs: a handler writing to
        # the redirected sys.stderr (a library's logging.basicConfig() inside `library_output`) must not loop

    def write(self, text: str) -> int:
        if getattr(self.emitting, "on", False):
            return sys.__stderr__.write(text) if sys.__stderr__ else len(text)
        self.buffer += text.replace("\r", "\n")
        *lines, self.buffer = self.buffer.split("\n")
        self.emitting.on = True
        try:
            for line in lines:
                if line.strip():
                    self.logger.info(line.rstrip())
        finally:
            self.emitting.on = False
        return len(text)

    def flush(self) -> None:
        if self.buffer.strip() and not getattr(self.emitting, "on", False):
            line, self.buffer = self.buffer.rstrip(), ""
            self.write(line + "\n")


@contextlib.contextmanager
def library_output(name: str) -> Iterator[None]:
    """Send what a library prints (banners, its own progress bars) to the log file, not the console.

    Python-level only: sys.stdout and sys.stderr are swapped. quantgate's own progress bars write
    to sys.__stderr__ (see `progress`), so they stay visible.
    """
    writer = _LogWriter(logging.getLogger(f"lib.{name}"))
    with contextlib.redirect_stdout(writer), contextlib.redirect_stderr(writer):
        try:
            yield
        finally:
            writer.flush()
            quiet_libraries()  # a library imported inside may have added console handlers
            _drop_handlers_on(writer)


def _drop_handlers_on(stream) -> None:
    """Remove logging handlers a library bound to `stream` (logging.basicConfig() while it was sys.stderr):
    they would outlive the block and copy every later log line into it."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in [h for h in logger.handlers if getattr(h, "stream", None) is stream]:
            logger.removeHandler(handler)


def progress(iterable=None, **kwargs):
    """quantgate's progress bar: tqdm on the real stderr, so redirected library output cannot hide it."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.__stderr__, dynamic_ncols=True, **kwargs)
