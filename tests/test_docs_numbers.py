"""The numbers README.md and docs/*.md quote are written by scripts/docs_numbers.py from the files they come from.

`--check` passes on the repository as committed, and fails, naming the file and line, when a results file, a
params.yaml value or a benchmark's measured numbers change without the docs being regenerated; the docs name only
paths the project ships or a dvc.yaml stage writes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = Path("scripts") / "docs_numbers.py"


def run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=repo, capture_output=True, text=True, timeout=300)


def problems(repo: Path) -> set[str]:
    """The `file:line: ...` lines --check prints (notes and the summary line left out)."""
    out = run(repo, "--check").stdout
    return {line for line in out.splitlines() if re.match(r"^[\w./-]+\.md:\d+: ", line)}


def marker_line(doc: Path, marker: str) -> int:
    """The 1-based line of a block's start marker."""
    return next(n for n, line in enumerate(doc.read_text(encoding="utf-8").split("\n"), 1) if line.strip() == marker)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the working tree as a commit of it would ship (tracked and untracked-but-not-ignored files), in a
    fresh git repository without history: blocks quoting older commits are then listed as not checked."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    return tmp_path


def test_the_docs_match_their_sources():
    done = run(ROOT, "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_changed_result_is_named_with_file_and_line_and_regenerated(tree):
    before = problems(tree)  # what the working tree has now (other work in progress): compared against, not assumed empty
    report = json.loads((tree / "results/compare.json").read_text())
    # the passing row closest to the margin: the verdicts table and the summary's "closest to the margin" show it
    passing = [d for v in report["variants"].values() for d in v["domains"].values() if d["verdict"] == "pass"]
    row = min(passing, key=lambda d: d["paired"]["ci_low"])["paired"]
    row["ci_low"] = round(row["ci_low"] - 0.0011, 4)  # a results number changes, the docs are not regenerated
    (tree / "results/compare.json").write_text(json.dumps(report, indent=2))
    done = run(tree, "--check")
    assert done.returncode == 1, done.stdout
    new = "\n".join(problems(tree) - before)
    line = marker_line(tree / "docs/compare.md", "<!-- numbers:verdicts -->")
    assert re.search(rf"^docs/compare\.md:{line}: block 'verdicts' is stale: line \d+ differs", new, re.M), new
    assert f"docs/compare.md:{marker_line(tree / 'docs/compare.md', '<!-- numbers:verdict-summary -->')}:" in new
    assert "README.md:" not in new  # the README's summary does not show that interval
    evaluate_md = (tree / "docs/evaluate.md").read_text()
    rewritten = run(tree)
    assert rewritten.returncode == 0, rewritten.stdout + rewritten.stderr
    def signed(x):
        return f"{x:+.3f}".replace("-", "−")
    assert f"{signed(row['difference'])} [{signed(row['ci_low'])}, {signed(row['ci_high'])}]" in \
        (tree / "docs/compare.md").read_text()
    assert (tree / "docs/evaluate.md").read_text() == evaluate_md  # blocks that do not quote it are left alone
    assert problems(tree) == before
    again = run(tree)
    assert "rewrote nothing" in again.stdout  # a second run changes nothing, dates included


def test_a_block_on_another_runs_copy_reads_that_copy_only(tree):
    """`<!-- numbers:KIND @FOLDER -->` renders from FOLDER/results/ and FOLDER/params.yaml (a profile's run, copied by
    benchmarks/real_profile.py), never from this checkout's own results: a change to either is named only where it is
    quoted."""
    copy = tree / "docs/measured/other"
    (copy / "results").mkdir(parents=True)
    report = json.loads((tree / "results/compare.json").read_text())
    report["fp16"]["accuracy"] = {d: 0.123 for d in report["fp16"]["accuracy"]}
    (copy / "results/compare.json").write_text(json.dumps(report))
    (tree / "docs/other.md").write_text("# other\n\n<!-- numbers:verdicts @docs/measured/other -->\n<!-- /numbers -->\n")
    assert run(tree).returncode == 0
    text = (tree / "docs/other.md").read_text()
    assert "math 0.123" in text and "docs/measured/other/results/compare.json" in text
    assert "a profile's `quantgate repro`, copied by `benchmarks/real_profile.py`" in text
    before = problems(tree)
    ours = json.loads((tree / "results/compare.json").read_text())
    ours["fp16"]["accuracy"] = {d: 0.456 for d in ours["fp16"]["accuracy"]}
    (tree / "results/compare.json").write_text(json.dumps(ours))
    assert not any(line.startswith("docs/other.md") for line in problems(tree) - before)
    report["fp16"]["accuracy"] = {d: 0.789 for d in report["fp16"]["accuracy"]}
    (copy / "results/compare.json").write_text(json.dumps(report))
    assert any(line.startswith("docs/other.md:3: block 'verdicts @docs/measured/other' is stale") for line in problems(tree))


def test_a_changed_param_and_a_new_benchmark_run_are_named(tree):
    before = problems(tree)
    params = (tree / "params.yaml").read_text()
    (tree / "params.yaml").write_text(params.replace("held_out_additions: 1000", "held_out_additions: 750"))
    speed = json.loads((tree / "docs/measured/pipeline_speed.json").read_text())
    speed["results"]["noop_dvc_seconds"] = 2.4
    speed["date"] = "2027-01-05"
    (tree / "docs/measured/pipeline_speed.json").write_text(json.dumps(speed))
    assert run(tree, "--check").returncode == 1
    new = "\n".join(problems(tree) - before)
    assert f"docs/params.md:{marker_line(tree / 'docs/params.md', '<!-- numbers:params reference -->')}: block " \
           "'params reference' is stale" in new, new
    assert f"README.md:{marker_line(tree / 'README.md', '<!-- numbers:pipeline-speed -->')}: block 'pipeline-speed'" \
           in new
    run(tree)
    assert problems(tree) == before
    assert "| held_out_additions | 750 |" in (tree / "docs/params.md").read_text()
    readme = (tree / "README.md").read_text()
    assert " / 2.4 s | ≤ 2 s |" in readme and "As measured on 2027-01-05 by" in readme


def test_a_block_whose_numbers_did_not_change_keeps_its_date(tree):
    """Rewriting a results file with the same numbers (a re-run) leaves the docs as they are."""
    summary = tree / "results/memory_summary.json"
    before = problems(tree)
    summary.write_text(json.dumps(json.loads(summary.read_text()), indent=1))  # other bytes, same numbers
    assert problems(tree) == before
    assert "rewrote nothing" in run(tree).stdout


def test_docs_name_only_paths_the_project_ships(tree):
    before = problems(tree)
    doc = tree / "docs" / "calibration.md"
    doc.write_text(doc.read_text() + "\nSee `results/no_such_file.json`, docs/no-such-page.md and "
                                      "`results/eval/<variant>/items.jsonl` (a dvc.yaml stage writes it).\n")
    line = len(doc.read_text().split("\n")) - 1
    assert run(tree, "--check").returncode == 1
    new = "\n".join(problems(tree) - before)
    assert f"docs/calibration.md:{line}: names `results/no_such_file.json`" in new
    assert f"docs/calibration.md:{line}: names `docs/no-such-page.md`" in new
    assert "items.jsonl" not in new


def test_a_block_without_its_source_is_not_checked_but_listed(tree):
    """The history blocks quote older commits; a clone without them (shallow) cannot check them."""
    done = run(tree, "--check")
    assert re.search(r"^note: docs/compare\.md:\d+: block 'history-row a35ebf2 gptq3 code' not checked: "
                     r"results/compare\.json at commit a35ebf2 is not in this clone", done.stdout, re.M), done.stdout


def test_unknown_and_unclosed_blocks_fail(tree):
    doc = tree / "docs" / "fanout.md"
    doc.write_text(doc.read_text() + "\n<!-- numbers:no-such-kind -->\n<!-- /numbers -->\n\n<!-- numbers:memory -->\n")
    done = run(tree, "--check")
    assert done.returncode == 1
    assert "block 'no-such-kind' cannot be rendered: ValueError: unknown block kind" in done.stdout
    assert "block 'memory' has no end marker" in done.stdout


def test_a_benchmark_records_date_machine_and_command(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT))
    from benchmarks import measured

    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "gate_operating.py"), "--runs", "10"])
    out = tmp_path / "measured" / "gate_operating.json"
    measured.record(out, "gate_operating", {"rows": []})
    data = json.loads(out.read_text())
    assert data["benchmark"] == "benchmarks/gate_operating.py"
    assert data["command"] == ".venv/bin/python benchmarks/gate_operating.py --runs 10"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]) and data["machine"]["cpus"] >= 1
    assert data["results"] == {"rows": []} and not list(out.parent.glob(".*.tmp"))
    measured.record(None, "gate_operating", {})  # --no-record writes nothing
    assert [p.name for p in out.parent.iterdir()] == ["gate_operating.json"]
