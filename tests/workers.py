"""The tests on pytest-xdist workers (scripts/test.sh, docs/testing.md): how many, and in which groups. A group runs on
one worker: the tests that share a costly session fixture (built once, not once per worker; the Ray tests go with
`pipeline_run`'s: they count the machine's raylets, `ray stop --force` stops every cluster on it, and the fan-out tests
compare against that run), else a test's file (a module's fixtures are built once). tests/conftest.py imports the
hooks below, which is how pytest finds them."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

PIPELINE_RUN = "pipeline_run"  # the whole-pipeline run's group, the Ray tests' too: the fan-out tests compare against it
GROUP_OF_FIXTURE = {
    "tests.conftest:pipeline_run": PIPELINE_RUN,
    "tests.tiny_chain:log_evidence": "log_evidence",
    "tests.conftest:direct_checkpoints": "library_checkpoints", "tests.conftest:ct_checkpoints": "library_checkpoints",
}
# The groups that took longest (CI's --durations, docs/testing.md) are handed out first, so that no worker starts a long
# one when the others are done. Seconds under two workers on the 2-core AMD EPYC VM, every fixture built from nothing
# (4787b12's tests; pipeline_run's group, the Ray tests merged in, from f471253's CI); a group not listed keeps its place.
SECONDS_OF_GROUP = {
    PIPELINE_RUN: 1200, "tests/test_mlflow_server.py": 180, "tests/test_mlflow_ui.py": 130, "tests/test_endpoints.py": 115,
    "tests/test_memory.py": 110, "tests/test_memory_attribution.py": 80, "tests/test_gpu_memory_check.py": 80,
    "tests/test_sandbox_token.py": 65, "tests/test_isolation.py": 55, "tests/test_gguf.py": 50, "log_evidence": 45,
    "tests/test_shadow.py": 40,
}
MAX_WORKERS = 4  # every sandboxed program runs as the one uid 65534, and they share its process limit
WORKER_TMP = pytest.StashKey[str]()


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> float:
    """A container's CPU quota in cores (cgroup v2's cpu.max, else v1's CFS quota), inf where none is set: nproc and
    os.cpu_count count the host's cores (and nproc follows OMP_NUM_THREADS)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota, period = ((root / f"cpu/cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))
        except OSError:
            return math.inf
    return int(quota) / int(period) if quota.isdigit() and period.isdigit() and int(period) else math.inf


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (scripts/test.sh): a worker per whole core this process may use (its CPU affinity, a container's
    quota), at most MAX_WORKERS; one process (0) where that is one core. PYTEST_XDIST_AUTO_NUM_WORKERS, as xdist
    documents it, wins."""
    if chosen := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(chosen)
    workers = int(min(MAX_WORKERS, len(os.sched_getaffinity(0)), cgroup_cpus()))
    return workers if workers >= 2 else 0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns `-n N` alone into `--dist load`
def pytest_cmdline_main(config):
    """Workers (`-n`) without a --dist of your own take the groups, the longest first (SECONDS_OF_GROUP, not xdist's
    largest-first)."""
    if config.getoption("numprocesses", None) and config.getoption("dist", None) in ("no", "loadgroup"):
        config.option.dist, config.option.loadscopereorder = "loadgroup", False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """A worker parses the command line anew and would not see the --dist set above: it is told."""
    node.workerinput["quantgate_dist"] = node.config.option.dist


def pytest_configure(config):
    """On a worker: the groups (pytest_configure_node), and a temporary folder of its own (TMPDIR, also for the
    processes it starts), so that a test that checks what a sandbox left behind sees its own worker's leftovers only."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if getattr(config, "workerinput", {}).get("quantgate_dist") == "loadgroup":
        config.option.loadgroup = True
    if worker and not Path(tempfile.gettempdir()).name.startswith("quantgate-tests-"):  # (not again in a child pytest)
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")[:8]  # short: a Unix socket's path below fits 107 bytes
        folder = Path(tempfile.gettempdir()) / f"quantgate-tests-{run}-{worker}"
        folder.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = tempfile.tempdir = config.stash[WORKER_TMP] = str(folder)


def pytest_unconfigure(config):
    if WORKER_TMP in config.stash:
        shutil.rmtree(config.stash[WORKER_TMP], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The scheduler stops a run that would spread the tests ungrouped: two Ray clusters at once (one stopping the
    other's), every whole-pipeline fixture built on every worker. pytest-xdist 3.8 marks a test's group at the end
    of its id (`...::test[param]@group`) and schedules one without it alone; a worker leaves it off where it did not
    see --dist loadgroup, and on pytest 9.2 (pytest-dev/pytest-xdist#1386)."""
    dist = node.config.option.dist
    alone = [i for i in ids if i.rfind("@") <= i.rfind("]")]  # (xdist's own test: an "@" in a parameter is no group)
    if dist != "loadgroup" or alone:
        why = f"--dist {dist}" if dist != "loadgroup" else \
            f"{alone[0]} and {len(alone) - 1} more on {node.gateway.id} have no group (on pytest 9.2: " \
            "pytest-dev/pytest-xdist#1386; install the pinned pytest, pyproject.toml)"
        pytest.exit(f"the tests run on workers only in their groups (--dist loadgroup, tests/workers.py): {why}; "
                    "or run them in one process (-n 0)", returncode=pytest.ExitCode.USAGE_ERROR)


def group_of(item, fixtures: list[str]) -> str:
    """The item's group: its first grouped fixture's (module:name keys), else the Ray tests' (pipeline_run's: the
    fan-out tests compare their runs against it), else its file's."""
    return next((GROUP_OF_FIXTURE[k] for k in fixtures if k in GROUP_OF_FIXTURE), None) or \
        (PIPELINE_RUN if item.get_closest_marker("ray") else item.nodeid.split("::", 1)[0])
