"""The floor plan: top-level modules of pipelines/ are stages and commands, siblings that never import each other;
sub-packages are the shared floors below them, which never import a stage; cli.py only dispatches."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from pipelines import cli
from tests.conftest import ROOT

MAX_LINES = 400


def violations(package: Path) -> list[str]:
    """Every import that breaks the layering, as `file: imports module (why)`."""
    top = {p.stem for p in package.glob("*.py")} - {"__init__"}
    found = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")
        is_stage = path.parent == package and path.stem not in ("__init__", "cli")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level:  # lineage.stage_code follows absolute imports only
                found.append(f"{path.relative_to(package.parent)}: relative import (write it as `from {package.name}...`)")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package.name:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
                names = [str(node.args[0].value)]  # importlib.import_module("pipelines.x"): a hidden import
            for name in names:
                parts = name.split(".")
                if len(parts) != 2 or parts[0] != package.name or parts[1] not in top or name == module:
                    continue
                if path.stem == "cli" and path.parent == package:
                    continue  # cli names its verbs as strings; it imports no stage
                why = "a stage imports another stage" if is_stage else "a shared module imports a stage"
                found.append(f"{path.relative_to(package.parent)}: imports {name} ({why})")
    return found


def test_no_stage_imports_another_and_no_floor_imports_a_stage():
    assert violations(ROOT / "pipelines") == []


def test_the_contract_catches_both_kinds_of_violation(tmp_path):
    package = tmp_path / "pipelines"
    (package / "core").mkdir(parents=True)
    for path in ("__init__.py", "core/__init__.py", "cli.py"):
        (package / path).write_text("")
    (package / "compare.py").write_text("from pipelines.core import io\n")
    (package / "route.py").write_text("def main():\n    from pipelines.compare import main as other\n")
    (package / "core" / "io.py").write_text("import pipelines.route\n")
    (package / "core" / "logs.py").write_text("import importlib\nstage = importlib.import_module('pipelines.compare')\n")
    (package / "core" / "paths.py").write_text("from . import io\n")
    assert violations(package) == [
        "pipelines/core/io.py: imports pipelines.route (a shared module imports a stage)",
        "pipelines/core/logs.py: imports pipelines.compare (a shared module imports a stage)",
        "pipelines/core/paths.py: relative import (write it as `from pipelines...`)",
        "pipelines/route.py: imports pipelines.compare (a stage imports another stage)",
    ]


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for d in ("pipelines", "scripts", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_cli_only_parses_and_dispatches():
    assert len((ROOT / "pipelines" / "cli.py").read_text().splitlines()) <= 150
    tree = ast.parse((ROOT / "pipelines" / "cli.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("pipelines")} <= {"pipelines.core", "pipelines.core.errors"}


def test_every_import_of_the_package_names_something_that_exists():
    """A name moved to another module leaves no import behind, in the code, the tests, the scripts or benchmarks
    (a benchmark is loaded only when someone runs it: nothing else would notice)."""
    missing = []
    for path in sorted(p for d in ("pipelines", "tests", "scripts", "benchmarks", "eval") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipelines"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} has no {alias.name}")
    assert missing == []


VERB_LINES = [
    ["reference"], ["calibrate"], ["quantize", "int8"], ["quantize", "int8", "--failed-because", "x"],
    ["admit", "awq4"], ["memory", "int8", "--inject-leak-bytes", "8", "--inject-leak-rounds", "2"], ["memory-report"],
    ["baseline"], ["evaluate", "int8"], ["compare"], ["shadow"], ["route"], ["route", "lookup", "hi", "--context-tokens", "5"],
    ["record"], ["fanout", "--address", "auto", "--report", "r.json"], ["repro", "--sequential"], ["gate", "--variant", "int8", "--promote", "--audit", "--audit-seed", "5"],
    ["audit", "--variant", "int8", "--seed", "3"],
    ["fetch", "production", "--model", "m", "--dest", "d"], ["ui", "--port", "5001"], ["doctor", "--params", "p.yaml"],
    ["profile", "smollm2"],
]


def test_every_verb_of_the_cli_is_checked_below():
    assert {"route lookup" if argv[:2] == ["route", "lookup"] else argv[0] for argv in VERB_LINES} == set(cli.VERBS)


@pytest.mark.parametrize("argv", VERB_LINES)
def test_every_verb_reaches_an_entry_function_that_takes_its_options(argv):
    function, kwargs = cli.entry(cli.build_parser().parse_args(argv))
    assert callable(function) and function.__module__.startswith("pipelines.")
    inspect.signature(function).bind(**kwargs)  # raises TypeError when an option has no parameter
    assert set(kwargs) >= {p for p, v in inspect.signature(function).parameters.items() if v.default is v.empty}
