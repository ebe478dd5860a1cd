"""A checkpoint cannot stop the pipeline: crashes, OOM kills and hangs end as that variant's recorded failure.

Real processes throughout: run_isolated with targets that really segfault, are really SIGKILLed or really
hang, then the stages (`quantgate quantize|baseline|evaluate`) on the tests' tiny model, whose worker process
is killed from outside the way the kernel's OOM killer does it, or runs past a 1 s timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.core.isolation import run_isolated

ROOT = Path(__file__).resolve().parents[1]
QUANTGATE = [sys.executable, "-m", "pipelines.cli"]
OOM = "killed by SIGKILL: out of memory (the kernel's OOM killer) or killed from outside"


# ------------------------------------------------------------------ targets (module level: the child imports them)

def segfault() -> dict:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a broken kernel would
    return {}


def oom_killed() -> dict:
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer sends
    return {}


def start_grandchildren(pid_file: str) -> list[int]:
    """Two `sleep`s: one in the worker's process group, one that left it (a new session, like the code sandbox)."""
    procs = [subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"], start_new_session=True)]
    Path(pid_file).write_text(json.dumps([p.pid for p in procs]))
    return [p.pid for p in procs]


def hang_with_grandchildren(pid_file: str) -> dict:
    start_grandchildren(pid_file)
    time.sleep(600)
    return {}


def segfault_with_grandchild(pid_file: str) -> dict:
    Path(pid_file).write_text(json.dumps([subprocess.Popen(["sleep", "600"]).pid]))
    return segfault()


def boom() -> dict:
    raise ValueError("boom in the worker")


def pair(a: int) -> tuple[dict, list[int]]:
    return {"a": a, "pid": os.getpid()}, [a, a + 1]


def done_then_crash_on_exit() -> dict:
    """The work finishes, then the interpreter segfaults on its way out (a CUDA or kernel teardown)."""
    import atexit
    import ctypes

    atexit.register(ctypes.string_at, 0)
    return {"done": True}


def done_then_hang_on_exit() -> dict:
    import atexit

    atexit.register(time.sleep, 600)
    return {"done": True}


# ------------------------------------------------------------------ helpers

def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie nobody reaped has stopped running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone(pids: list[int], wait: float = 5.0) -> bool:
    deadline = time.monotonic() + wait
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def processes(field: int, value: int) -> list[int]:
    """Running processes whose /proc stat field (after the name: 1 ppid, 2 process group) equals value."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[field]) == value and fields[0] != "Z":
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def isolated_worker(stage: subprocess.Popen, ready: bool = True, wait: float = 120) -> int:
    """The pid of the stage's spawned worker (not multiprocessing's resource tracker); ready: once it runs the
    stage's code (it has read its arguments and leads its own process group)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        for pid in processes(1, stage.pid):
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and (not ready or pid in processes(2, pid)):
                    return pid
            except OSError:
                continue
        assert stage.poll() is None, f"the stage ended before its worker started: {stage.communicate()}"
        time.sleep(0.02)
    raise AssertionError("the stage started no isolated worker")


def stage(project: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.Popen(QUANTGATE + list(args), cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def kill_worker(project: Path, sig: signal.Signals, *args: str) -> tuple[int, str, int]:
    """Run a stage, send its worker `sig` from outside as soon as it exists; (exit code, stderr, worker pid)."""
    proc = stage(project, *args)
    worker = isolated_worker(proc)
    os.kill(worker, sig)
    code, err = finish(proc)
    return code, err, worker


def no_leftovers(folder: Path) -> list[str]:
    """Half-written files: atomic writes' temp files and folders (.name.*.tmp, .name.old)."""
    return [str(p) for p in folder.rglob(".*") if p.name.endswith((".tmp", ".old"))]


# ------------------------------------------------------------------ run_isolated itself

def test_a_worker_that_crashes_is_killed_or_raises_is_a_named_failure():
    assert run_isolated(segfault, (), 60, "the test worker") == (None, "the test worker died (killed by SIGSEGV)")
    assert run_isolated(oom_killed, (), 60, "evaluate awq4") == (None, f"evaluate awq4 died ({OOM})")
    assert run_isolated(boom, (), 60, "quantize gptq3") == (None, "quantize gptq3 failed: ValueError: boom in the worker")
    result, error = run_isolated(pair, (41,), 60, "the test worker")
    assert error is None and result[0]["a"] == 41 and result[0]["pid"] != os.getpid() and result[1] == [41, 42]


def test_a_result_written_before_a_crash_or_hang_at_exit_is_kept(monkeypatch, caplog):
    """The result file is written atomically, so once it is there the work is done: a crash while the
    interpreter exits keeps it, and a hang at exit is killed after a grace period, not at the timeout."""
    import pipelines.core.isolation as isolation

    with caplog.at_level("WARNING", logger="pipelines.core.isolation"):
        assert run_isolated(done_then_crash_on_exit, (), 60, "evaluate awq4") == ({"done": True}, None)
        monkeypatch.setattr(isolation, "EXIT_GRACE_S", 2.0)
        started = time.monotonic()
        assert run_isolated(done_then_hang_on_exit, (), 300, "evaluate awq4") == ({"done": True}, None)
        assert time.monotonic() - started < 60  # the 2 s grace, not the 300 s timeout
    assert [r.getMessage() for r in caplog.records] == [  # the exit handlers really crashed and hung
        "evaluate awq4: result complete, then the process killed by SIGSEGV on its way out; the result is kept",
        f"evaluate awq4: result complete, then the process {OOM} on its way out; the result is kept"]


def test_a_hang_is_killed_at_the_timeout_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "pids.json"
    started = time.monotonic()
    result, error = run_isolated(hang_with_grandchildren, (str(pid_file),), 8, "evaluate awq4")
    took = time.monotonic() - started
    assert result is None and error == "evaluate awq4 ran past its 8 s timeout and was killed"
    assert 8 <= took < 20
    grandchildren = json.loads(pid_file.read_text())
    assert len(grandchildren) == 2 and gone(grandchildren), "a process the worker started outlived it"


def test_a_crash_takes_the_workers_process_group_with_it(tmp_path):
    pid_file = tmp_path / "pids.json"
    assert run_isolated(segfault_with_grandchild, (str(pid_file),), 60, "w") == (None, "w died (killed by SIGSEGV)")
    assert gone(json.loads(pid_file.read_text()))


def test_a_worker_dies_with_its_stage():
    """A stage killed from outside (DVC interrupted, the OOM killer choosing the parent) takes its worker along."""
    code = "import time; from pipelines.core.isolation import run_isolated; run_isolated(time.sleep, (600,), 900, 'w')"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker = isolated_worker(parent)
    parent.kill()
    parent.wait()
    assert gone([worker])


# ------------------------------------------------------------------ the stages, on the tiny model

BASE_PARAMS = {"device": "cpu",
               "variants": {"fp16": {"method": "none", "dtype": "float16"},
                            "int8": {"method": "bnb-int8", "dtype": "float16"},
                            "slow": {"method": "none", "dtype": "float16"}},
               "evaluate": {"domains": ["math"], "look_items": 4, "max_items": 8, "batch_size": 8, "fidelity_texts": 4}}


def write_params(project: Path, quantize_timeout: int | None = None, evaluate_timeout: int | None = None) -> None:
    params = json.loads(json.dumps(BASE_PARAMS))
    params["model"] = str(project / "base")
    if quantize_timeout:
        params["quantize"] = {"timeout_seconds": quantize_timeout}
    if evaluate_timeout:
        params["evaluate"]["timeout_seconds"] = evaluate_timeout
    (project / "params.yaml").write_text(yaml.safe_dump(params))


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model) -> Path:
    """A project folder where fp16 and int8 were quantized and fp16 evaluated, each through its isolated stage: a copy
    (the tests below write into it) of the one kept by content (tests/content_cache.py)."""
    import shutil

    from tests.content_cache import cached

    def build(root: Path) -> Path:
        (root / "base").symlink_to(tiny_model)
        (root / "eval").symlink_to(ROOT / "eval")  # the probes; lm-eval reads their data relative to the cwd
        write_params(root)
        for args in (("quantize", "fp16"), ("quantize", "int8"), ("baseline",)):
            code, err = finish(stage(root, *args))
            assert code == 0, err
        return root

    built = cached(tmp_path_factory, "isolated_project", build, code=["cli", "quantize", "baseline"],
                   helpers=["tests/test_isolation.py"], inputs=[tiny_model.parent])
    root = shutil.copytree(built, tmp_path_factory.mktemp("isolated-project") / "project", symlinks=True)
    (root / "eval").unlink()  # this checkout's probes, whichever checkout built the entry
    (root / "eval").symlink_to(ROOT / "eval")
    write_params(root)
    return root


def test_the_isolated_stages_give_the_same_results_as_before(project):
    for name in ("fp16", "int8"):
        manifest = json.loads((project / "models/variants" / name / "quantgate.json").read_text())
        assert manifest["status"] == "ok" and manifest["files"], manifest.get("error")
        metrics = json.loads((project / "results/quantize" / f"{name}.json").read_text())
        assert metrics["status"] == "ok" and metrics["quantize_seconds"] > 0
        assert metrics["peak_memory_bytes"]["peak_rss"] > 50 << 20  # the worker's own peak: it loaded torch and a model
    base = json.loads((project / "results/baseline/eval.json").read_text())
    assert base["status"] == "ok" and base["probes"]["math"]["items"] == 8
    rows = [json.loads(line) for line in (project / "results/baseline/items.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["domain"] for r in rows} == {"math"}
    assert (project / "results/baseline/fidelity.safetensors").stat().st_size > 0
    code, err = finish(stage(project, "evaluate", "int8"))
    assert code == 0, err
    result = json.loads((project / "results/eval/int8.json").read_text())
    assert result["status"] == "ok" and result["probes"]["math"]["items"] >= 4 and "math" in result["fidelity"]


def assert_evaluation_failed(project: Path, variant: str, error: str) -> None:
    """The stage wrote its declared outputs, valid JSON, and compare fails the variant with the cause."""
    from pipelines.judging import comparison

    result = json.loads((project / "results/eval" / f"{variant}.json").read_text())
    assert result == {"variant": variant, "device": "cpu", "batch_size": 8, "status": "failed", "error": error}
    assert (project / "results/eval" / variant / "items.jsonl").read_text() == ""
    assert no_leftovers(project / "results") == []
    inputs = comparison.load_inputs([variant], project / "results", project / "models/variants")[variant]
    assert comparison._upstream_failure(inputs) == (f"evaluation failed: {error}", None)


def test_evaluate_worker_oom_killed_is_that_variants_failure(project):
    write_params(project)
    code, err, worker = kill_worker(project, signal.SIGKILL, "evaluate", "int8")
    assert code == 0, err
    assert f"evaluate int8: FAILED (evaluate int8 died ({OOM}))" in err
    assert_evaluation_failed(project, "int8", f"evaluate int8 died ({OOM})")
    assert gone([worker])


def test_evaluate_worker_that_hangs_is_killed_at_the_timeout(project):
    write_params(project, evaluate_timeout=3)  # evaluating int8 takes ~20 s on a 2-core CPU
    proc = stage(project, "evaluate", "int8")
    worker = isolated_worker(proc, ready=False)
    code, err = finish(proc)
    assert code == 0, err
    assert_evaluation_failed(project, "int8", "evaluate int8 ran past its 3 s timeout and was killed")
    assert gone([worker]) and processes(2, worker) == []  # nothing left in the worker's process group


def test_baseline_worker_crash_stops_the_pipeline_with_the_cause(project):
    write_params(project)
    before = {p.name: p.read_bytes() for p in (project / "results/baseline").iterdir()}
    code, err, worker = kill_worker(project, signal.SIGSEGV, "baseline")
    assert code == 2
    assert err.strip().splitlines()[-1] == ("quantgate baseline: error: the fp16 baseline could not be evaluated: "
                                            "evaluate fp16 died (killed by SIGSEGV)")
    assert {p.name: p.read_bytes() for p in (project / "results/baseline").iterdir()} == before  # nothing half-written
    assert gone([worker])


def test_baseline_that_hangs_raises_naming_the_timeout(project, monkeypatch):
    from pipelines import baseline
    from pipelines.core.errors import QuantgateError

    write_params(project, evaluate_timeout=1)
    monkeypatch.chdir(project)
    started = time.monotonic()
    with pytest.raises(QuantgateError, match=r"^the fp16 baseline could not be evaluated: evaluate fp16 ran past its "
                                             r"1 s timeout and was killed$"):
        baseline.main()
    assert time.monotonic() - started < 30
    assert no_leftovers(project / "results") == []


def test_quantize_worker_killed_or_hung_is_recorded_in_the_manifest(project):
    variants = project / "models/variants"
    stale = variants / ".slow.k3j2.tmp"  # what a quantizing process killed mid-write leaves beside the variant
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    write_params(project, quantize_timeout=1)
    code, err = finish(stage(project, "quantize", "slow"))
    assert code == 0, err
    error = "quantize slow ran past its 1 s timeout and was killed"
    manifest = json.loads((variants / "slow" / "quantgate.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == error and manifest["method"] == "none"
    assert manifest["settings"]["dtype"] == "float16" and manifest["base_model"] == str(project / "base")
    assert [p.name for p in (variants / "slow").iterdir()] == ["quantgate.json"]
    assert json.loads((project / "results/quantize/slow.json").read_text()) == {"variant": "slow", "status": "failed"}
    assert no_leftovers(variants) == [] and no_leftovers(project / "results") == []

    write_params(project)
    code, err, worker = kill_worker(project, signal.SIGKILL, "quantize", "slow")
    assert code == 0, err
    manifest = json.loads((variants / "slow" / "quantgate.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == f"quantize slow died ({OOM})"
    assert no_leftovers(variants) == [] and gone([worker])
    # downstream, the variant is failed with the cause (compare's path for a variant that did not quantize)
    from pipelines.judging import comparison

    inputs = comparison.load_inputs(["slow"], project / "results", variants)["slow"]
    assert comparison._upstream_failure(inputs) == (f"quantize/admit failed: quantize slow died ({OOM})", None)
