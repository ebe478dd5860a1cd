"""`quantgate fanout`: the chains as Ray tasks, recorded in dvc.lock; same answers as `dvc repro`, faults survived."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.chains import tasks
from pipelines.core import ray_auth
from pipelines.core.errors import QuantgateError
from pipelines.core.params import Params
from tests.chain_helpers import (SMALL_VARIANTS, env, free_port, raylets, records, run, small_repo, tool, verdicts,
                                 with_a_stale_chain)
from tests.conftest import ROOT


def test_the_chain_stages_are_dvc_yamls_with_their_commands_and_order():
    params = Params(candidates={"vendor": {"path": "/nowhere"}})
    stages = tasks.chain_stages(params)
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert set(stages) == {f"{kind}@{item}" for kind in ("quantize", "memory", "evaluate") for item in params.variants} | {
        "admit@vendor", "memory-candidate@vendor", "evaluate-candidate@vendor", "baseline"}
    for name, stage in stages.items():
        kind, _, item = name.partition("@")
        assert kind in dvc, f"{name}: no such dvc.yaml stage"
        body = dvc[kind].get("do", dvc[kind])
        assert stage.argv == body["cmd"].replace("${key}", item).split(), name
    order = list(stages)
    for name, stage in stages.items():  # every stage comes after what it waits for
        assert all(order.index(up) < order.index(name) for up in stage.after), name
    assert stages["evaluate-candidate@vendor"].after == ["admit@vendor", "baseline"]
    # submitted right after fp16's quantize, before any other quantize or memory stage, as the docs say (best effort:
    # Ray keeps the order within a resource shape)
    assert order[:2] == ["quantize@fp16", "baseline"]
    assert stages["memory@int8"].timeout == params.memory.timeout_seconds + params.fanout.timeout_margin_seconds
    # each allocator the memory stage compares (CUDA) is one more measuring process, with its own timeout
    compared = params.model_copy(update={"memory": params.memory.model_copy(
        update={"compare_allocators": ["expandable_segments:True", "backend:cudaMallocAsync"]})})
    assert tasks.chain_stages(compared)["memory@int8"].timeout == (3 * params.memory.timeout_seconds
                                                                   + params.fanout.timeout_margin_seconds)


def test_a_changed_stage_reruns_everything_after_it():
    stages = tasks.chain_stages(Params())
    assert tasks.stale(stages, {"quantize@int8"}) == ["quantize@int8", "evaluate@int8", "memory@int8"]
    everything_evaluated = tasks.stale(stages, {"quantize@fp16"})
    assert "baseline" in everything_evaluated and all(f"evaluate@{v}" in everything_evaluated
                                                      for v in ("fp16", "int8", "awq4", "gptq3"))
    assert tasks.stale(stages, set()) == []


def test_resources_come_from_params():
    params = Params(fanout={"cpus": 2, "per_variant": {"fp16": {"cpus": 4, "gpus": 2}}})
    assert tasks.resources(params, "fp16") == {"num_cpus": 4, "num_gpus": 2}
    assert tasks.resources(params, "int8") == {"num_cpus": 2, "num_gpus": 0}
    # a task that loads no model here holds no GPU: a log or endpoint candidate's, and fp16's baseline from a log
    served = {"base_url": "http://10.0.0.5:8000/v1", "model": "m"}
    candidates = {"vendor": {"path": "third_party/v", "source": "checkpoint"},
                  "logged": {"path": "logs/l", "source": "samples"},
                  "served": {"path": "deploy.yaml", "source": "endpoint", "endpoint": served}}
    params = Params(fanout={"gpus": 1}, candidates=candidates, baseline={"source": "samples", "path": "logs/fp16"})
    gpus = {v: tasks.resources(params, v)["num_gpus"] for v in ("fp16", "vendor", "logged", "served")}
    assert gpus == {"fp16": 1, "vendor": 1, "logged": 0, "served": 0}
    assert tasks.resources(params, "fp16", "baseline")["num_gpus"] == 0 and \
        tasks.resources(Params(fanout={"gpus": 1}), "fp16", "baseline")["num_gpus"] == 1
    none = Params(fanout={"gpus": 0}, candidates=candidates, baseline={"source": "samples", "path": "logs/fp16"})
    tasks.check_gpus(none, [("fp16", "baseline"), ("logged", "evaluate"), ("served", "memory")], cluster_gpus=2)
    with pytest.raises(QuantgateError, match="fanout gives fp16, vendor none"):  # these load a model: refused
        tasks.check_gpus(none, [("fp16", "quantize"), ("vendor", "admit"), ("logged", "admit")], cluster_gpus=2)
    with pytest.raises(ValueError, match="fanout.per_variant: 'nope' is no variant or candidate"):
        Params(fanout={"per_variant": {"nope": {"cpus": 1}}})


def test_a_stage_past_its_timeout_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    stage = tasks.Stage("memory@int8", [sys.executable, "-c", f"import os, subprocess, time; "
                                         f"p = subprocess.Popen(['sleep', '60']); open({str(marker)!r}, 'w').write(str(p.pid)); "
                                         f"time.sleep(60)"], "int8", "memory", timeout=2)
    result = tasks.run_stage(str(tmp_path), stage, {})
    assert not result["ok"] and result["error"] == "ran past its 2 s timeout (fanout) and was killed"
    assert result["seconds"] < 10
    child = int(marker.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_a_stage_gets_the_thread_count_dvc_repro_would_give_it(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray sets it in a 1-CPU task's worker
    monkeypatch.setenv("MKL_NUM_THREADS", "1")  # as a node's own environment may
    staged = tasks.stage_env({"PATH": "/bin"})
    assert "OMP_NUM_THREADS" not in staged and "MKL_NUM_THREADS" not in staged
    assert tasks.stage_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"  # the driver's own setting wins
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert tasks.thread_settings() == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert tasks.thread_settings() == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_a_task_without_gpus_sees_none_and_a_gpu_cluster_needs_them_declared(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # Ray 2.60 leaves a node's GPUs visible to a 0-GPU task
    assert tasks.stage_env({}, gpu_ids=[])["CUDA_VISIBLE_DEVICES"] == ""
    assert tasks.stage_env({}, gpu_ids=["1"])["CUDA_VISIBLE_DEVICES"] == "0,1"  # Ray set it for the task's GPU
    assert tasks.stage_env({}, gpu_ids=None)["CUDA_VISIBLE_DEVICES"] == "0,1"  # outside Ray: untouched
    params = Params(fanout={"per_variant": {"fp16": {"cpus": 1, "gpus": 2}}})
    with pytest.raises(QuantgateError, match=r"2 GPU\(s\), but fanout gives int8, awq4 none"):
        tasks.check_gpus(params, [(v, "quantize") for v in ("fp16", "int8", "awq4", "int8")], cluster_gpus=2)
    tasks.check_gpus(params, [("fp16", "quantize")], cluster_gpus=2)  # every variant that runs has GPUs
    tasks.check_gpus(params, [("int8", "memory")], cluster_gpus=0)  # a CPU cluster
    tasks.check_gpus(Params(device="cpu"), [("int8", "memory")], cluster_gpus=2)  # CPU asked for, as under dvc repro


def test_a_stage_that_cannot_start_on_its_node_is_a_failure_with_the_cause(tmp_path):
    stage = tasks.Stage("memory@int8", ["no-such-quantgate"], "int8", "memory", 10)
    result = tasks.run_stage(str(tmp_path), stage, {})
    assert not result["ok"] and result["error"].startswith("could not start no-such-quantgate in ")
    assert "same path on every node" in result["error"]


def test_a_stage_waits_for_nothing_that_failed():
    stage = tasks.Stage("memory@int8", ["true"], "int8", "memory", 10, ["quantize@int8"])
    result = tasks.run_stage(".", stage, {}, {"stage": "quantize@int8", "ok": False, "error": "boom"})
    assert result == {"stage": "memory@int8", "ok": False, "upstream_failed": True,
                      "error": "quantize@int8 failed first"}


def test_the_driver_needs_token_auth_and_a_local_cluster_gets_a_private_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(QuantgateError, match="RAY_AUTH_MODE=disabled: fanout uses Ray only with token"):
        ray_auth.require_token("10.0.0.1:6379")
    monkeypatch.delenv("RAY_AUTH_MODE")
    with pytest.raises(QuantgateError, match="no Ray token here for the cluster at 10.0.0.1:6379"):
        ray_auth.require_token("10.0.0.1:6379")
    assert os.environ["RAY_AUTH_MODE"] == "token"
    ray_auth.require_token(None)  # a local cluster: a new token, owner-only from the start
    token = tmp_path / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    ray_auth.require_token("10.0.0.1:6379")  # found now, and kept
    assert ray_auth.token_source() == str(token) and len(token.read_text()) == 64
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(QuantgateError, match="RAY_AUTH_TOKEN_PATH=.*missing: no such file"):
        ray_auth.require_token("10.0.0.1:6379")


# ------------------------------------------------------------------------------------------------------------
# On a real two-node Ray cluster (two raylets on this machine, one CPU each)
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    """`ray start --head` and `ray start --address` (a second node), as a team starts a cluster; stopped after,
    and nothing of it left running."""
    import ray  # noqa: F401 - a dependency: its absence is a failure, not a skip

    port, temp = free_port(), Path(f"/tmp/ray-qg-{os.getpid()}")  # short: Ray's socket paths must fit 107 bytes
    common = ["--num-cpus=1", "--disable-usage-stats"]
    head = subprocess.run([tool("ray"), "start", "--head", f"--port={port}", "--include-dashboard=false",
                           f"--temp-dir={temp}", *common], env=env(), capture_output=True, text=True, timeout=180)
    assert head.returncode == 0, head.stdout + head.stderr
    try:
        worker = subprocess.run([tool("ray"), "start", f"--address=127.0.0.1:{port}", *common], env=env(),
                                capture_output=True, text=True, timeout=180)
        assert worker.returncode == 0, worker.stdout + worker.stderr
        ray_auth.refuse_open_cluster(f"127.0.0.1:{port}")  # no error: the cluster refuses a request without the token
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([tool("ray"), "stop", "--force"], env=env(), capture_output=True, timeout=180)
        shutil.rmtree(temp, ignore_errors=True)
    assert not raylets(), "ray stop left a raylet running"


# a fresh repository with every variant but awq4: bitsandbytes and GPTQModel inside Ray workers (autoawq, whose
# quantize is the slowest stage here, in tests/test_repro.py's fan-out), fp16's chain and the baseline as tasks too
FANNED = [v for v in SMALL_VARIANTS if v != "awq4"]


@pytest.fixture(scope="module")
def sequential_and_fanned(tmp_path_factory, ray_cluster, pipeline_run):
    """`quantgate fanout` of a fresh small repository (FANNED's variants) on the two-node cluster, with one fault on
    the way: the Ray worker of memory@int8 (a task that waited on quantize@int8's) is killed while it measures, and Ray
    retries it (fanout.retries 1, the default). Then `dvc repro compare` runs the two stages after the chains that the
    verdicts need (the stages after compare run on fanned-out results in tests/test_repro.py: `quantgate repro` is
    fanout, then `dvc repro`)."""
    seq, _, _ = pipeline_run  # `dvc repro` of the small repository with every variant (and three candidates)
    fan = small_repo(tmp_path_factory.mktemp("fanned"), FANNED, retries=1)
    stage_env, killed = fanout_killing_memory_int8(fan, ray_cluster)
    rest = run([tool("dvc"), "repro", "compare"], fan)
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    return seq, fan, json.loads((fan / "fanout.json").read_text()), rest, (stage_env, killed)


def test_fanout_gives_the_same_records_and_verdicts_as_dvc_repro(sequential_and_fanned):
    """The killed worker's task was retried and left no trace: the same records and verdicts as the sequential run's
    for the same variants (a variant's verdicts are judged against fp16 alone), int8's memory measured."""
    seq, fan, report, _, (stage_env, killed) = sequential_and_fanned
    assert "memory@int8" in report["ran"] and report["failed"] == {}
    assert report["ran"]["memory@int8"]["pid"] != killed  # it ran again, in another worker
    assert json.loads((fan / "results/memory/int8.json").read_text())["status"] == "ok"
    assert not list((fan / "results/memory").glob(".*"))  # nothing half-written
    # stages side by side on shared cores: idle OpenMP threads sleep; Ray's OMP_NUM_THREADS=1 for a 1-CPU task
    # is not passed on, so the stage has `dvc repro`'s thread count
    assert stage_env.get("OMP_WAIT_POLICY") == "PASSIVE" and "OMP_NUM_THREADS" not in stage_env
    assert records(fan) == {v: rows for v, rows in records(seq).items() if v in FANNED} and len(records(fan)) == 3
    assert verdicts(fan) == {key: row for key, row in verdicts(seq).items() if key[0] in FANNED}
    assert (fan / "results/baseline/items.jsonl").read_text() == (seq / "results/baseline/items.jsonl").read_text()
    # the shadow replay's sample (small_repo) still gives route every servable type's agreement to listen to
    shadow = json.loads((seq / "results/shadow.json").read_text())
    least = yaml.safe_load((seq / "params.yaml").read_text())["shadow"]["min_requests"]
    assert all(shadow["traffic"]["by_type"][t] >= least for t in ("chat", "code", "code_comment", "math", "sql")), shadow


def test_fanout_spreads_the_chains_over_both_nodes_and_dvc_records_them(sequential_and_fanned):
    _, fan, report, rest, _ = sequential_and_fanned
    expected = {f"{k}@{v}" for k in ("quantize", "memory", "evaluate") for v in FANNED}
    assert set(report["ran"]) == expected | {"baseline"} and report["failed"] == {}
    assert set(report["committed"]) == set(report["ran"])
    assert len({row["node"] for row in report["ran"].values()}) == 2  # both nodes took tasks
    ran_after = {line.split("'")[1] for line in rest.stdout.splitlines() if line.startswith("Running stage")}
    assert ran_after == {"memory-report", "compare"}, rest.stdout
    status = run([tool("dvc"), "status", "--with-deps", "compare"], fan)
    assert "up to date" in status.stdout, status.stdout


def kill_worker_of(stage_args: list[str], deadline: float) -> tuple[dict[str, str], int]:
    """SIGKILL the Ray worker process running the stage whose command line is `quantgate <stage_args>`; returns
    the stage process's environment and the killed worker's pid."""
    needle = " ".join(["quantgate", *stage_args])
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if needle in cmdline and "fanout" not in cmdline:
                    environ = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
                    parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if b"ray::" not in Path(f"/proc/{parent}/cmdline").read_bytes():
                        continue  # another pipeline on this machine (a `dvc repro` running the same stage): not ours
                    os.kill(parent, signal.SIGKILL)
                    return environ, parent
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.2)
    raise AssertionError(f"no `{needle}` process appeared")


def fanout_killing_memory_int8(repo: Path, address: str) -> tuple[dict[str, str], int]:
    """`quantgate fanout` in `repo`, the Ray worker of memory@int8 killed while it measures (kill_worker_of: the stage
    process's environment and the killed worker's pid); the fan-out itself must end with exit 0."""
    proc = subprocess.Popen([tool("quantgate"), "fanout", "--address", address, "--report", "fanout.json"],
                            cwd=repo, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # memory@int8 may be among the last tasks of a whole fan-out: the deadline is the fan-out's own
        killed = kill_worker_of(["memory", "int8"], time.monotonic() + 1800)
        output, _ = proc.communicate(timeout=1800)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    return killed


def test_a_worker_killed_mid_task_and_not_retried_is_recorded_as_the_variants_failure(tmp_path, ray_cluster,
                                                                                      pipeline_run):
    """A copy of the finished small repository whose int8 checkpoint is gone: `quantgate fanout` runs int8's chain
    (quantize, then memory and evaluate side by side; every other chain stage is up to date), and the Ray worker of
    memory@int8, a task that waited on quantize@int8's, is killed while it measures (evaluate@int8, ready at the same
    moment, runs on the cluster meanwhile), with no retry left. (Killed and retried: the fan-out fixture.)"""
    repo = with_a_stale_chain(pipeline_run[0], tmp_path / "repo", "int8")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["fanout"]["retries"] = 0  # (no stage's parameter: nothing else goes stale)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
    stage_env, _ = fanout_killing_memory_int8(repo, ray_cluster)
    assert stage_env.get("OMP_WAIT_POLICY") == "PASSIVE" and "OMP_NUM_THREADS" not in stage_env
    report = json.loads((repo / "fanout.json").read_text())
    memory = json.loads((repo / "results/memory/int8.json").read_text())
    assert set(report["ran"]) | set(report["failed"]) == {f"{s}@int8" for s in ("quantize", "memory", "evaluate")}
    assert report["failed"]["memory@int8"].startswith("its Ray task failed after the retries")
    assert memory["status"] == "failed" and memory["error"].startswith("memory@int8: its Ray task failed")
    assert not list((repo / "results/memory").glob(".*"))  # nothing half-written
    # compare and what it stands on: every chain stage was committed by fanout (the failure record included), so only
    # the two stages after the chains run. The stages after compare run on fanned-out results in tests/test_repro.py
    # (a variant that failed its verdict goes through them as any other: pipeline_run's broken candidate)
    rest = run([tool("dvc"), "repro", "compare"], repo)
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    verdict = json.loads((repo / "results/compare.json").read_text())["variants"]["int8"]
    killed = [r for d in verdict["domains"].values() for r in d["reasons"] if "Ray task failed" in r]
    assert killed and verdict["verdict"] == "fail", verdict  # the rows name the task that died, and int8 fails
    ran_after = {line.split("'")[1] for line in rest.stdout.splitlines() if line.startswith("Running stage")}
    assert ran_after == {"memory-report", "compare"}, rest.stdout
    assert "up to date" in run([tool("dvc"), "status", "--with-deps", "compare"], repo).stdout


def test_inputs_edited_while_the_chains_run_are_noticed(tmp_path):
    """dvc commit records the inputs as they are at the end: an edit meanwhile must stop the commit."""
    (tmp_path / "params.yaml").write_text("a: 1\n")
    (tmp_path / "eval" / "math").mkdir(parents=True)
    (tmp_path / "eval" / "math" / "items.jsonl").write_text("{}\n")
    params = Params()
    before = tasks.inputs_fingerprint(tmp_path, params)
    assert set(before) == {str(tmp_path / "params.yaml"), str(tmp_path / "eval/math/items.jsonl")}
    assert tasks.inputs_fingerprint(tmp_path, params) == before
    (tmp_path / "eval" / "math" / "items.jsonl").write_text('{"id": 1}\n')
    assert tasks.inputs_fingerprint(tmp_path, params) != before
    # a candidate's own files are inputs; a served variant's checkpoint (models/variants/awq4) is what the chains write
    for where in ("third_party/vendor", "models/variants/awq4"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "model.safetensors").write_bytes(b"weights")
    served = {"base_url": "http://10.0.0.5:8000/v1", "model": "m"}
    params = Params(candidates={"vendor": {"path": "third_party/vendor"}, "awq4-served": {
        "path": "models/variants/awq4", "source": "endpoint", "endpoint": served}})
    read = {p.removeprefix(f"{tmp_path}/") for p in tasks.inputs_fingerprint(tmp_path, params)}
    assert "third_party/vendor/model.safetensors" in read and not any(p.startswith("models/") for p in read)


def stop_cluster_in(temp: Path) -> None:
    """Stop the one Ray cluster whose processes name `temp` (`ray stop` would stop every cluster on the machine)."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])]
    for proc in mine:
        proc.terminate()
    _, alive = psutil.wait_procs(mine, timeout=20)
    for proc in alive:
        proc.kill()
    shutil.rmtree(temp, ignore_errors=True)


def test_fanout_without_token_auth_is_refused_before_it_reaches_a_cluster(tmp_path):
    """A driver told RAY_AUTH_MODE=disabled, and a driver with no token: `quantgate fanout` stops naming why."""
    repo = small_repo(tmp_path / "repo", ["fp16", "int8"])
    driver = {**env(), "RAY_AUTH_MODE": "disabled"}
    said = subprocess.run([tool("quantgate"), "fanout", "--address", "127.0.0.1:1"], cwd=repo, env=driver,
                          capture_output=True, text=True, timeout=300)
    assert said.returncode != 0 and "RAY_AUTH_MODE=disabled" in said.stderr and "--insecure" in said.stderr, said.stderr
    no_token = {**env(), "HOME": str(tmp_path / "home")}
    no_token.pop("RAY_AUTH_TOKEN_PATH")
    said = subprocess.run([tool("quantgate"), "fanout", "--address", "127.0.0.1:1"], cwd=repo, env=no_token,
                          capture_output=True, text=True, timeout=300)
    assert said.returncode != 0 and "no Ray token here" in said.stderr, said.stderr
    assert not (repo / "models").exists()  # nothing ran


@pytest.mark.ray  # starts a Ray head of its own
def test_fanout_refuses_a_cluster_without_token_auth_unless_insecure(tmp_path):
    """A cluster that answers a request without a token (started with RAY_AUTH_MODE=disabled, which a token-sending
    driver would join) is refused before anything runs; `--insecure` connects to it."""
    repo = small_repo(tmp_path / "repo", ["fp16", "int8"])
    port, temp = free_port(), Path(f"/tmp/ray-qg-open-{os.getpid()}")
    began = time.monotonic()
    head = subprocess.run([tool("ray"), "start", "--head", f"--port={port}", "--include-dashboard=false",
                           f"--temp-dir={temp}", "--num-cpus=1", "--disable-usage-stats"],
                          env={**env(), "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=180)
    try:
        assert head.returncode == 0, head.stdout + head.stderr
        address = f"127.0.0.1:{port}"
        with pytest.raises(QuantgateError, match="answers requests without a token"):
            ray_auth.refuse_open_cluster(address)
        said = subprocess.run([tool("quantgate"), "fanout", "--address", address], cwd=repo, env=env(),
                              capture_output=True, text=True, timeout=300)
        assert said.returncode != 0 and "answers requests without a token" in said.stderr, said.stderr
        assert not (repo / "models").exists() and "Running stage" not in said.stdout  # nothing ran, not even calibrate
        insecure = subprocess.run([sys.executable, "-c", "import ray; from pipelines.core.ray_auth import connect; "
                                   f"connect({address!r}, insecure=True); print(ray.get(ray.remote(lambda: 'ran').remote()))"],
                                  cwd=ROOT, env={**env(), "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True,
                                  timeout=300)
        assert insecure.returncode == 0 and insecure.stdout.strip().endswith("ran"), insecure.stdout + insecure.stderr
        assert "token authentication is not checked" in insecure.stderr
    finally:
        stop_cluster_in(temp)
    print(f"\nopen cluster: refused and --insecure accepted in {time.monotonic() - began:.1f} s")
