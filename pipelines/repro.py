"""`quantgate repro`: the whole pipeline, as `dvc repro` runs it, with the per-variant chains side by side.

    quantgate repro               # what scripts/run.sh runs
    quantgate repro --sequential  # plain `dvc repro`

On a machine with at least 2 cores where Ray imports, the chains (quantize/admit -> memory, baseline ->
evaluate) run as tasks on a local Ray cluster that this command starts and stops (`quantgate fanout`'s
machinery): private to the machine and the run (`ray_auth.private_local_cluster`: every Ray server on
127.0.0.1, token authentication with a token of its own). Then `dvc repro` runs what is left (memory-report,
compare, shadow, route, record), so `dvc status` is clean after it, and dvc.lock holds what a sequential run
would: the same verdicts, routing table and MLflow layout (tests/test_repro.py compares them). One core,
no Ray, a Ray that will not start, a machine with GPUs that `fanout` gives the tasks none of, or --sequential:
plain `dvc repro`, and the log says why. A stage whose Ray task Ray itself lost is left for `dvc repro` to run. Nothing to do: said in milliseconds when no file
dvc.lock vouches for moved since DVC last found the pipeline clean (core/lock_stamp.py), else after `dvc status`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

UP_TO_DATE = "Data and pipelines are up to date."  # what `dvc repro` says; the README quotes it


def cores() -> int:
    """The cores this process may use: its CPU affinity (taskset), capped by a CPU quota (a container's `--cpus`)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    return max(1, min(n, int(quota))) if quota is not None else n


def cpu_quota() -> float | None:
    """The tightest cgroup CPU quota over this process's cgroup and its parents (v2 `cpu.max`, v1 `cfs_quota_us`), in
    cores; None without one."""
    limits = []
    try:
        path = next((line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                     if line.startswith("0::")), "/")
    except OSError:
        path = "/"
    folders = [Path("/sys/fs/cgroup", path.lstrip("/")), *Path("/sys/fs/cgroup", path.lstrip("/")).parents]
    pairs = [(f / "cpu.max", None) for f in folders if str(f).startswith("/sys/fs/cgroup")]
    pairs += [(Path(f"/sys/fs/cgroup/{c}/cpu.cfs_quota_us"), Path(f"/sys/fs/cgroup/{c}/cpu.cfs_period_us"))
              for c in ("cpu", "cpu,cpuacct")]
    for quota_file, period_file in pairs:
        try:
            words = quota_file.read_text().split() + (period_file.read_text().split() if period_file else [])
            if words[0] not in ("max", "-1"):
                limits.append(int(words[0]) / int(words[1]))
        except (OSError, ValueError, IndexError):
            continue
    return min(limits) if limits else None


def why_sequential(sequential: bool) -> str | None:
    """Why the chains run one after the other here, or None: they fan out."""
    if sequential:
        return "--sequential"
    if cores() < 2:
        return f"this machine gives the run {cores()} core"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed here (pip install 'ray[default]')"
    return None


def main(sequential: bool = False) -> int:
    """`quantgate repro`: fan the chains out locally when it helps, then `dvc repro` for the rest; its exit code."""
    from pipelines.core import lock_stamp

    from pipelines.chains.tasks import dvc_bin, one_run_at_a_time, repo_root, without_token
    from pipelines.models.gguf import stale_model

    root = repo_root()
    model = stale_model(root)  # a GGUF model's file, outside the repository: DVC does not see it change
    if not model and lock_stamp.is_clean(root):  # no file DVC looks at moved since it last found the pipeline clean
        print(UP_TO_DATE)
        return 0
    with one_run_at_a_time(root):
        if model:
            log.warning("repro: %s", model[0])
            lock_stamp.forget(root)
            code = subprocess.run([dvc_bin(), "repro", "--force", "reference"], cwd=root,
                                  env=without_token(dict(os.environ))).returncode
            if code:
                return code
        return _run(root, sequential)


def _run(root: Path, sequential: bool) -> int:
    from pipelines.chains import tasks
    from pipelines.core import lock_stamp
    from pipelines.core.params import load_params

    before = lock_stamp.snapshot(root)
    changed = tasks.dvc_changed(root)
    if not changed:
        lock_stamp.save(root, before)
        print(UP_TO_DATE)
        return 0
    lock_stamp.forget(root)
    params = load_params()
    chains = tasks.chain_stages(params)
    reason = why_sequential(sequential)
    if reason is None and not tasks.stale(chains, changed) and not changed & {"reference", "calibrate"}:
        reason = "no per-variant chain needs running"
    if reason is None and params.device != "cpu":
        from pipelines.models.loading import resolve_device

        if resolve_device(params.device) == "cuda" and not all(
                tasks.resources(params, v)["num_gpus"] or tasks.loads_no_model(params, v)
                for v in {s.variant for s in chains.values()}):
            reason = "the stages run on CUDA here and `fanout` gives some variants' tasks no GPU (fanout.gpus)"
    if reason is None:
        from pipelines.core.ray_auth import RayUnavailable, private_local_cluster

        private_local_cluster()
        log.info("repro: the per-variant chains on a local Ray cluster (%d cores, 127.0.0.1, token auth)", cores())
        try:
            done = tasks.run_chains(root, params, None, leave_ray_failures=True)
            log.info("repro: %d chain stages ran, %d failed (recorded as their variants' failures)%s; now dvc repro",
                     len(done["ran"]), len(done["failed"]),
                     f" in {done['wall_seconds']} s" if "wall_seconds" in done else "")
        except (RayUnavailable, tasks.GpusNotGiven) as err:
            log.warning("repro: %s; plain dvc repro instead", err)
    else:
        log.info("repro: plain dvc repro (%s)", reason)
    code = subprocess.run([tasks.dvc_bin(), "repro"], cwd=root, env=tasks.without_token(dict(os.environ))).returncode
    if code == 0:
        before = lock_stamp.snapshot(root)
        if not tasks.dvc_changed(root):
            lock_stamp.save(root, before)
    return code
