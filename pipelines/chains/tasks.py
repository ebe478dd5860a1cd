"""The per-variant chains of dvc.yaml (quantize/admit -> memory, baseline -> evaluate) as Ray tasks, recorded in
dvc.lock as if `dvc repro` had run them: what `quantgate fanout` (a cluster) and `quantgate repro` (a private local
cluster) share.

Ray schedules; quantgate only says what depends on what. Each stage of a chain runs as one Ray task that runs the
stage's own `quantgate` command in a subprocess (so in its own process, as `dvc repro` would run it, with the same
thread count: see `stage_env`), asking for the resources `fanout` in params.yaml gives its variant. The workspace must
be one filesystem that every node sees (NFS or the like: docs/fanout.md): outputs land where `dvc repro` puts them,
each written atomically by the stage itself. When every task has ended, `dvc commit` records the stages that ran in
dvc.lock, so `dvc status` is clean for them and the gate accepts their results.

Faults: a task whose worker dies (a node lost, SIGKILL) is retried `fanout.retries` times by Ray; a stage command
killed by its timeout (the stage's own timeout from params plus `fanout.timeout_margin_seconds`), or whose retries ran
out, is recorded as that variant's failure with the cause (`--failed-because`), and the stages after it run as they
would after any failure. Only the fp16 baseline is fatal, as in `dvc repro`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.paths import BASELINE, DVC_YAML, EVAL_DIR, PARAMS_FILE, REFERENCE_DIR
from pipelines.core.ray_auth import connect

log = logging.getLogger("pipelines.fanout")

PR_SET_PDEATHSIG = 1
THREAD_COUNTS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch obeys both (MKL's wins)


@dataclass
class Stage:
    """One dvc.yaml stage of a chain: its name, its command, what it waits for, and its kind's timeout."""

    name: str  # as in dvc.yaml: quantize@int8, baseline, ...
    argv: list[str]  # the stage's cmd, split
    variant: str
    kind: str  # quantize, admit, memory, baseline, evaluate
    timeout: float
    after: list[str] = field(default_factory=list)


def chain_stages(params) -> dict[str, Stage]:
    """Every per-variant stage of dvc.yaml in dependency order (the commands are dvc.yaml's: tested)."""
    margin = params.fanout.timeout_margin_seconds
    # the memory stage measures once more per allocator it compares (CUDA), each in its own process and timeout
    memory_t = params.memory.timeout_seconds * (1 + len(params.memory.compare_allocators)) + margin
    quantize_t = params.quantize.timeout_seconds + margin
    evaluate_t = params.evaluate.timeout_seconds + margin
    stages: dict[str, Stage] = {}
    # fp16's quantize, then the baseline, ahead of every other quantize and memory stage: every evaluate waits for the
    # baseline, the longest stage of a real model's run (fp16 answers every look). Best effort: Ray keeps submission
    # order only among tasks of the same resources.
    for name in sorted(params.variants, key=lambda n: n != BASELINE):
        stages[f"quantize@{name}"] = Stage(f"quantize@{name}", ["quantgate", "quantize", name], name, "quantize",
                                           quantize_t)
        if name == BASELINE:
            stages["baseline"] = Stage("baseline", ["quantgate", "baseline"], BASELINE, "baseline", evaluate_t,
                                       [f"quantize@{BASELINE}"])
    for name in params.candidates:
        stages[f"admit@{name}"] = Stage(f"admit@{name}", ["quantgate", "admit", name], name, "admit", quantize_t)
    made = {name: f"quantize@{name}" for name in params.variants} | {name: f"admit@{name}" for name in params.candidates}
    suffix = {name: "" for name in params.variants} | {name: "-candidate" for name in params.candidates}  # dvc.yaml's
    # the evaluates before the memory stages: after the baseline they are the longest path to compare; memory fills
    # the cores they leave (measured on the real-model profile: docs/real-model.md, "Where the time goes")
    for name, maker in made.items():
        stage = f"evaluate{suffix[name]}@{name}"
        stages[stage] = Stage(stage, ["quantgate", "evaluate", name], name, "evaluate", evaluate_t, [maker, "baseline"])
    for name, maker in made.items():
        stage = f"memory{suffix[name]}@{name}"
        stages[stage] = Stage(stage, ["quantgate", "memory", name], name, "memory", memory_t, [maker])
    return stages


def inputs_fingerprint(root: Path, params) -> dict[str, list[int]]:
    """(size, mtime) of every file the chains read that a person could edit while they run: params.yaml, dvc.yaml,
    the code, the probes, the calibration sets, the reference model, the candidates' paths (not a variant's checkpoint
    a served copy names: the chains write it) and fp16's log. `dvc commit` records the inputs as they are when it runs;
    if they changed since the tasks started, it would vouch for other inputs' outputs, so the fan-out refuses to."""
    paths = [root / PARAMS_FILE, root / DVC_YAML, root / "pipelines", root / EVAL_DIR, root / "calibration_sets",
             root / REFERENCE_DIR, *[(root / c.path) for c in params.candidates.values() if Path(c.path).parts[:1]
                                     not in (("models",), ("results",))],
             *([root / params.baseline.path] if params.baseline.source != "here" else [])]  # fp16's sample log
    seen: dict[str, list[int]] = {}
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else []
        for path in files:
            if "__pycache__" in path.parts:
                continue
            st = path.stat()
            seen[str(path)] = [st.st_size, st.st_mtime_ns]
    return seen


def stale(stages: dict[str, Stage], changed: set[str]) -> list[str]:
    """The stages to run: those DVC finds changed, and every stage after one of them."""
    need: list[str] = []
    for name, stage in stages.items():  # dependency order
        if name in changed or any(up in need for up in stage.after):
            need.append(name)
    return need


def dvc_changed(root: Path) -> set[str]:
    """Stages `dvc status` reports as changed (never run, changed deps, outs or params)."""
    out = subprocess.run([dvc_bin(), "status", "--json"], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise QuantgateError(f"dvc status failed: {out.stderr.strip() or out.stdout.strip()}")
    return set(json.loads(out.stdout or "{}"))


def dvc_bin() -> str:
    return str(Path(sys.executable).with_name("dvc"))


def loads_no_model(params, variant: str, kind: str | None = None) -> bool:
    """A task that needs no GPU: a log or endpoint candidate's, and the baseline's when fp16 comes from either."""
    candidate = params.candidates.get(variant)
    return bool(candidate and candidate.source != "checkpoint") or (kind == "baseline" and params.baseline.source != "here")


def resources(params, variant: str, kind: str | None = None) -> dict:
    """Ray resources of one task (`kind`: its stage's): fanout.per_variant's for the variant, else fanout's; no GPU
    held idle by a task that loads no model here."""
    r = params.fanout.per_variant.get(variant, params.fanout)
    return {"num_cpus": r.cpus, "num_gpus": 0 if loads_no_model(params, variant, kind) else r.gpus}


def _die_with_parent() -> None:
    """In the stage's process: SIGKILL when the Ray worker that started it dies (Linux), so a killed worker
    leaves no orphan stage behind to race its retry."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def thread_settings() -> dict[str, str]:
    """The OpenMP settings every stage of a fan-out gets, taken where `quantgate fanout` runs.
    - `OMP_NUM_THREADS`, `MKL_NUM_THREADS`: this shell's, or none (torch's default, as under `dvc repro`, whatever
      Ray's environment says: `stage_env`). A thread count sets torch's summation order: it can change an answer.
    - `OMP_WAIT_POLICY`: this shell's, else PASSIVE: an idle OpenMP thread busy-waits (libgomp's default) on a core
      the next stage needs: two evaluates at once took 166 s so, 87 s with PASSIVE (docs/fanout.md); no arithmetic
      changes."""
    settings = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    settings.update({name: os.environ[name] for name in THREAD_COUNTS if name in os.environ})
    return settings


def stage_env(env: dict, gpu_ids: list | None = None) -> dict[str, str]:
    """The stage's environment: this worker's, with the driver's `env` on top.

    Ray puts `OMP_NUM_THREADS` = the task's CPUs into its workers (`ray up` nodes start with 1, and a node may
    set `MKL_NUM_THREADS`); unless the driver set them, they are removed, so the stage gets the thread count
    `dvc repro` would give it. `gpu_ids`: the GPUs Ray gave the task (None outside Ray). A task given none sees
    none: Ray 2.60 no longer hides a node's GPUs from it, and it would use GPUs that other tasks hold. The cluster's
    token (RAY_AUTH_TOKEN) is not passed on: a stage needs no Ray, and model-written code runs inside it."""
    out = without_token({**os.environ, **env})
    for name in THREAD_COUNTS:
        if name not in env:
            out.pop(name, None)
    if gpu_ids is not None and not gpu_ids:
        out["CUDA_VISIBLE_DEVICES"] = ""
    return out


class GpusNotGiven(QuantgateError):
    """The cluster has GPUs and fanout gives a variant's tasks none (`quantgate repro` then runs plain `dvc repro`)."""


def check_gpus(params, todo: list[tuple[str, str]], cluster_gpus: float) -> None:
    """Refuse a fan-out whose stages (`todo`: (variant, kind) of each) would run on the CPU where `dvc repro` runs on
    CUDA: on a cluster with GPUs, a task given no GPU sees none (`stage_env`), so a `device: auto` stage would fall
    back to the CPU and give other answers than a GPU run. A task that loads no model needs none."""
    if params.device == "cpu" or not cluster_gpus:
        return
    without = list(dict.fromkeys(v for v, kind in todo if not loads_no_model(params, v, kind)
                                 and not resources(params, v, kind)["num_gpus"]))
    if without:
        raise GpusNotGiven(f"the cluster has {cluster_gpus:g} GPU(s), but fanout gives {', '.join(without)} none (fanout"
                           f".gpus, .per_variant): their stages would run on the CPU, unlike `dvc repro` with device: "
                           f"{params.device}; give them GPUs, or set device: cpu")


def _task_gpus() -> list | None:
    """The GPUs Ray gave this task, or None outside a Ray task."""
    try:
        import ray

        return list(ray.get_gpu_ids()) if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside a worker: no assignment to honour
        return None


def run_stage(root: str, stage: Stage, env: dict, *upstream) -> dict:
    """Run one stage's command in `root` (a Ray task's body). Never raises for the stage's own failure: returns what
    happened, for the driver to record. `upstream`: the results it waits for; if one failed, it does not run."""
    failed = [u["stage"] for u in upstream if not u.get("ok")]
    if failed:
        return {"stage": stage.name, "ok": False, "upstream_failed": True, "error": f"{', '.join(failed)} failed first"}
    started = time.monotonic()
    try:
        proc = subprocess.Popen(stage.argv, cwd=root, env=stage_env(env, _task_gpus()), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=_die_with_parent)
    except OSError as err:  # no such workspace or `quantgate` on this node: the same path on every node (docs)
        return {"stage": stage.name, "ok": False, "error": f"could not start {stage.argv[0]} in {root} on {_node()}: "
                f"{err.strerror or err} (the workspace and the environment must be at the same path on every node)",
                "seconds": 0.0, "node": _node(), "pid": os.getpid()}
    try:
        output, _ = proc.communicate(timeout=stage.timeout)
        error = None if proc.returncode == 0 else f"exited with status {proc.returncode}: {output.strip()[-1500:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        output, error = "", f"ran past its {stage.timeout:g} s timeout (fanout) and was killed"
    return {"stage": stage.name, "ok": error is None, "error": error, "seconds": round(time.monotonic() - started, 1),
            "node": _node(), "pid": os.getpid()}


def _node() -> str:
    """The Ray node this runs on (host and node id: several nodes may share a host), else the host."""
    try:
        import ray

        if ray.is_initialized():
            return f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
    except Exception:  # noqa: BLE001 - naming the node is best effort
        pass
    return socket.gethostname()


def record_failure(root: Path, stage: Stage, cause: str, env: dict) -> None:
    """The stage's own failure record (its command with --failed-because), written where its outputs go."""
    if stage.kind == "baseline":
        raise QuantgateError(f"the fp16 baseline could not be evaluated: {cause}")
    done = subprocess.run([*stage.argv, "--failed-because", cause[:2000]], cwd=root, env=stage_env(env),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise QuantgateError(f"{stage.name}: could not record its failure ({done.stderr.strip()[-500:]})")


def repo_root() -> Path:
    """The DVC repository this command runs in (DVC_ROOT, else the nearest folder up from here holding `.dvc/`), as
    `dvc repro` finds it; the process moves there, where params.yaml and the stages' relative paths are."""
    here = Path(os.environ.get("DVC_ROOT") or ".").resolve()
    for folder in (here, *here.parents):
        if (folder / ".dvc").is_dir() and (folder / DVC_YAML).is_file():
            os.chdir(folder)
            return folder
    raise QuantgateError(f"{here} is not inside a DVC repository with a dvc.yaml (run it in the quantgate checkout)")


def without_token(environ: dict) -> dict:
    """An environment for what runs outside Ray (stages, dvc): no cluster token; model-written code runs in stages."""
    return {k: v for k, v in environ.items() if k != "RAY_AUTH_TOKEN"}


@contextlib.contextmanager
def one_run_at_a_time(root: Path):
    """An exclusive lock: two runs in one workspace would commit one's results against the other's checkpoints."""
    path = root / ".dvc" / "tmp" / "quantgate-repro.lock"
    path.parent.mkdir(exist_ok=True)  # .dvc/tmp: git-ignored by DVC's own .dvc/.gitignore
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise QuantgateError(f"another quantgate repro or fanout is running in {root} (it holds {path})") from None
        yield


def run_chains(root: Path, params, address: str | None, env: dict | None = None, insecure: bool = False,
               leave_ray_failures: bool = False) -> dict:
    """The whole fan-out; returns what ran where, what failed, and what was committed. A cluster named by address
    (or RAY_ADDRESS) is checked (`connect`) before anything runs; a local one is started, with a token, only when
    a stage needs running. `leave_ray_failures` (quantgate repro): a stage whose Ray task died (Ray's memory monitor,
    a lost raylet), and what comes after it, is not recorded as the variant's failure but left uncommitted, for the
    `dvc repro` that follows to run as a sequential run would."""
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **thread_settings(),
           **(env or {})}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        connect(address, insecure)
    try:
        upstream = subprocess.run([dvc_bin(), "repro", "calibrate"], cwd=root, env=without_token({**os.environ, **env}))
        if upstream.returncode != 0:
            raise QuantgateError("dvc repro calibrate failed: the chains need the reference model and calibration sets")
        stages = chain_stages(params)
        todo = stale(stages, dvc_changed(root))
        before = inputs_fingerprint(root, params)
        report: dict = {"ran": {}, "failed": {}, "committed": [],
                        "skipped_up_to_date": [s for s in stages if s not in todo]}
        if not todo:
            log.info("fanout: every chain stage is up to date")
            return report
        if address is None:
            connect(None, insecure)
        import ray

        check_gpus(params, [(stages[n].variant, stages[n].kind) for n in todo], ray.cluster_resources().get("GPU", 0))
        remote = ray.remote(max_retries=params.fanout.retries, retry_exceptions=False)(run_stage)
        refs: dict[str, object] = {}
        started = time.monotonic()
        for name in todo:
            stage = stages[name]
            ups = [refs[u] for u in stage.after if u in refs]
            refs[name] = remote.options(name=name, **resources(params, stage.variant, stage.kind)).remote(str(root), stage, env, *ups)
        results = _gather(refs, stages)
        report["wall_seconds"] = round(time.monotonic() - started, 1)
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
    left: list[str] = []
    for name in todo:  # dependency order: a failure is recorded before the stages after it run again here
        stage, result = stages[name], results[name]
        if leave_ray_failures and (result.get("ray_failed") or any(u in left for u in stage.after)):
            left.append(name)
            continue
        if result.get("ok"):
            report["ran"][name] = result
            continue
        if result.get("upstream_failed"):  # never ran: its input failed; now that failure is recorded, run it
            log.info("fanout: %s runs here, after %s", name, result["error"])
            local = run_stage(str(root), stage, env)
            if local["ok"]:
                report["ran"][name] = local
                continue
            result = local
        log.warning("fanout: %s FAILED (%s); recorded as %s's failure", name, result["error"], stage.variant)
        record_failure(root, stage, f"{name}: {result['error']}", env)
        report["failed"][name] = result["error"]
    after = inputs_fingerprint(root, params)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        raise QuantgateError(f"{len(changed)} input file(s) changed while the fan-out ran (e.g. {changed[0]}): dvc.lock "
                             "would vouch for outputs made from other inputs, so nothing was committed; run "
                             "the command again (quantgate fanout or quantgate repro)")
    committed = [name for name in todo if name in report["ran"] or name in report["failed"]]
    if left:
        report["left_to_dvc"] = left
        log.warning("fanout: Ray lost %s; left for dvc repro to run", ", ".join(left))
    if not committed:  # `dvc commit` without targets would vouch for every stage
        return report
    done = subprocess.run([dvc_bin(), "commit", "--force", *committed], cwd=root, env=without_token({**os.environ, **env}),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise QuantgateError(f"dvc commit failed: {done.stderr.strip() or done.stdout.strip()}")
    report["committed"] = committed
    return report


def _gather(refs: dict[str, object], stages: dict[str, Stage]) -> dict[str, dict]:
    """Each task's result, as tasks finish (progress bar); a task Ray gave up on, or that never ran because
    a task before it failed, becomes a result saying so."""
    import ray
    from ray.exceptions import RayError

    from pipelines.core import logs

    by_ref = {ref: name for name, ref in refs.items()}
    raw: dict[str, dict | Exception] = {}
    pending = list(refs.values())
    with logs.progress(total=len(pending), desc="fanout", unit="stage") as bar:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            name = by_ref[ready[0]]
            try:
                raw[name] = ray.get(ready[0])
                row = raw[name]
                log.info("fanout: %s %s in %ss on %s", name, "done" if row["ok"] else f"FAILED ({row['error']})",
                         row.get("seconds", "-"), row.get("node", "-"))
            except RayError as err:  # the task's worker died more often than Ray retries, or an input's did
                raw[name] = err
            bar.update()
    results: dict[str, dict] = {}
    for name in refs:  # dependency order: a task that failed because its input's task did is not its fault
        got = raw[name]
        if isinstance(got, dict):
            results[name] = got
            continue
        failed_ups = [u for u in stages[name].after if u in results and not results[u].get("ok")]
        results[name] = ({"stage": name, "ok": False, "upstream_failed": True, "error": f"{', '.join(failed_ups)} failed first"}
                         if failed_ups else
                         {"stage": name, "ok": False, "ray_failed": True, "error": f"its Ray task failed after the retries: "
                                                               f"{type(got).__name__}: {str(got).strip().splitlines()[0][:500]}"})
    return results
