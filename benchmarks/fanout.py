"""Fan-out on Ray against sequential `dvc repro`: wall time for the four default variants, and Ray's cost per task.

    .venv/bin/python benchmarks/fanout.py [--small] [--cpus 2] [--keep DIR]

Two fresh copies of the repository (tracked files, as a clean clone has them). One runs `dvc repro`; the
other runs `quantgate fanout` on a local Ray cluster (`ray start --head --num-cpus CPUS`) and then
`dvc repro` for what is left (memory-report, compare, route, record). Both start from the shipped
reference model, so both run the same stages. `--small` uses the end-to-end test's small settings (a
quick check of the machinery, not the number the docs quote). Then Ray's overhead: the round trip of
50 empty tasks, and of a task that runs `true` as a stage would run its command. Prints the times and
the ratio fan-out / sequential (goal <= 0.75 on 2 cores). A run of the embedded default is written to
docs/measured/fanout.json (docs/fanout.md renders it; --label names its row; --small runs are not recorded unless
--record PATH is given; --no-record: print only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import measured  # noqa: E402
from tests.test_fanout import env, free_port, small_repo, tool  # noqa: E402
from tests.pipeline_e2e_helpers import repo_copy  # noqa: E402


def timed(args: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed in {cwd}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def overhead(address: str) -> tuple[float, float]:
    """(ms per empty task, ms per `true` run as a stage task), each the median of sequential round trips."""
    import statistics

    os.environ.update({k: v for k, v in env().items() if k.startswith("RAY_AUTH")})  # the cluster's token auth
    import ray

    from pipelines.chains import tasks

    ray.init(address=address, log_to_driver=False)
    try:
        noop = ray.remote(lambda: None)
        stage = ray.remote(tasks.run_stage)
        ray.get(noop.remote())  # a worker started
        empty, command = [], []
        true = tasks.Stage("bench", ["true"], "fp16", "memory", 60)
        for _ in range(50):
            t = time.perf_counter()
            ray.get(noop.remote())
            empty.append(time.perf_counter() - t)
            t = time.perf_counter()
            ray.get(stage.remote(".", true, {}))
            command.append(time.perf_counter() - t)
        return 1000 * statistics.median(empty), 1000 * statistics.median(command)
    finally:
        ray.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the end-to-end test's small settings")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs the Ray cluster offers (one task per CPU)")
    ap.add_argument("--keep", type=Path, help="keep the two copies here")
    ap.add_argument("--label", default="this checkout", help="the row's name in docs/fanout.md's table")
    measured.add_arguments(ap, "fanout")
    args = ap.parse_args()
    if args.small and args.record == measured.MEASURED / "fanout.json":
        args.record = None  # the small settings are a check of the machinery, not the number the docs quote
    work = args.keep or Path(tempfile.mkdtemp(prefix="fanout-bench-"))
    variants = ["fp16", "int8", "awq4", "gptq3"]
    copies = {}
    for name in ("sequential", "fanned"):
        (work / name).mkdir(parents=True, exist_ok=False)
        copies[name] = small_repo(work / name, variants) if args.small else repo_copy(work / name)
    port, temp = free_port(), Path(f"/tmp/ray-bench-{os.getpid()}")
    subprocess.run([tool("ray"), "start", "--head", f"--port={port}", f"--num-cpus={args.cpus}",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                   env=env(), check=True, capture_output=True)
    try:
        address = f"127.0.0.1:{port}"
        sequential = timed([tool("dvc"), "repro"], copies["sequential"])
        fan = timed([tool("quantgate"), "fanout", "--address", address], copies["fanned"])
        rest = timed([tool("dvc"), "repro"], copies["fanned"])
        empty_ms, command_ms = overhead(address)
    finally:
        subprocess.run([tool("ray"), "stop", "--force"], env=env(), capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)
    print(f"{'small settings' if args.small else 'embedded default'}, variants {', '.join(variants)}, "
          f"Ray cluster of {args.cpus} CPUs on {os.cpu_count()} cores")
    print(f"sequential dvc repro:           {sequential:7.1f} s")
    print(f"quantgate fanout + dvc repro:   {fan + rest:7.1f} s  ({fan:.1f} + {rest:.1f})")
    print(f"ratio fan-out / sequential:     {(fan + rest) / sequential:7.2f}  (goal <= 0.75)")
    print(f"Ray overhead per task:          {empty_ms:7.1f} ms (empty task), {command_ms:.1f} ms (a `true` stage)")
    measured.record(args.record, "fanout", {"runs": [{
        "label": args.label, "sequential_seconds": round(sequential, 1), "fanout_seconds": round(fan, 1),
        "rest_seconds": round(rest, 1), "ratio": round((fan + rest) / sequential, 3), "empty_task_ms": round(empty_ms, 2),
        "stage_task_ms": round(command_ms, 2), "cpus": args.cpus, "small": args.small, "variants": variants}]})
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
