"""How fast the embedded default runs, side by side with the goals: fresh, no-op, after a recipe change, lookup.

    .venv/bin/python benchmarks/pipeline_speed.py [--keep DIR]

In a fresh copy of this checkout (the files git tracks or would track, as a clone has them) it times:
1. `dvc repro` from nothing (goal <= 10 min on 2 cores);
2. `dvc repro` again, with nothing to do (goal <= 3 s);
3. `dvc repro` after changing only the calibration recipe (`calibration.samples`): which stages ran
   (goal: only calibrate, the calibrated variants and what depends on them; fp16 and int8 stay);
4. `quantgate route lookup` as a command (goal <= 0.5 s wall and <= 80 MiB peak RSS, median of 5);
5. the importable router (`pipelines.routing.router.Router`): time per lookup and per classify-and-lookup
   (goal <= 50 microseconds a lookup).
Each line prints the measurement, the goal and their ratio, and the run is written to
docs/measured/pipeline_speed.json (README.md's speed table is made from it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import re
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
from tests.pipeline_e2e_helpers import repo_copy  # noqa: E402


def fresh_copy(dest: Path) -> Path:
    """This checkout as a clean clone has it (the e2e test's copy), committed so DVC sees a git repository."""
    repo = repo_copy(dest)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "fresh"],
                   cwd=repo, check=True)
    return repo


def repro(repo: Path) -> tuple[float, list[str]]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.perf_counter()
    out = subprocess.run([str(BIN / "dvc"), "repro"], cwd=repo, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    if out.returncode != 0:
        sys.exit(f"dvc repro failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return took, re.findall(r"Running stage '([^']+)'", out.stdout)


def line(what: str, value: float, unit: str, goal: float) -> None:
    print(f"{what:58} {value:10.3f} {unit:4} goal <= {goal:<8g} ratio {value / goal:6.2f}  {'ok' if value <= goal else 'OVER'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temp folder)")
    measured.add_arguments(parser, "pipeline_speed")
    args = parser.parse_args()
    numbers: dict = {}
    work = args.keep or Path(tempfile.mkdtemp(prefix="quantgate-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = fresh_copy(work)
    try:
        took, ran = repro(repo)
        line(f"fresh dvc repro ({len(ran)} stages)", took / 60, "min", 10)
        numbers.update(fresh_repro_minutes=round(took / 60, 2), fresh_repro_stages=len(ran))
        took, ran = repro(repo)
        line(f"no-op dvc repro ({len(ran)} stages ran)", took, "s", 3)
        numbers.update(noop_repro_seconds=round(took, 2), noop_stages_ran=len(ran))

        params = yaml.safe_load((repo / "params.yaml").read_text())
        params["calibration"]["samples"] = params["calibration"]["samples"] - 32
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
        took, ran = repro(repo)
        print(f"{'after changing calibration.samples only':58} {took:10.1f} s    ran: {', '.join(ran)}")
        untouched = [s for s in ("quantize@fp16", "quantize@int8", "memory@fp16", "memory@int8", "evaluate@int8",
                                 "baseline") if s in ran]
        print(f"{'':58} {'':15} stages that do not read the recipe and ran anyway: {untouched or 'none'}")
        numbers.update(recipe_change_seconds=round(took, 1), recipe_change_ran=ran, recipe_change_untouched=untouched)

        walls, peaks = [], []
        for _ in range(5):
            out = subprocess.run(["/usr/bin/time", "-f", "%e %M", str(BIN / "quantgate"), "route", "lookup",
                                  "What is 12 + 35?", "--context-tokens", "40"], cwd=repo, capture_output=True, text=True)
            wall, peak = out.stderr.strip().splitlines()[-1].split()
            walls.append(float(wall))
            peaks.append(int(peak) / 1024)
        line("quantgate route lookup, wall (median of 5)", statistics.median(walls), "s", 0.5)
        line("quantgate route lookup, peak RSS (median of 5)", statistics.median(peaks), "MiB", 80)
        numbers.update(lookup_wall_seconds=statistics.median(walls), lookup_peak_rss_mib=round(statistics.median(peaks), 1))

        from pipelines.routing.router import Router

        router = Router.from_file(repo / "results/routing_table.json")
        n = 100_000
        per = timeit.timeit(lambda: router.lookup("math", 40), number=n) / n
        line("Router.lookup(domain, tokens)", per * 1e6, "us", 50)
        numbers["router_lookup_us"] = round(per * 1e6, 3)
        per = timeit.timeit(lambda: router.route("What is 12 + 35?", 40), number=n // 10) / (n // 10)
        line("Router.route(text, tokens) incl. classification", per * 1e6, "us", 50)
        numbers["router_route_us"] = round(per * 1e6, 3)
        probes = sum(1 for _ in (ROOT / "eval" / "code" / "items.jsonl").open())
        measured.record(args.record, "pipeline_speed", numbers,
                        note=f"Measured with {probes} code probes (eval/code/items.jsonl).")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
