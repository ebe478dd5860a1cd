"""`quantgate repro` (what scripts/run.sh runs): the chains side by side on a private local Ray cluster, then
`dvc repro`; the same verdicts, routing table and MLflow layout as a sequential `dvc repro`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from pipelines import repro
from tests.conftest import ROOT
from tests.chain_helpers import SMALL_VARIANTS as VARIANTS
from tests.chain_helpers import raylets, records, run, tool, verdicts, with_a_stale_chain


def test_one_core_or_no_ray_or_the_flag_means_plain_dvc_repro_and_the_reason_is_given(monkeypatch):
    monkeypatch.setattr(repro, "cores", lambda: 2)
    assert repro.why_sequential(False) is None  # 2 cores, Ray installed
    assert repro.why_sequential(True) == "--sequential"
    monkeypatch.setattr(repro, "cores", lambda: 1)
    assert repro.why_sequential(False) == "this machine gives the run 1 core"
    monkeypatch.setattr(repro, "cores", lambda: 2)
    monkeypatch.setattr(repro.importlib.util, "find_spec", lambda name: None if name == "ray" else object())
    assert repro.why_sequential(False).startswith("Ray is not installed here")


LOCAL_CLUSTER = textwrap.dedent("""
    import json, os, psutil
    from pipelines.core import ray_auth
    os.environ["RAY_ADDRESS"] = "10.0.0.9:6379"  # a cluster elsewhere: not this command's
    ray_auth.private_local_cluster()
    ray_auth.connect(None)  # refuses a cluster that answers without the token
    import ray
    assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
    mine = [p for p in psutil.Process().children(recursive=True)]
    listening = sorted({c.laddr.ip for p in mine for c in p.net_connections("inet") if c.status == "LISTEN"})
    pids = [p.pid for p in mine]
    ray.shutdown()
    print(json.dumps({"listening": listening, "pids": pids, "gcs": ray_auth.os.environ.get("RAY_ADDRESS")}))
""")


@pytest.mark.ray  # starts quantgate repro's private local cluster
def test_the_local_cluster_listens_on_loopback_only_requires_its_token_and_stops_with_the_run():
    done = subprocess.run([sys.executable, "-c", LOCAL_CLUSTER], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT / ".pytest_cache"), "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["listening"] and set(out["listening"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, out["listening"]
    assert out["gcs"] is None  # the RAY_ADDRESS given was dropped, not used
    import psutil

    assert not [p for p in out["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# a stage after the chains -> one of its outputs
AFTER_THE_CHAINS = {"memory-report": "results/memory_summary.json", "compare": "results/compare.json",
                    "shadow": "results/shadow.json", "route": "results/routing_table.json",
                    "record": "results/mlflow_run.json"}


@pytest.fixture(scope="module")
def sequential_and_repro(tmp_path_factory, pipeline_run):
    if GPU_HERE:
        pytest.skip("a GPU here: with fanout.gpus 0 quantgate repro runs plain dvc repro (tested by monkeypatching)")
    seq, _, _ = pipeline_run  # `dvc repro` of the small repository with every variant and three candidates
    # a copy of the finished run, on the smallest chain that still fans out: awq4's chain gone (its quantize,
    # memory and evaluate run as tasks on the private cluster; every chain side by side: the fan-out fixture), an
    # output of each stage after the chains gone (so each runs again under `dvc repro` and what is compared below is
    # re-derived, not copied), the MLflow store (record writes a new one) and the stage timings (this run's)
    par = with_a_stale_chain(seq, tmp_path_factory.mktemp("repro") / "repo", "awq4")
    for gone in AFTER_THE_CHAINS.values():
        (par / gone).unlink()
    for gone in ("mlartifacts", "logs/timings"):
        shutil.rmtree(par / gone)
    (par / "mlflow.db").unlink()
    before = set(raylets())
    parallel = run([tool("quantgate"), "repro"], par)
    assert parallel.returncode == 0, parallel.stdout[-3000:] + parallel.stderr[-3000:]
    assert set(raylets()) <= before, "quantgate repro left its Ray cluster running"
    return seq, par, parallel


def routes(repo) -> list:
    table = json.loads((repo / "results" / "routing_table.json").read_text())
    return [(r["domain"], r["max_context_tokens"], r["serve"], r["fallback_under_memory_pressure"],
             [(c["variant"], c["verdict"]) for c in r["considered"]]) for r in table["rows"]]


def mlflow_layout(repo) -> list:
    """Every run's name, kind, variant, and the names of its metrics, params and tags (values vary run to run)."""
    from mlflow import MlflowClient

    run_file = json.loads((repo / "results" / "mlflow_run.json").read_text())
    client = MlflowClient(run_file["tracking_uri"])
    runs = client.search_runs([run_file["experiment_id"]])
    # memory/warmup_end_round exists only when a soak settled, memory.growth* tags only when one did not and was traced:
    # whether the tiny model's heap noise lets a soak settle (two runs at once here) is a measurement, not the layout
    return sorted((r.info.run_name if r.info.run_id != run_file["parent_run_id"] else "parent",
                   r.data.tags.get("quantgate.kind"), r.data.tags.get("quantgate.variant"),
                   sorted(m for m in r.data.metrics if m != "memory/warmup_end_round"),
                   sorted(r.data.params),
                   sorted(t for t in r.data.tags if not t.startswith(("mlflow.", "memory.growth"))))
                  for r in runs)


def test_quantgate_repro_fans_out_and_matches_a_sequential_dvc_repro(sequential_and_repro):
    seq, par, parallel = sequential_and_repro
    said = parallel.stdout + parallel.stderr
    assert "chain stages ran" in said and "plain dvc repro" not in said, said[-3000:]
    assert set(re.findall(r"fanout: (\S+) done in", said)) == {f"{s}@awq4" for s in ("quantize", "memory", "evaluate")}
    assert set(re.findall(r"Running stage '([^']+)'", said)) == set(AFTER_THE_CHAINS), said[-3000:]
    candidates = yaml.safe_load((seq / "params.yaml").read_text())["candidates"]
    # every variant's records and those of the candidates that were judged (from a sample log, through a server)
    assert records(par) == records(seq) and {*VARIANTS, "vendor-log", "vendor-served"} <= set(records(seq))
    assert verdicts(par) == verdicts(seq)
    assert routes(par) == routes(seq)
    assert mlflow_layout(par) == mlflow_layout(seq) and len(mlflow_layout(seq)) == len(VARIANTS) + len(candidates) + 2
    # (+ the parent and the shadow replay's run)
    status = run([tool("dvc"), "status"], par)
    assert "up to date" in status.stdout, status.stdout
    gated = run([tool("quantgate"), "gate", "--variant", "awq4"], par)
    assert gated.returncode in (0, 1), gated.stdout + gated.stderr  # decided: the gate accepts fanned-out results
    timings = par / "logs" / "timings"
    evaluate = [json.loads(p.read_text()) for p in (timings / "evaluate@awq4").glob("*.json")]
    assert any("lm-eval" in row["library"] for row in evaluate)  # the child process's library time came back


def test_a_second_quantgate_repro_does_nothing_and_starts_no_ray_nor_torch(sequential_and_repro):
    _, par, _ = sequential_and_repro
    for _ in range(2):  # the first may ask `dvc status` (files written within the last second), the second not
        again = run([sys.executable, "-X", "importtime", "-c", "import sys; from pipelines.cli import main; "
                     "sys.exit(main(['repro']))"], par)
        assert again.returncode == 0 and repro.UP_TO_DATE in again.stdout, again.stdout + again.stderr[-3000:]
        imported = {line.split("|")[-1].strip() for line in again.stderr.splitlines() if line.startswith("import time:")}
        assert "torch" not in imported and "ray" not in imported, sorted(imported)[:20]
    # the stamp answers: with `dvc status` made to fail, a no-op still says so
    stamped = run([sys.executable, "-c", "import sys; from pipelines.chains import tasks; from pipelines.cli import main; "
                   "tasks.dvc_changed = lambda root: sys.exit('dvc status was asked'); sys.exit(main(['repro']))"], par)
    assert stamped.returncode == 0 and repro.UP_TO_DATE in stamped.stdout, stamped.stdout + stamped.stderr[-2000:]


def test_the_clean_stamp_answers_only_while_nothing_dvc_lock_names_has_moved(tmp_path):
    from pipelines.core import lock_stamp

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    outside = tmp_path.parent / f"{tmp_path.name}-candidate"  # a candidate's absolute path, as params.yaml allows
    outside.mkdir()
    (outside / "model.safetensors").write_text("w")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text("a: 1\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("x")
    obj = tmp_path / ".dvc/cache/files/md5/ab/cdef0123456789"
    obj.parent.mkdir(parents=True)
    obj.write_text("o")
    (tmp_path / "dvc.lock").write_text(f"schema: '2.0'\nstages:\n  s:\n    cmd: c\n    deps:\n    - path: data\n"
                                       f"    - path: {outside}\n    params:\n      params.yaml:\n        a: 1\n"
                                       "    outs:\n    - path: out.txt\n      md5: abcdef0123456789\n")
    (tmp_path / "out.txt").write_text("o")
    assert not lock_stamp.is_clean(tmp_path)  # no stamp yet: DVC decides
    before = lock_stamp.snapshot(tmp_path)
    assert {"data/x.txt", "params.yaml", "out.txt", "dvc.lock", "dvc.yaml"} <= {
        str(Path(k).relative_to(tmp_path)) for k in before if k.startswith(str(tmp_path) + "/")}
    assert str(outside / "model.safetensors") in before
    lock_stamp.save(tmp_path, before)
    assert not lock_stamp.is_clean(tmp_path)  # files written within the last second: no stamp (a racy write)
    time.sleep(lock_stamp.RACY_SECONDS)
    lock_stamp.save(tmp_path, before)
    assert lock_stamp.is_clean(tmp_path)
    (tmp_path / "data" / "new.txt").write_text("n")  # a new file in a dependency folder
    assert not lock_stamp.is_clean(tmp_path)
    (tmp_path / "data" / "new.txt").unlink()
    assert lock_stamp.is_clean(tmp_path)
    obj.unlink()  # the cache cleared: `dvc repro` would run the stage again
    assert not lock_stamp.is_clean(tmp_path)
    obj.write_text("o")
    (outside / "model.safetensors").write_text("v")  # a candidate outside the workspace, edited
    assert not lock_stamp.is_clean(tmp_path)
    (tmp_path / "params.yaml").write_text("a: 2\n")
    lock_stamp.forget(tmp_path)
    time.sleep(lock_stamp.RACY_SECONDS)
    lock_stamp.save(tmp_path, before)  # files moved since `before` (while DVC checked): no stamp is written
    assert not (tmp_path / lock_stamp.STAMP).exists()
    (tmp_path / "extra.dvc").write_text("outs: []\n")  # DVC reads more than dvc.lock: the stamp stands aside
    assert lock_stamp.snapshot(tmp_path) is None
    (tmp_path / "extra.dvc").unlink()
    (tmp_path / ".dvc/config").write_text("[cache]\n    dir = /elsewhere\n")
    assert lock_stamp.snapshot(tmp_path) is None


GPU_HERE = any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg", "/dev/nvhost-ctrl-gpu"))


@pytest.mark.skipif(GPU_HERE, reason="a GPU driver here: device auto asks torch, as it must")
def test_stage_parents_import_no_torch_on_a_machine_without_a_gpu_driver():
    """The parents of the isolated stages only hand work to a child: importing torch there cost 2 s per stage."""
    code = textwrap.dedent("""
        import sys
        from pipelines import cli
        from pipelines.core import logs
        argv_of = {"memory": ["memory", "int8"], "evaluate": ["evaluate", "int8"], "quantize": ["quantize", "int8"],
                   "route lookup": ["route", "lookup", "x", "--context-tokens", "3"]}
        for verb in sorted(logs.NO_TORCH_COMMANDS):
            args = cli.build_parser().parse_args(argv_of.get(verb, [verb]))
            logs.setup(log_file=logs.Path(sys.argv[1]), libraries=False)
            cli.entry(args)  # imports the verb's module, as cli.main does before calling it
        from pipelines.models.loading import resolve_device
        print(resolve_device("auto"), "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / ".pytest_cache" / "parents.log")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["cpu", "False"], done.stdout + done.stderr


def test_a_stage_process_writes_its_wall_time_and_library_seconds(tmp_path, monkeypatch):
    from pipelines.core import timing

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(timing.STAGE_ENV, raising=False)
    timing.flush()  # outside a stage: nothing
    assert not (tmp_path / "logs").exists()
    timing.start("evaluate@awq4")  # (other tests in this process may have timed lm-eval: a name of its own)
    with timing.library_call("test call"):
        sum(range(10_000))
    with timing.library_call("test call"):
        pass
    timing.flush()
    [row] = [json.loads(p.read_text()) for p in (tmp_path / "logs/timings/evaluate@awq4").glob("*.json")]
    assert row["library"]["test call"]["calls"] == 2 and 0 <= row["library"]["test call"]["seconds"] < row["wall_seconds"]
    timing.clear("evaluate@awq4")
    assert not list((tmp_path / "logs/timings/evaluate@awq4").glob("*.json"))


@pytest.mark.parametrize("case", ["one core", "ray fails", "gpus undeclared", "cuda here"])
def test_one_core_a_ray_that_will_not_start_or_gpus_without_fanout_gpus_run_plain_dvc_repro_saying_why(
        monkeypatch, caplog, case):
    import contextlib

    from pipelines.chains import tasks
    from pipelines.core import lock_stamp, ray_auth
    from pipelines.models import loading

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")  # what private_local_cluster puts here
    monkeypatch.setattr(lock_stamp, "is_clean", lambda root: False)
    monkeypatch.setattr(lock_stamp, "save", lambda root, before: None)
    monkeypatch.setattr(lock_stamp, "forget", lambda root: None)
    monkeypatch.setattr(lock_stamp, "snapshot", lambda root: None)
    monkeypatch.setattr(tasks, "one_run_at_a_time", lambda root: contextlib.nullcontext())
    monkeypatch.setattr(tasks, "dvc_changed", lambda root: {"calibrate"})
    monkeypatch.setattr(ray_auth, "private_local_cluster", lambda: None)
    monkeypatch.setattr(repro, "cores", lambda: 1 if case == "one core" else 2)
    monkeypatch.setattr(loading, "resolve_device", lambda setting: "cuda" if case == "cuda here" else "cpu")

    def no_fanout(*args, **kwargs):
        if case == "gpus undeclared":
            raise tasks.GpusNotGiven("the cluster has 1 GPU(s), but fanout gives fp16 none")
        raise ray_auth.RayUnavailable("could not start or reach a local Ray cluster: RuntimeError: no /dev/shm")

    monkeypatch.setattr(tasks, "run_chains", no_fanout)
    ran = []
    monkeypatch.setattr(repro.subprocess, "run", lambda argv, **kw: ran.append((argv, kw["env"]))
                        or subprocess.CompletedProcess(argv, 0))
    with caplog.at_level("INFO"):
        assert repro.main() == 0
    [(argv, env)] = ran
    assert [Path(a).name for a in argv] == ["dvc", "repro"] and "RAY_AUTH_TOKEN" not in env
    said = {"one core": "plain dvc repro (this machine gives the run 1 core)",
            "ray fails": "no /dev/shm; plain dvc repro instead",
            "gpus undeclared": "gives fp16 none; plain dvc repro instead",
            "cuda here": "plain dvc repro (the stages run on CUDA here and `fanout` gives"}[case]
    assert said in caplog.text, caplog.text


def test_two_runs_in_one_workspace_are_refused(tmp_path):
    from pipelines.chains import tasks
    from pipelines.core.errors import QuantgateError

    (tmp_path / ".dvc").mkdir()
    with tasks.one_run_at_a_time(tmp_path):
        with pytest.raises(QuantgateError, match="another quantgate repro or fanout is running"):
            with tasks.one_run_at_a_time(tmp_path):
                pass
    with tasks.one_run_at_a_time(tmp_path):  # released with the first
        pass


def test_a_subdirectory_runs_in_its_repository_and_no_repository_is_an_error(tmp_path, monkeypatch):
    from pipelines.chains import tasks
    from pipelines.core.errors import QuantgateError

    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(ROOT / "docs")
    assert tasks.repo_root() == ROOT and Path.cwd() == ROOT
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QuantgateError, match="not inside a DVC repository"):
        tasks.repo_root()
    assert not (tmp_path / ".dvc").exists()
