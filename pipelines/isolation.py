"""Run one function in a fresh spawned process, so a segfault, an OOM kill or a hang cannot stop the caller.

Loading a checkpoint runs code the checkpoint chooses (kernels, quantization libraries): a broken one can
crash the interpreter or never return. The child writes its JSON result to a temp file; the parent waits
at most `timeout` seconds, kills what is still running, and turns a missing result into a failure that
names the signal or the timeout. A pool is not used: one that replaces a dead worker never answers.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_isolated(target: Callable[..., dict], args: tuple, timeout: float, what: str) -> tuple[dict | None, str | None]:
    """(target(*args), None) from a spawned process, or (None, why it gave no result)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="quantgate-isolated-") as tmp:
        out = Path(tmp) / "result.json"
        proc = ctx.Process(target=_write_result, args=(target, args, str(out)), daemon=True)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return None, f"{what} ran past its {timeout:g} s timeout and was killed"
        if proc.exitcode != 0 or not out.is_file():
            code = proc.exitcode
            cause = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
            return None, f"{what} died ({cause})"
        return json.loads(out.read_text(encoding="utf-8")), None


def _write_result(target: Callable[..., dict], args: tuple, out: str) -> None:
    from pipelines.io import write_json

    write_json(out, target(*args))
