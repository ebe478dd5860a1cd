"""How fast the README's main command runs the embedded default, and where the time goes, beside the goals.

    .venv/bin/python benchmarks/pipeline_speed.py [--keep DIR] [--sequential]

In a fresh copy of this checkout (the files git tracks or would track, as a clone has them) it times:
1. `quantgate repro` from nothing: what scripts/run.sh runs after the install (goal <= 8 min on 2 cores, the
   shadow replay included); --sequential also times a plain `dvc repro` in a second copy;
2. `quantgate repro` and `dvc repro` again, with nothing to do (goal <= 2 s);
3. `quantgate repro` after changing only the calibration recipe (`calibration.samples`): which stages ran;
4. `quantgate route lookup` as a command (goal <= 0.3 s wall, <= 80 MiB peak RSS, median of 5), and the
   importable router per lookup (goal <= 50 microseconds).
For runs 1 and 3 it prints each stage's wall time beside the seconds inside its bare library calls (quantize,
lm-eval, forward passes, soak rounds, checkpoint loads, MLflow), which every stage process writes to
logs/timings/ (pipelines/core/timing.py): the rest is overhead (interpreter starts, imports, DVC). The run is
written to docs/measured/pipeline_speed.json (README.md and docs/speed.md render it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from benchmarks import measured  # noqa: E402
from pipelines.core.paths import TIMINGS_DIR  # noqa: E402
from tests.pipeline_e2e_helpers import repo_copy  # noqa: E402
from tests.test_fanout import verdicts  # noqa: E402
from tests.test_repro import routes  # noqa: E402

GOALS = {"fresh_minutes": 8, "noop_seconds": 2, "lookup_wall_seconds": 0.3, "lookup_peak_rss_mib": 80,
         "router_lookup_us": 50}


def fresh_copy(dest: Path) -> Path:
    """This checkout as a clean clone has it (the e2e test's copy), committed so DVC sees a git repository."""
    repo = repo_copy(dest)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "fresh"],
                   cwd=repo, check=True)
    return repo


def timed(argv: list[str], repo: Path) -> tuple[float, str]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.perf_counter()
    out = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return took, out.stdout + out.stderr


def stage_times(repo: Path, since: float) -> dict[str, dict]:
    """Per stage that ran since `since`: its command's wall time and the library seconds of all its processes."""
    stages: dict[str, dict] = {}
    for folder in sorted((repo / TIMINGS_DIR).iterdir()):
        rows = [json.loads(f.read_text()) for f in folder.glob("*.json")]
        rows = [r for r in rows if r["ended"] >= since]
        if not rows or folder.name == "repro":
            continue
        pids = {r["pid"] for r in rows}
        tops = [r for r in rows if r["parent"] not in pids]
        if not tops:  # only a child's numbers (its stage process was killed): nothing to time the stage by
            continue
        top = max(tops, key=lambda r: r["wall_seconds"])
        library: dict[str, dict] = {}
        for r in rows:
            for call, v in r["library"].items():
                seen = library.setdefault(call, {"seconds": 0.0, "calls": 0})
                seen["seconds"] = round(seen["seconds"] + v["seconds"], 3)
                seen["calls"] += v["calls"]
        stages[folder.name] = {"wall_seconds": top["wall_seconds"], "processes": len(rows), "library": library}
    return stages


def differences(a: Path, b: Path) -> list[str]:
    """Verdict rows (verdict, items, difference, interval) and routing rows that differ between two runs: the same
    comparison tests/test_fanout.py and tests/test_repro.py make."""
    left, right = {**verdicts(a), **{r[:2]: r for r in routes(a)}}, {**verdicts(b), **{r[:2]: r for r in routes(b)}}
    return sorted(" ".join(map(str, k)) for k in set(left) | set(right) if left.get(k) != right.get(k))


def print_stages(title: str, stages: dict[str, dict]) -> None:
    print(f"\n{title}\n{'stage':22} {'wall s':>7} {'library s':>9} {'other s':>8}  library calls")
    for name, s in sorted(stages.items(), key=lambda kv: -kv[1]["wall_seconds"]):
        lib = sum(v["seconds"] for v in s["library"].values())
        calls = ", ".join(f"{k} {v['seconds']:.1f}" + (f" ({v['calls']}x)" if v["calls"] > 1 else "")
                          for k, v in sorted(s["library"].items(), key=lambda kv: -kv[1]["seconds"]))
        print(f"{name:22} {s['wall_seconds']:7.1f} {lib:9.1f} {s['wall_seconds'] - lib:8.1f}  {calls}")


def line(what: str, value: float, unit: str, goal: float) -> None:
    print(f"{what:58} {value:10.3f} {unit:4} goal <= {goal:<8g} ratio {value / goal:6.2f}  {'ok' if value <= goal else 'OVER'}")


def lookups(repo: Path, numbers: dict) -> None:
    walls, peaks = [], []
    for _ in range(5):
        out = subprocess.run(["/usr/bin/time", "-f", "%e %M", str(BIN / "quantgate"), "route", "lookup",
                              "What is 12 + 35?", "--context-tokens", "40"], cwd=repo, capture_output=True, text=True)
        wall, peak = out.stderr.strip().splitlines()[-1].split()
        walls.append(float(wall))
        peaks.append(int(peak) / 1024)
    numbers.update(lookup_wall_seconds=statistics.median(walls), lookup_peak_rss_mib=round(statistics.median(peaks), 1))
    line("quantgate route lookup, wall (median of 5)", numbers["lookup_wall_seconds"], "s", GOALS["lookup_wall_seconds"])
    line("quantgate route lookup, peak RSS (median of 5)", numbers["lookup_peak_rss_mib"], "MiB",
         GOALS["lookup_peak_rss_mib"])
    from pipelines.routing.router import Router

    router = Router.from_file(repo / "results/routing_table.json")
    n = 100_000
    numbers["router_lookup_us"] = round(timeit.timeit(lambda: router.lookup("math", 40), number=n) / n * 1e6, 3)
    numbers["router_route_us"] = round(timeit.timeit(lambda: router.route("What is 12 + 35?", 40), number=n // 10)
                                       / (n // 10) * 1e6, 3)
    line("Router.lookup(domain, tokens)", numbers["router_lookup_us"], "us", GOALS["router_lookup_us"])
    line("Router.route(text, tokens) incl. classification", numbers["router_route_us"], "us", GOALS["router_lookup_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temp folder)")
    parser.add_argument("--sequential", action="store_true", help="also time a plain `dvc repro` from nothing")
    measured.add_arguments(parser, "pipeline_speed")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="quantgate-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    quantgate, dvc = str(BIN / "quantgate"), str(BIN / "dvc")
    numbers: dict = {"command": "quantgate repro", "goals": GOALS, "stages": {}}
    try:
        repo = fresh_copy(work / "repro")
        since = time.time()
        took, out = timed([quantgate, "repro"], repo)
        numbers["stages"]["fresh"] = stage_times(repo, since)
        numbers.update(fresh_minutes=round(took / 60, 2), fresh_parallel="local Ray cluster" in out,
                       fresh_stages=len(numbers["stages"]["fresh"]))
        line(f"fresh quantgate repro ({numbers['fresh_stages']} stages)", took / 60, "min", GOALS["fresh_minutes"])
        if args.sequential:
            seq = fresh_copy(work / "sequential")
            since = time.time()
            took, _ = timed([dvc, "repro"], seq)
            numbers["stages"]["sequential"] = stage_times(seq, since)
            numbers["sequential_minutes"] = round(took / 60, 2)
            line("fresh dvc repro (sequential)", took / 60, "min", GOALS["fresh_minutes"])
            numbers["differs_from_sequential"] = differences(repo, seq)
            print(f"{'fanned out vs sequential: rows that differ':58} {numbers['differs_from_sequential'] or 'none'}")
        for name, argv in (("noop_seconds", [quantgate, "repro"]), ("noop_dvc_seconds", [dvc, "repro"])):
            took, _ = timed(argv, repo)
            numbers[name] = round(took, 2)
            line(f"no-op {' '.join(Path(a).name for a in argv)}", took, "s", GOALS["noop_seconds"])

        params = yaml.safe_load((repo / "params.yaml").read_text())
        params["calibration"]["samples"] = params["calibration"]["samples"] - 32
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
        since = time.time()
        took, _ = timed([quantgate, "repro"], repo)
        ran = sorted(numbers["stages"].setdefault("change", stage_times(repo, since)))
        untouched = [s for s in ("quantize@fp16", "quantize@int8", "memory@fp16", "memory@int8", "evaluate@int8",
                                 "baseline") if s in ran]
        print(f"{'after changing calibration.samples only':58} {took:10.1f} s    ran: {', '.join(ran)}")
        print(f"{'':58} {'':15} stages that do not read the recipe and ran anyway: {untouched or 'none'}")
        numbers.update(change_seconds=round(took, 1), change_ran=ran, change_untouched=untouched)
        lookups(repo, numbers)
        print_stages("fresh run: where the time goes", numbers["stages"]["fresh"])
        if args.sequential:
            print_stages("sequential dvc repro", numbers["stages"]["sequential"])
        print_stages("after changing calibration.samples", numbers["stages"]["change"])
        probes = sum(1 for _ in (ROOT / "eval" / "code" / "items.jsonl").open())
        measured.record(args.record, "pipeline_speed", numbers,
                        note=f"Measured with {probes} code probes (eval/code/items.jsonl).")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
