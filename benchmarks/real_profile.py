"""The real-model profile end to end: where its time goes, fanned out and sequential, and the seed incident asked of it.

    .venv/bin/python benchmarks/real_profile.py [--sequential [--no-fanned-out]] [--seed-incident] [--keep DIR]
                                                [--profile smollm2]

1. A fresh workspace of the profile (profiles/<name>.yaml through `quantgate profile`'s own sync, in DIR or a temp
   folder), then `quantgate repro` there, timed: the chains side by side on a local Ray cluster, as
   `bash scripts/run.sh --model <name>` runs them after its install.
2. `--seed-incident`: in the first workspace, committed, `dvc exp run -S 'calibration.exclude=[code_comment]'`:
   awq4 and gptq3 quantized without code comments, judged again (the README's experiment, on the real model).
3. `--sequential`: another fresh workspace, `quantgate repro --sequential` (plain `dvc repro`), timed
   (`--no-fanned-out`: this part alone; with `--keep DIR` a later run in DIR can add the other). With both runs'
   workspaces in DIR, the later one's record says which verdict and routing rows differ between them. Each part is
   recorded, in a file of its own and named by the commit its workspace was synced from, as soon as it is measured.
Per stage: its wall time beside the seconds inside its library calls (logs/timings, pipelines/core/timing.py).
Writes docs/measured/real_profile.json (the fanned-out run: timings, the verdicts decided), real_profile_sequential.json
and real_profile_seed_incident.json (its rows), and copies the fanned-out run's results that the docs quote into
docs/measured/<name>/ (results/..., params.yaml): docs/real-model.md renders its tables from them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402
from benchmarks.pipeline_speed import BIN, differences, print_stages, stage_times  # noqa: E402
from pipelines.core.io import read_json  # noqa: E402
from pipelines.core.paths import PROFILE_MARKER  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOAL_MINUTES = 45.0  # issue 37: the whole real profile on 2 cores, after the install
# what docs/real-model.md quotes from the run (copied beside the profile's params.yaml)
QUOTED = ["results/reference.json", "results/compare.json", "results/summary.json", "results/memory_summary.json",
          "results/memory", "results/quantize", "results/shadow.json", "results/shadow_metrics.json",
          "results/routing_table.json", "results/calibration/coverage.json", "results/eval/fp16.json",
          "results/eval/int8.json", "results/eval/awq4.json", "results/eval/gptq3.json", "results/plots"]
INCIDENT_ROWS = [(v, d) for v in ("awq4", "gptq3") for d in ("code_comment", "code", "math", "chat")]


def run(argv: list[str], cwd: Path, check: bool = True) -> tuple[float, str, int]:
    """`argv` in a workspace as `bash scripts/run.sh --model NAME` runs it there: the workspace's code first on
    PYTHONPATH; MLflow into a store of the benchmark's own (never the checkout's, whose registry it would move)."""
    import os

    started = time.perf_counter()
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
                              "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(cwd),
                              "MLFLOW_TRACKING_URI": f"sqlite:///{cwd.parent / 'mlflow.db'}"})
    if check and out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed in {cwd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return time.perf_counter() - started, out.stdout + out.stderr, out.returncode


def workspace(name: str, where: Path) -> Path:
    """A fresh workspace of the profile under `where`, made by the profile command's own sync; one left there by an
    earlier run is refused (its dvc.lock and results would make the timed run a partial one)."""
    from pipelines.profile import sync

    if (where / name / "dvc.lock").exists() or (where / name / "results").exists():
        sys.exit(f"{where / name} holds an earlier run: give --keep a new folder (or remove {where})")
    return sync(name, ROOT, where)


def synced_from(repo: Path) -> str:
    """The checkout commit a workspace was synced from (`+dirty` when it had edits): the code that ran there."""
    source = json.loads((repo / PROFILE_MARKER).read_text(encoding="utf-8"))["synced_from"]
    return f"{(source.get('commit') or 'unknown')[:7]}" + ("+dirty" if source.get("dirty") else "")


def timed_repro(repo: Path, argv: list[str], what: str, numbers: dict, key: str) -> None:
    since = time.time()
    took, out, _ = run(argv, repo)
    numbers["stages"][key] = stage_times(repo, since)
    numbers[f"{key}_minutes"] = round(took / 60, 2)
    numbers[f"{key}_parallel"] = "local Ray cluster" in out
    print(f"{what:58} {took / 60:8.1f} min   goal <= {GOAL_MINUTES:g} min  "
          f"{'ok' if took / 60 <= GOAL_MINUTES else 'OVER'}")


def rows(repo: Path) -> dict:
    """Per (variant, type) of the seed incident: the verdict and the numbers behind it."""
    report = read_json(repo / "results/compare.json")
    out = {}
    for variant, domain in INCIDENT_ROWS:
        row = ((report.get("variants") or {}).get(variant) or {}).get("domains", {}).get(domain)
        if not row:
            continue
        p, f = row.get("paired") or {}, row.get("fidelity") or {}
        out[f"{variant}/{domain}"] = {
            "verdict": row.get("verdict"), "items": p.get("items"), "difference": p.get("difference"),
            "ci_low": p.get("ci_low"), "ci_high": p.get("ci_high"), "flips_lost": p.get("correct_to_wrong"),
            "flips_gained": p.get("wrong_to_correct"), "flip_rate": p.get("flip_rate"),
            "kl_p99": (f.get("kl") or {}).get("p99"), "kl_mean": (f.get("kl") or {}).get("mean"),
            "reasons": row.get("reasons")}
    return out


def seed_incident(repo: Path, numbers: dict) -> None:
    """The README's experiment in the profile's workspace: calibration without code comments, awq4 and gptq3 again."""
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    run([*git, "add", "-A"], repo)
    run([*git, "commit", "-qm", "the profile's run"], repo)
    numbers["seed_incident"] = {"full_calibration": rows(repo)}
    took, _, _ = run([str(BIN / "dvc"), "exp", "run", "-n", "no-comments", "-S", "calibration.exclude=[code_comment]"], repo)
    numbers["seed_incident"]["without_code_comments"] = rows(repo)
    numbers["seed_incident"]["minutes"] = round(took / 60, 2)
    calibration = read_json(repo / "results/calibration/coverage.json")
    numbers["seed_incident"]["calibration_shares"] = {d: x.get("calibration_share") for d, x in
                                                      (calibration.get("domains") or {}).items()}
    print(f"\nseed incident (dvc exp run, {took / 60:.1f} min): full calibration -> without code comments")
    def cell(x: dict) -> str:
        if x.get("difference") is None:  # no paired numbers (the row was not judged): its verdict alone
            return f"{x.get('verdict', '?'):>12}"
        return f"{x['verdict']:>12} {x['difference']:+.3f} [{x['ci_low']:+.3f}, {x['ci_high']:+.3f}]"

    for key, before in numbers["seed_incident"]["full_calibration"].items():
        after = numbers["seed_incident"]["without_code_comments"].get(key, {})
        print(f"  {key:20} {cell(before)} -> {cell(after)}  KL p99 {before.get('kl_p99')} -> {after.get('kl_p99')}")
    run([*git, "checkout", "--", "."], repo)
    run([str(BIN / "dvc"), "checkout", "--force"], repo)


# issue 44: the checkpoints vLLM teams receive, beside the project's own variants (compressed-tensors' presets)
CT_CANDIDATES = {"fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"), "w8a8": ("W8A8", "int-quantized")}


def add_ct_candidates(repo: Path, where: Path) -> dict:
    """FP8-dynamic and W8A8 checkpoints of the profile's model, written by compressed-tensors' own ModelCompressor
    (round-to-nearest scales: pipelines/checkpoints/compressed_tensors_probe.py write_rtn) from the workspace's reference
    in float32, the profile's precision, into `where`; added to the workspace's params.yaml as candidates and
    committed there. The reference stage runs first (the GGUF dequantized: what the candidates are made from)."""
    import yaml

    run([str(BIN / "dvc"), "repro", "reference"], repo)
    code = ("import sys, torch; from pipelines.checkpoints.compressed_tensors_probe import preset, write_rtn; "
            "write_rtn('models/reference', preset(sys.argv[1]), sys.argv[2], sys.argv[3], dtype=torch.float32)")
    candidates = {}
    for name, (scheme, fmt) in CT_CANDIDATES.items():
        run([str(BIN / "python"), "-c", code, scheme, fmt, str(where / name)], repo)
        candidates[name] = {"path": str(where / name)}
    text = (repo / "params.yaml").read_text(encoding="utf-8")
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    data = yaml.safe_load(text)
    data["candidates"] = candidates
    (repo / "params.yaml").write_text(header + "# benchmarks/real_profile.py --ct-candidates added `candidates`\n"
                                      + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    run([*git, "commit", "-qam", "compressed-tensors candidates (benchmarks/real_profile.py --ct-candidates)"], repo)
    return {name: {"scheme": scheme, "format": fmt} for name, (scheme, fmt) in CT_CANDIDATES.items()}


def ct_rows(repo: Path) -> dict:
    """Per model of the run: its verdicts, footprint against theory and what serving holds, and the routing rows
    it serves (what docs/real-model.md's compressed-tensors section shows)."""
    report, memory = read_json(repo / "results/compare.json"), read_json(repo / "results/memory_summary.json")
    table = read_json(repo / "results/routing_table.json")
    out = {}
    for name, entry in (report.get("variants") or {}).items():
        mem = (memory.get("variants") or {}).get(name) or {}
        out[name] = {"kind": entry.get("kind"), "verdicts": {d: r.get("verdict") for d, r in
                                                              (entry.get("domains") or {}).items()},
                     "footprint_bytes": mem.get("footprint_bytes"), "theory_bytes": mem.get("theoretical_weight_bytes"),
                     "serving_tensor_bytes": mem.get("serving_tensor_bytes"),
                     "kl_mean": {d: ((r.get("fidelity") or {}).get("kl") or {}).get("mean")
                                 for d, r in (entry.get("domains") or {}).items()},
                     "routed": sorted({f"{r['domain']}@{r['max_context_tokens']}" for r in table.get("rows", [])
                                       if r.get("serve") == name})}
    return out


def ct_table(models: dict) -> tuple[list[str], list[list[str]]]:
    """The rows docs/real-model.md renders (numbers:measured-table real_profile_ct)."""
    domains = sorted({d for m in models.values() for d in m["verdicts"]})
    header = ["model", *[f"{d}: verdict (KL mean)" for d in domains], "footprint (tensor bytes)", "theory",
              "held after the first forward", "routed (type@tokens)"]

    def num(x):
        return "" if x is None else f"{x:,}"

    rows = [[f"{name} ({m['kind']})",
             *[f"{m['verdicts'].get(d, '')}" + (f" ({m['kl_mean'][d]:.3f})" if m["kl_mean"].get(d) is not None else "")
               for d in domains],
             num(m["footprint_bytes"]), num(m["theory_bytes"]), num(m["serving_tensor_bytes"]) or "same",
             ", ".join(m["routed"]) or "none"] for name, m in models.items()]
    return header, rows


def decided(repo: Path) -> dict:
    """Per variant: the request types decided (pass or fail), inconclusive and without signal, against issue 37's goal
    (at least 3 of the 4 decided, none without signal)."""
    report = read_json(repo / "results/compare.json")
    out = {}
    for variant, entry in (report.get("variants") or {}).items():
        rows = entry.get("domains") or {}
        verdicts = {d: r.get("verdict") for d, r in rows.items()}
        no_signal = [d for d, r in rows.items() if any("no signal" in str(x) for x in r.get("reasons") or [])]
        n = sum(v in ("pass", "fail") for v in verdicts.values())
        out[variant] = {"decided": n, "of": len(rows), "no_signal": no_signal, "verdicts": verdicts,
                        "goal_met": n >= 3 and not no_signal}
        print(f"{variant:8} decided {n} of {len(rows)} request types, no signal: {no_signal or 'none'}  "
              f"{'ok' if out[variant]['goal_met'] else 'BELOW GOAL'}  {verdicts}")
    return out


def copy_quoted(repo: Path, dest: Path) -> None:
    """The results docs/real-model.md quotes, with the params.yaml and dvc.lock they were made with; whole or not at
    all (copied beside, then swapped in)."""
    from pipelines.core.io import atomic_dir

    with atomic_dir(dest) as tmp:
        for rel in QUOTED + ["params.yaml", "dvc.lock"]:
            src = repo / rel
            if src.is_dir():
                shutil.copytree(src, tmp / rel)
            elif src.is_file():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tmp / rel)


def compare_runs(this: Path, other: Path, numbers: dict) -> None:
    """The verdict and routing rows that differ from the other mode's run kept beside this one, when there is one
    that ran to its end; named by the commit it ran, so the docs show it only beside that run's record."""
    if not (other / PROFILE_MARKER).is_file():
        return
    try:
        rows = differences(this, other)
    except (OSError, ValueError) as err:  # the other run stopped part way: say so, keep this run's numbers
        numbers["differs_from_other_mode"] = {"other": other.parent.name, "error": str(err)[:300]}
        return
    numbers["differs_from_other_mode"] = {"other": other.parent.name, "other_commit": synced_from(other), "rows": rows}
    print(f"{'rows that differ from the ' + other.parent.name + ' run':58} {rows or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="smollm2")
    parser.add_argument("--keep", type=Path, help="make the workspaces in this folder and keep them")
    parser.add_argument("--sequential", action="store_true", help="also time `quantgate repro --sequential`")
    parser.add_argument("--no-fanned-out", dest="fanned_out", action="store_false",
                        help="skip the fanned-out run (its record stays): with --sequential, time only that")
    parser.add_argument("--seed-incident", action="store_true", help="then calibration.exclude=[code_comment]")
    parser.add_argument("--ct-candidates", action="store_true",
                        help="instead: a run with FP8-dynamic and W8A8 compressed-tensors candidates beside the variants "
                             "(recorded in real_profile_ct.json, its results in docs/measured/<profile>-ct/)")
    measured.add_arguments(parser, "real_profile")
    args = parser.parse_args()
    if not args.fanned_out and (args.seed_incident or not args.sequential):
        parser.error("--no-fanned-out times the sequential run alone: give --sequential, and not --seed-incident "
                     "(the seed incident runs in the fanned-out run's workspace)")
    work = args.keep or Path(tempfile.mkdtemp(prefix="quantgate-real-"))
    work.mkdir(parents=True, exist_ok=True)
    note = f"Profile {args.profile} (profiles/{args.profile}.yaml) in fresh workspaces."
    try:
        if args.ct_candidates:  # its own record and results: the timing run's stay as they are
            numbers = {"profile": args.profile, "stages": {}}
            repo = workspace(args.profile, work / "ct")
            numbers["candidates"] = add_ct_candidates(repo, work / "ct-candidates")
            timed_repro(repo, [str(BIN / "quantgate"), "repro"], "quantgate repro with compressed-tensors candidates",
                        numbers, "fresh")
            numbers["gate_exit"] = run([str(BIN / "quantgate"), "gate"], repo, check=False)[2]
            numbers["decided"], numbers["models"] = decided(repo), ct_rows(repo)
            numbers["header"], numbers["rows"] = ct_table(numbers["models"])
            if args.record:
                copy_quoted(repo, args.record.parent / f"{args.profile}-ct")
            measured.record(args.record and args.record.with_name("real_profile_ct.json"), "real_profile", numbers,
                            note=note, commit=synced_from(repo))
            return
        if args.fanned_out:
            numbers: dict = {"profile": args.profile, "goal_minutes": GOAL_MINUTES, "stages": {}}
            repo = workspace(args.profile, work / "fanned-out")
            timed_repro(repo, [str(BIN / "quantgate"), "repro"], "fresh quantgate repro of the profile", numbers, "fresh")
            numbers["gate_exit"] = run([str(BIN / "quantgate"), "gate"], repo, check=False)[2]
            numbers["decided"] = decided(repo)
            print_stages("fanned out: where the time goes", numbers["stages"]["fresh"])
            if args.record:
                copy_quoted(repo, args.record.parent / args.profile)
            # each part kept as soon as it is measured, named by the code its workspace ran
            measured.record(args.record, "real_profile", numbers, note=note, commit=synced_from(repo))
            compare_runs(repo, work / "sequential" / args.profile, numbers)
            measured.record(args.record, "real_profile", numbers, note=note, commit=synced_from(repo))
            if args.seed_incident:  # its own record: a timing run without it leaves the last one in place
                incident: dict = {"profile": args.profile}
                seed_incident(repo, incident)
                measured.record(args.record and args.record.with_name("real_profile_seed_incident.json"),
                                "real_profile", incident, note=note, commit=synced_from(repo))
        if args.sequential:  # its own record too, so either run can be repeated alone
            numbers = {"profile": args.profile, "stages": {}}
            seq = workspace(args.profile, work / "sequential")
            timed_repro(seq, [str(BIN / "quantgate"), "repro", "--sequential"], "fresh quantgate repro --sequential",
                        numbers, "sequential")
            print_stages("sequential: where the time goes", numbers["stages"]["sequential"])
            path = args.record and args.record.with_name("real_profile_sequential.json")
            measured.record(path, "real_profile", numbers, note=note, commit=synced_from(seq))
            compare_runs(seq, work / "fanned-out" / args.profile, numbers)
            measured.record(path, "real_profile", numbers, note=note, commit=synced_from(seq))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
