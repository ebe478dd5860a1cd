"""Run one function in a fresh spawned process, so a segfault, an OOM kill or a hang cannot stop the caller.

Loading a checkpoint runs code the checkpoint chooses (kernels, quantization libraries): a broken one can
crash the interpreter or never return. Every stage that loads a variant or candidate (quantize, memory,
baseline, evaluate) runs that part here. The child writes its JSON result to a temp file; the parent waits
at most `timeout` seconds, kills what is still running, and turns a missing result into a failure that
names the signal or the timeout. A pool is not used: one that replaces a dead worker never answers.

The child leads its own process group and the kernel kills it when the parent dies (Linux), so nothing it
started outlives the call: at the end the parent SIGKILLs the child, its descendants and its group.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.2  # how often the parent looks for the child's result
EXIT_GRACE_S = 30.0  # after the result is written: time for the child to exit (CUDA teardown) before it is killed


def run_isolated(target: Callable[..., Any] | str, args: tuple, timeout: float, what: str,
                 log_file: str | Path | None = None) -> tuple[Any, str | None]:
    """(target(*args), None) from a spawned process, or (None, why it gave no result).

    target and args must pickle (module-level function, plain data); target's result must be JSON (a tuple
    comes back as a list). A target named "module:function" is imported in the child only, so the caller does not
    pay for the libraries it imports (torch: 2 s). `what` starts the reason: "evaluate awq4 died (killed by SIGSEGV)". With
    `log_file`, the child logs there as the stage does (logs.setup).
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="quantgate-isolated-") as tmp:
        out, raised = Path(tmp) / "result.json", Path(tmp) / "raised.txt"
        proc = ctx.Process(target=_child, args=(target, args, str(out), str(raised), os.getpid(),
                                                str(log_file) if log_file else None))
        proc.start()
        deadline = time.monotonic() + timeout
        try:
            while proc.is_alive() and not out.is_file() and time.monotonic() < deadline:
                proc.join(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if out.is_file():  # written atomically, so complete: let the interpreter exit, within a grace period
                proc.join(EXIT_GRACE_S)
            timed_out = proc.is_alive() and not out.is_file()
        finally:  # also on KeyboardInterrupt: the child is in its own process group, Ctrl-C does not reach it
            _kill_tree(proc)
        if timed_out:
            return None, f"{what} ran past its {timeout:g} s timeout and was killed"
        if out.is_file():  # the work is done: a crash or hang while the interpreter exits does not undo it
            if proc.exitcode != 0:
                logging.getLogger(__name__).warning("%s: result complete, then the process %s on its way out; "
                                                    "the result is kept", what, describe_exit(proc.exitcode))
            return json.loads(out.read_text(encoding="utf-8")), None
        if raised.is_file():
            return None, f"{what} failed: {raised.read_text(encoding='utf-8')}"
        return None, f"{what} died ({describe_exit(proc.exitcode)})"


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: the signal that killed it, or its exit code."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:  # nothing in-process sends it: the kernel's OOM killer (or a person) did
        return f"killed by {name}: out of memory (the kernel's OOM killer) or killed from outside"
    return f"killed by {name}"


def _kill_tree(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL the child, its descendants (also those that left its process group) and its group; reap it."""
    if proc.is_alive():  # only a live child's pid is surely still its own
        family = _descendants(proc.pid)
        for pid in (proc.pid, *family):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # grandchildren left behind by a crash
        os.killpg(proc.pid, signal.SIGKILL)
    proc.join()


def _descendants(root: int) -> list[int]:
    """Every live descendant of `root` (psutil reads /proc; empty where there is none)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel SIGKILLs this process when the stage that started it dies (killed by DVC, say)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child(target: Callable[..., Any], args: tuple, out: str, raised: str, parent: int, log_file: str | None) -> None:
    os.setpgrp()  # a group of its own: the parent kills the group, grandchildren included
    _die_with_parent(parent)
    from pipelines.core import timing
    from pipelines.core.io import atomic_write_text, write_json

    if log_file:
        from pipelines.core import logs

        logs.setup(log_file=Path(log_file))
    try:
        if isinstance(target, str):
            module, name = target.split(":")
            target = getattr(importlib.import_module(module), name)
        result = target(*args)
        timing.flush()  # before the result: the parent kills this process soon after it appears
        write_json(out, result)
    except BaseException as err:
        logging.getLogger().error("isolated %s failed", getattr(target, "__qualname__", target), exc_info=True)
        atomic_write_text(raised, f"{type(err).__name__}: {err}"[:2000])
        raise
