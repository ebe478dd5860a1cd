"""`quantgate doctor`: what the run params.yaml configures needs on this machine, checked in seconds, before any
model work (the convention of `flutter doctor` / `brew doctor`). scripts/run.sh runs it before `dvc repro`.

`run_checks()` returns one `Check` per thing the run needs: params.yaml, the code probes' sandbox, torch and the
device, each quantization backend the variants name and its kernel on this device, the MLflow tracking store, the
model, disk for the checkpoints, dvc. A `fail` is something that would keep the run from giving a verdict (or
would make it give one for the wrong reason, as a sandbox that refuses the code probes does); `warn` is worth
knowing but does not stop it. The checks themselves live in pipelines/diagnose/; this module runs them in the
order the run needs them and prints the table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.diagnose.check import FAIL, OK, WARN, Check, guarded
from pipelines.diagnose.devices import backend_checks, compressed_tensors_check, torch_checks
from pipelines.diagnose.model import disk_check, model_check
from pipelines.diagnose.pools import pools_check
from pipelines.diagnose.sandbox import sandbox_check
from pipelines.diagnose.tools import dvc_check, endpoint_check, mlflow_check


def run_checks(params_path: str | Path = "params.yaml") -> list[Check]:
    """Every check, in the order the run needs them. Never raises: a check that breaks is a `fail` row saying how."""
    from pipelines.core.params import load_params

    checks: list[Check] = []
    params = None
    try:
        params = load_params(params_path)
        checks.append(Check("params", OK, f"{params_path}: model {params.model}, device {params.device}, "
                                          f"variants {', '.join(params.variants)}"
                                          + (f", candidates {', '.join(params.candidates)}" if params.candidates else "")))
    except QuantgateError as err:
        checks.append(Check("params", FAIL, str(err), "fix that key (docs/params.md); the checks below that need "
                                                      "params.yaml are skipped"))
    checks.append(guarded("sandbox", sandbox_check, params))
    device, torch_rows = torch_checks(params)
    checks += torch_rows
    if params is not None:
        checks += backend_checks(params, device)
        checks.append(guarded("compressed-tensors", compressed_tensors_check, params, device))
        checks.append(guarded("model", model_check, params))
        checks.append(guarded("disk", disk_check, params))
        checks.append(guarded("pools", pools_check, params))
        checks += [guarded(f"endpoint {n}", endpoint_check, n, c.endpoint.model_dump())
                   for n, c in params.candidates.items() if c.endpoint is not None]
        if params.baseline.endpoint is not None:  # fp16 evaluated where it is served (baseline.source: endpoint)
            checks.append(guarded("endpoint fp16", endpoint_check, "fp16", params.baseline.endpoint.model_dump(),
                                  "baseline"))
    checks.append(guarded("mlflow", mlflow_check))
    checks.append(guarded("dvc", dvc_check))
    return checks


def exit_code(checks: list[Check]) -> int:
    """0 when every check is ok or warn; 1 when anything would keep the run from giving a verdict."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def summary(checks: list[Check], seconds: float) -> str:
    fails = [c.name for c in checks if c.status == FAIL]
    warns = [c.name for c in checks if c.status == WARN]
    if fails:
        return (f"quantgate doctor: {len(fails)} of {len(checks)} checks fail ({', '.join(fails)}): the run could not "
                f"give a verdict; fix them first (exit 1; checks took {seconds:.1f} s)")
    return (f"quantgate doctor: {len(checks) - len(warns)} of {len(checks)} checks ok"
            + (f", {len(warns)} warning(s) ({', '.join(warns)})" if warns else "")
            + f": the run can give a verdict (checks took {seconds:.1f} s)")


def plain_table(checks: list[Check]) -> str:
    """Aligned columns, a remedy on its own line under the row it belongs to."""
    name_w = max(len("check"), *(len(c.name) for c in checks))
    lines = [f"{'check':<{name_w}}  status  detail"]
    for c in checks:
        lines.append(f"{c.name:<{name_w}}  {c.status.upper() if c.status == FAIL else c.status:<6}  {c.detail}")
        if c.remedy and c.status != OK:
            lines.append(f"{'':<{name_w}}  {'':<6}  -> {c.remedy}")
    return "\n".join(lines)


def print_table(checks: list[Check], seconds: float, file=None) -> None:
    """A rich table on a terminal when rich is installed; plain aligned columns otherwise (pipes, logs, tests)."""
    file = file or sys.stdout
    if file.isatty() and importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title="quantgate doctor", title_justify="left")
        for column in ("check", "status", "detail", "remedy"):
            table.add_column(column, overflow="fold")
        style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
        for c in checks:  # Text, not markup: details quote paths, errors and lists in brackets
            table.add_row(Text(c.name), Text(c.status, style=style[c.status]), Text(c.detail),
                          Text(c.remedy if c.status != OK else ""))
        console = Console(file=file, highlight=False)
        console.print(table)
        console.print(Text(summary(checks, seconds), style="bold red" if exit_code(checks) else ""))
        return
    print(plain_table(checks), file=file)
    print(summary(checks, seconds), file=file, flush=True)


def main(params: str = "params.yaml") -> int:
    """`quantgate doctor`: what the configured run needs on this machine, as a table; exit 1 when the run could not
    give a verdict."""
    import time

    started = time.perf_counter()
    checks = run_checks(params)
    print_table(checks, time.perf_counter() - started)
    return exit_code(checks)
