"""The quick tier (`bash scripts/test.sh -m quick`, docs/testing.md): every test that needs no whole-pipeline run, Ray
cluster, server or browser, and still a test of every module of pipelines/ (a module only the slow tests reach would
break unseen by whoever runs the quick tier twenty times a day)."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from pipelines import cli
from pipelines.core.lineage import _imported, _module_file
from tests import workers
from tests.conftest import ROOT, TIER_OF_FIXTURE


def own_run() -> dict[str, str]:
    """The environment for a pytest of its own: not this worker's, nor options set for this run (PYTEST_ADDOPTS)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def collected(marks: str) -> list[str]:
    """The node ids `pytest -m <marks>` runs, as pytest itself selects them."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marks,
                           "-p", "no:cacheprovider"], cwd=ROOT, env=own_run(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def _is_quantgate(node: ast.expr) -> bool:
    """"quantgate", or tool("quantgate") (the console script beside this Python)."""
    return (isinstance(node, ast.Constant) and node.value == "quantgate") or (
        isinstance(node, ast.Call) and bool(node.args) and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "quantgate")


def verbs_run(tree: ast.AST) -> set[str]:
    """The entry modules of the CLI verbs code runs: `cli.main(["compare", ...])`, or a command line with
    "quantgate" (or tool("quantgate")) just before the verb."""
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "main"
                and getattr(node.func.value, "id", None) == "cli" and node.args and isinstance(node.args[0], ast.List)):
            words = node.args[0].elts[:1]
        elif isinstance(node, (ast.List, ast.Tuple)):
            words = [b for a, b in zip(node.elts, node.elts[1:]) if _is_quantgate(a)]
        else:
            continue
        found |= {cli.VERBS[w.value].split(":")[0] for w in words
                  if isinstance(w, ast.Constant) and w.value in cli.VERBS}
    return found


class SourceFile:
    """A module under tests/: its top-level definitions, and what each name its imports bind stands for."""

    def __init__(self, path: Path):
        self.path = path
        tree = ast.parse(path.read_text(encoding="utf-8"))
        self.defs: dict[str, ast.AST] = {}  # function, class or assigned constant -> its node
        self.bound: dict[str, tuple] = {}  # name -> ("module", pipelines module) or ("helper", tests file, name)
        self.autouse: list[str] = []  # fixtures every test of the file gets
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and "autouse=True" in "".join(map(ast.unparse, node.decorator_list)):
                self.autouse.append(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        self.defs[target.id] = node
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipelines":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    self.bound[a.asname or a.name] = ("module", sub if _module_file(sub, ROOT) else node.module)
            elif isinstance(node, ast.Import):  # import pipelines.audit as aud
                for a in node.names:
                    if a.name.split(".")[0] == "pipelines":
                        self.bound[a.asname or a.name] = ("module", a.name)
            elif isinstance(node, ast.ImportFrom) and node.module == "tests":  # from tests import llama_server
                for a in node.names:
                    self.bound[a.asname or a.name] = ("helper", ROOT / "tests" / f"{a.name}.py", None)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                helper = ROOT.joinpath(*node.module.split(".")).with_suffix(".py")
                for a in node.names:
                    self.bound[a.asname or a.name] = ("helper", helper, a.name)


@cache
def source_file(path: Path) -> SourceFile:
    return SourceFile(path)


def reached(path: Path, name: str, seen: set | None = None, nodes: list | None = None) -> set[str]:
    """The pipelines modules definition `name` of `path` reaches: what its body imports, names or runs as a CLI verb
    or an isolated child's target, through the functions, constants and fixtures (its parameters) it uses, in its
    file, in conftest.py (the fixtures it imports too) and in the helpers under tests/ it imports. `nodes` collects
    those definitions."""
    seen = set() if seen is None else seen
    if (path, name) in seen:
        return set()
    seen.add((path, name))
    if name is None:  # a whole helper module (`from tests import llama_server`): everything in it
        return set().union(*(reached(path, n, seen, nodes) for n in source_file(path).defs))
    here, conftest = source_file(path), source_file(ROOT / "tests" / "conftest.py")
    node = here.defs.get(name) or conftest.defs.get(name)
    if node is None:  # a fixture conftest.py imports (tests/tiny_chain.py's) is followed to its home
        binding = conftest.bound.get(name)
        return reached(binding[1], binding[2], seen, nodes) if binding and binding[0] == "helper" else set()
    if nodes is not None:
        nodes.append(node)
    home = path if name in here.defs else conftest.path
    found = _imported([node], ROOT) | verbs_run(node)
    assigned = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - assigned
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a test's or fixture's parameters: its fixtures
        used |= {a.arg for a in node.args.args}
    used |= {n.args[0].value for n in ast.walk(node)  # request.getfixturevalue("x"), @pytest.mark.usefixtures("x")
             if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in ("getfixturevalue", "usefixtures")
             and n.args and isinstance(n.args[0], ast.Constant)}
    for word in used - {name}:
        binding = source_file(home).bound.get(word)
        if binding and binding[0] == "module":
            found.add(binding[1])
        elif binding:
            found |= reached(binding[1], binding[2], seen, nodes)
        else:
            found |= reached(home, word, seen, nodes)
    return found


def _word(node: ast.expr) -> str | None:
    """"ray", tool("ray") or tasks.dvc_bin(): the word a command line starts with."""
    if isinstance(node, ast.Call) and not node.args:
        callee = getattr(node.func, "attr", getattr(node.func, "id", ""))
        return callee.removesuffix("_bin") or None
    if isinstance(node, ast.Call):
        node = node.args[0]
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def heavy_starts(node: ast.AST) -> set[str]:
    """What in `node` starts something a quick test must not: a Ray node, llama.cpp's server, the MLflow server script,
    Chromium, or a whole `dvc repro`."""
    found = set()
    for n in ast.walk(node):
        called = isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) in (
            "run", "Popen", "check_call", "check_output")  # a command line run, not one compared with
        if called and n.args and isinstance(n.args[0], (ast.List, ast.Tuple)):
            line = n.args[0].elts
            pairs = {(_word(a), _word(b)) for a, b in zip(line, line[1:])}
            found |= {" ".join(p) for p in pairs & {("ray", "start"), ("dvc", "repro"), ("quantgate", "repro")}}
        elif isinstance(n, ast.Call) and (callee := getattr(n.func, "attr", getattr(n.func, "id", None))) in (
                "serving", "sync_playwright"):  # llama_server.serving(...) too
            found.add(callee)
        elif isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("script", "dvc") and n.args and (
                _word(n.args[0]) == "start" or (isinstance(n.args[0], ast.List) and n.args[0].elts
                                               and _word(n.args[0].elts[0]) == "repro")):
            found.add(f"{n.func.id} {'start' if _word(n.args[0]) == 'start' else 'repro'}")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and "private_local_cluster()" in n.value:
            found.add("a private Ray cluster")
    return found


def every_module() -> set[str]:
    return {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in (ROOT / "pipelines").rglob("*.py")
            if p.name != "__init__.py"}


def test_every_module_of_pipelines_is_reached_by_a_quick_test_and_none_starts_what_the_other_tiers_need():
    quick = collected("quick")
    assert len(quick) > 500
    tests = {(ROOT / node.split("::")[0], re.sub(r"\[.*$", "", node.split("::")[-1])) for node in quick}
    modules, heavy = set(), {}
    for path, name in sorted(tests):
        nodes = []
        modules |= reached(path, name, nodes=nodes)
        for fixture in source_file(path).autouse:
            modules |= reached(path, fixture, nodes=nodes)
        assert nodes, f"{path.name}::{name}: not a top-level test function this check can follow"
        slow_fixtures = {key.split(":")[1] for key in TIER_OF_FIXTURE} & {getattr(n, "name", None) for n in nodes}
        assert not slow_fixtures, f"{path.name}::{name} reaches {slow_fixtures} without being marked"
        if path.name != "test_tiers.py" and (starts := set().union(*(heavy_starts(n) for n in nodes))):
            heavy[f"{path.name}::{name}"] = sorted(starts)
    assert sorted(every_module() - modules) == []
    assert heavy == {}  # mark it (or use a fixture in conftest.TIER_OF_FIXTURE): it belongs to a slower tier


def test_only_what_a_test_uses_counts(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "from pipelines import audit, compare, memory_report\nfrom pipelines.core import io\n"
        "from tests.sample_log_helpers import P\n"
        "PLAN = io.read_json\n"
        "def helper():\n    run_isolated('pipelines.evaluation.harness:evaluate_variant')\n"
        "def test_a(tmp_path):\n    helper(); compare.main(); P; PLAN\n"
        "    subprocess.run([tool('quantgate'), 'route', 'lookup']); subprocess.run(['quantgate', '-v', 'shadow'])\n"
        "def test_b():\n    audit.main()\n"
        "import pipelines.fetch as fetched\n@pytest.fixture\ndef made():\n    fetched.main\n"
        "def test_c(request):\n    request.getfixturevalue('made'); memory_report = {}; memory_report.get('x')\n"
        "def test_d(tiny_variants):\n    pass\n")
    assert reached(tmp_path / "test_x.py", "test_c") == {"pipelines.fetch"}  # a local dict is not the stage
    # a fixture conftest.py imports (tests/tiny_chain.py's), followed through the fixtures it is built from
    assert {"pipelines.quantize", "pipelines.calibrate", "pipelines.reference"} <= reached(tmp_path / "test_x.py",
                                                                                          "test_d")
    got = reached(tmp_path / "test_x.py", "test_a")
    assert {"pipelines.evaluation.harness", "pipelines.compare", "pipelines.core.io", "pipelines.route",
            "pipelines.core.params_sections"} <= got  # P is EvaluateParams(...) in the helper
    assert "pipelines.audit" not in got and "pipelines.shadow" not in got  # test_b's; a flag came between


def test_what_starts_a_cluster_a_server_a_browser_or_a_pipeline_is_seen():
    code = ast.parse("subprocess.run([tool('ray'), 'start', '--head'])\nwith serving(f, 'm', log):\n    pass\n"
                     "script('start', '--dir', d)\ndvc(['repro'], repo)\nrun([tool('dvc'), 'repro'], repo)\n"
                     "CODE = 'ray_auth.private_local_cluster()'\nsubprocess.run([tool('ray'), 'stop'])\n"
                     "script('stop')\ndvc(['status'], repo)\nassert argv == ['dvc', 'repro']\n"
                     "llama_server.serving(f)\nsubprocess.run([tasks.dvc_bin(), 'repro'])\n"
                     "subprocess.run([tool('quantgate'), 'repro'])\n")
    assert heavy_starts(code) == {"ray start", "serving", "script start", "dvc repro", "a private Ray cluster",
                                  "quantgate repro"}


def test_every_fixture_that_sets_a_tier_or_a_group_exists_and_every_timed_group_is_one():
    """A fixture renamed or moved would leave its tests in the quick tier, unseen, or split its users over the workers
    (each building it); a timed group that is no group any more would lose its early start."""
    import importlib

    for key in {**TIER_OF_FIXTURE, **workers.GROUP_OF_FIXTURE}:
        module, name = key.split(":")
        assert callable(getattr(importlib.import_module(module), name, None)), key
    for group in workers.SECONDS_OF_GROUP:
        assert group in workers.GROUP_OF_FIXTURE.values() or (ROOT / group).is_file(), group


def test_the_workers_run_a_group_on_one_worker_and_stop_where_the_groups_are_gone(request):
    """`-n 2` alone (no --dist) must group on the workers, not only on the scheduler: a worker parses the command line
    anew, and a test whose id has no group mark is scheduled alone (two Ray clusters at once, every fixture twice)."""
    from types import SimpleNamespace

    tests = ["tests/test_tiers.py::test_only_what_a_test_uses_counts",
             "tests/test_tiers.py::test_what_starts_a_cluster_a_server_a_browser_or_a_pipeline_is_seen",
             "tests/test_layout.py::test_the_contract_catches_both_kinds_of_violation",
             "tests/test_layout.py::test_cli_only_parses_and_dispatches"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "--color=no", "-p", "no:cacheprovider",
                           *tests], cwd=ROOT, env=own_run(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*PASSED (\S+)", done.stdout, re.M)
    assert sorted(nodeid for _, nodeid in ran) == sorted(f"{t}@{t.split('::')[0]}" for t in tests), done.stdout
    for file in ("tests/test_tiers.py", "tests/test_layout.py"):
        assert len({worker for worker, nodeid in ran if nodeid.startswith(file)}) == 1, done.stdout

    # the scheduler's stop, which this run (grouped) never reaches: registered, and stopping on what xdist runs alone
    stop = request.config.hook.pytest_xdist_node_collection_finished
    assert any(h.function is workers.pytest_xdist_node_collection_finished for h in stop.get_hookimpls())

    def node(dist):
        return SimpleNamespace(config=SimpleNamespace(option=SimpleNamespace(dist=dist)), gateway=SimpleNamespace(id="gw1"))
    grouped = [f"{tests[0]}@tests/test_tiers.py", "tests/test_calibrate.py::test_x[a@b.org]@tests/test_calibrate.py"]
    workers.pytest_xdist_node_collection_finished(node("loadgroup"), grouped)  # goes on
    for dist, ids, said in [("loadgroup", tests[:1], "test_only_what_a_test_uses_counts and 0 more on gw1"),
                            ("loadgroup", ["tests/test_calibrate.py::test_x[a@b.org]"], r"test_x\[a@b.org\] and 0"),
                            ("load", grouped, "--dist load")]:
        with pytest.raises(pytest.exit.Exception, match=said):
            workers.pytest_xdist_node_collection_finished(node(dist), ids)


def test_as_many_workers_as_whole_cores_the_process_may_use(tmp_path, monkeypatch):
    """`-n auto`: a container's CPU quota (cgroup v2 or v1) counts, not the host's cores; at most MAX_WORKERS; one
    process on one core."""
    for name, text, cores in [("cpu.max", "max 100000\n", math.inf), ("cpu.max", "150000 100000\n", 1.5),
                              ("cpu/cpu.cfs_quota_us", "-1\n", math.inf), ("cpu/cpu.cfs_quota_us", "300000\n", 3.0)]:
        root = tmp_path / name.replace("/", "-") / text.split()[0]
        (root / "cpu").mkdir(parents=True)
        (root / name).write_text(text)
        (root / "cpu/cpu.cfs_period_us").write_text("100000\n")
        assert workers.cgroup_cpus(root) == cores, (name, text)
    assert workers.cgroup_cpus(tmp_path / "none") == math.inf
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    for quota, expected in [(math.inf, workers.MAX_WORKERS), (3.0, 3), (2.5, 2), (1.5, 0)]:
        monkeypatch.setattr(workers, "cgroup_cpus", lambda q=quota: q)
        assert workers.pytest_xdist_auto_num_workers(None) == expected, quota
