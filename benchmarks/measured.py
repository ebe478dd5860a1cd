"""Where a benchmark writes the numbers the docs quote: docs/measured/<benchmark>.json.

Every benchmark whose numbers README.md or docs/*.md quote calls `record(...)` at the end of a run. The file
holds the date, the machine, the command line, the commit it ran on and the measured numbers; the docs' number
blocks are rendered from it by `python scripts/docs_numbers.py` (docs/measured/README.md). A run with
`--no-record` prints only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "docs" / "measured"


def add_arguments(parser: argparse.ArgumentParser, name: str, default: bool = True) -> None:
    """--record PATH (default docs/measured/<name>.json) and --no-record."""
    parser.add_argument("--record", type=Path, default=MEASURED / f"{name}.json" if default else None,
                        help=f"write the measured numbers here (default: docs/measured/{name}.json"
                             f"{'' if default else ', only when given'})")
    parser.add_argument("--no-record", dest="record", action="store_const", const=None,
                        help="print only; leave docs/measured/ alone")


def machine() -> dict:
    """What ran it: cores, CPU model, GPU (when torch sees one), OS, Python, torch."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpus": os.cpu_count(), "cpu": cpu, "os": platform.platform(terse=True), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        load = os.getloadavg()[0]
        info["load_average_at_end"] = round(load, 2)
    except OSError:
        pass
    return info


def commit() -> str | None:
    """The checkout's commit, `+dirty` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


STARTED_ON = commit()  # when the benchmark imports this module, i.e. as it starts


def command_line() -> str:
    """The command as it was typed, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join([".venv/bin/python", str(script), *sys.argv[1:]])


def record(path: Path | None, name: str, results: dict, **extra) -> None:
    """Write `results` with the date, machine, command and commit to `path` (atomically); nothing when None. The
    commit is the one the benchmark started on (`STARTED_ON`), so a checkout edited during an hour-long run does not
    make the record name code that did not run; a benchmark that copies the code later passes `commit=` itself."""
    if path is None:
        return
    data = {"benchmark": f"benchmarks/{name}.py", "date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
            "command": command_line(), "commit": STARTED_ON, "machine": machine(), **extra, "results": results}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    os.replace(tmp, path)
    print(f"recorded in {path} (then: python scripts/docs_numbers.py)")
