"""Where a stage's time goes: its process's wall time beside the seconds spent inside bare library calls.

A stage marks its library calls (`with library_call("lm-eval"):`: quantize, lm-eval, forward passes, soak
rounds, checkpoint loads); each process of a stage, the isolated children included, writes what it spent to
logs/timings/<stage>/<pid>.json when it ends. benchmarks/pipeline_speed.py sets the sum beside the stage's wall
time, so overhead (imports, process starts) and waste (a checkpoint loaded twice) show. logs/ is no DVC output:
these volatile numbers re-run nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from pipelines.core.paths import TIMINGS_DIR

STAGE_ENV = "QUANTGATE_STAGE"  # the stage a process works for; spawned children inherit it
_seconds: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)


def stage_of(args: dict) -> str | None:
    """The name a command's timings go under (`quantize@awq4`, `compare`), from its parsed arguments; None for
    what answers a person (`route lookup`, `ui`)."""
    command = args.get("command")
    if args.get("action") == "lookup" or command in (None, "ui"):
        return None
    target = args.get("candidate") if command == "admit" else args.get("variant")
    return f"{command}@{target}" if command in ("quantize", "admit", "memory", "evaluate") and target else command


def start(stage: str | None) -> None:
    """Name the stage this process (and every process it spawns) works for, forgetting an earlier run's numbers."""
    if stage:
        clear(stage)
        os.environ[STAGE_ENV] = stage


@contextmanager
def library_call(call: str) -> Iterator[None]:
    """Count the seconds inside one bare library call under `call` (several calls of a name add up)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        _seconds[call] += time.perf_counter() - started
        _calls[call] += 1


def process_seconds() -> float:
    """Wall seconds since this process started (the interpreter's start and imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def flush() -> None:
    """Write this process's numbers for its stage (nothing outside a stage); never raises: timing is a side show."""
    stage = os.environ.get(STAGE_ENV)
    if not stage:
        return
    try:
        folder = TIMINGS_DIR / stage.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        row = {"stage": stage, "pid": os.getpid(), "parent": os.getppid(), "ended": time.time(),
               "wall_seconds": round(process_seconds(), 3),
               "library": {k: {"seconds": round(v, 3), "calls": _calls[k]} for k, v in _seconds.items()}}
        tmp = folder / f".{os.getpid()}.tmp"
        tmp.write_text(json.dumps(row, indent=1))
        tmp.replace(folder / f"{os.getpid()}.json")
    except Exception:  # noqa: BLE001 - a full disk or a read-only logs/ must not fail the stage
        pass


def clear(stage: str) -> None:
    """Forget an earlier run's numbers for this stage (a stage writes one set per run)."""
    folder = TIMINGS_DIR / stage.replace("/", "_")
    for old in folder.glob("*.json") if folder.is_dir() else []:
        old.unlink(missing_ok=True)
