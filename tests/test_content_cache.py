"""The slow fixtures' cache (tests/content_cache.py): reused only for the same content, rebuilt after any change to
the code it runs, its inputs, its settings or its own files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import content_cache
from tests.content_cache import cached


@pytest.fixture
def between_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_TEST_CACHE", str(tmp_path / "kept"))
    return tmp_path


def _builder(log: list):
    def build(folder: Path):
        log.append(folder)
        (folder / "weights.bin").write_bytes(b"\x01" * 64)
        return {"path": folder / "weights.bin", "pair": (1, 2), "outside": Path("/etc")}
    return build


def test_the_same_content_is_built_once_and_its_value_comes_back(between_runs, tmp_path_factory):
    built: list[Path] = []
    first = cached(tmp_path_factory, "thing", _builder(built), code=["compare"], settings={"n": 1})
    again = cached(tmp_path_factory, "thing", _builder(built), code=["compare"], settings={"n": 1})
    assert len(built) == 1 and first == again
    assert again["path"] == built[0] / "weights.bin" and again["path"].read_bytes() == b"\x01" * 64
    assert again["pair"] == [1, 2] and again["outside"] == Path("/etc")
    assert built[0].parent == between_runs / "kept"


def test_other_settings_inputs_or_code_build_anew(between_runs, tmp_path_factory):
    built: list[Path] = []
    data = between_runs / "input.txt"
    data.write_text("a")
    cached(tmp_path_factory, "thing", _builder(built), code=["compare"], inputs=[data], settings={"n": 1})
    cached(tmp_path_factory, "thing", _builder(built), code=["compare"], inputs=[data], settings={"n": 2})
    data.write_text("b")
    cached(tmp_path_factory, "thing", _builder(built), code=["compare"], inputs=[data], settings={"n": 2})
    cached(tmp_path_factory, "thing", _builder(built), code=["route"], inputs=[data], settings={"n": 2})
    assert len(set(built)) == 4


def test_the_key_follows_the_code_the_named_module_imports_and_no_other(tmp_path, monkeypatch):
    """As dvc.yaml's code deps do (lineage.stage_code): compare imports judging/stats.py through judging/comparison.py,
    and no stage imports another."""
    import shutil

    shutil.copytree(content_cache.ROOT / "pipelines", tmp_path / "pipelines")
    monkeypatch.setattr(content_cache, "ROOT", tmp_path)
    key = content_cache.content_key("thing", ["compare"], [], [], None)
    with open(tmp_path / "pipelines/route.py", "a") as f:
        f.write("# another stage's code\n")
    assert content_cache.content_key("thing", ["compare"], [], [], None) == key
    with open(tmp_path / "pipelines/judging/stats.py", "a") as f:
        f.write("# code compare runs\n")
    assert content_cache.content_key("thing", ["compare"], [], [], None) != key


def test_a_helper_that_is_not_a_file_stops_the_fixture_instead_of_keying_nothing(between_runs, tmp_path_factory):
    built: list[Path] = []
    with pytest.raises(FileNotFoundError, match="'thing': helper tests/renamed_helper.py is not a file"):
        cached(tmp_path_factory, "thing", _builder(built), helpers=["tests/renamed_helper.py"])
    assert built == []


def test_an_entry_written_into_or_left_half_built_is_rebuilt(between_runs, tmp_path_factory):
    built: list[Path] = []
    value = cached(tmp_path_factory, "thing", _builder(built))
    value["path"].write_bytes(b"\x02" * 64)  # a test that wrote into a shared entry
    with pytest.warns(UserWarning, match="thing-.* is built again: weights.bin changed since it was built"):
        value = cached(tmp_path_factory, "thing", _builder(built))
    assert len(built) == 2 and value["path"].read_bytes() == b"\x01" * 64 and value["path"].parent == built[1]
    assert (built[0] / "weights.bin").is_file()  # not removed under whoever still reads it: built anew elsewhere
    os.remove(next((between_runs / "kept").glob("thing-*.json")))  # a build killed before its pointer was written
    cached(tmp_path_factory, "thing", _builder(built))
    assert len(built) == 3


def test_off_keeps_entries_for_this_run_only(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QUANTGATE_TEST_CACHE", "0")
    assert content_cache.kept_between_runs() is None
    built: list[Path] = []
    value = cached(tmp_path_factory, "run_only", _builder(built))
    base = tmp_path_factory.getbasetemp()
    assert value["path"].is_relative_to(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


def test_what_a_failed_test_read_is_built_anew_next_run(tmp_path):
    """A measurement that came out wrong once (a flake) is not kept to fail every later run: the run's end takes the
    entries its failed tests read out of the cache, through any fixture, but not a source other entries are made
    from (the tiny model's chain); a passing test's stay."""
    import subprocess
    import sys

    (tmp_path / "test_reads.py").write_text(
        "import pytest\nfrom tests.content_cache import cached\n\n"
        "@pytest.fixture(scope='session')\ndef kept(tmp_path_factory):\n"
        "    return cached(tmp_path_factory, 'kept', lambda folder: 1, source=True)\n\n"
        "@pytest.fixture(scope='session')\ndef flaky(tmp_path_factory, kept):\n"
        "    return cached(tmp_path_factory, 'flaky', lambda folder: 2)\n\n"
        "@pytest.fixture\ndef passed_on(flaky):\n    return flaky\n\n"
        "def test_passes(kept):\n    assert kept == 1\n\n"
        "def test_fails(passed_on):\n    assert passed_on == 3\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},  # its own main process
           "QUANTGATE_TEST_CACHE": str(tmp_path / "kept-between-runs")}

    def run_tests(*select: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:xdist", "-p",
                               "no:cacheprovider", "-q", *select, str(tmp_path / "test_reads.py")],
                              cwd=content_cache.ROOT, env=env, capture_output=True, text=True)

    done = run_tests()
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr

    def entries():
        return sorted(p.name.split("-")[0] for p in (tmp_path / "kept-between-runs").glob("*.json"))

    assert entries() == ["kept"]  # test_fails read flaky through passed_on; kept, a source, stays
    done = run_tests("-k", "passes")
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert entries() == ["kept"]
    done = run_tests("-k", "fails")
    assert "1 failed" in done.stdout and entries() == ["kept"], done.stdout + done.stderr


def test_only_what_nobody_used_for_a_week_is_cleared(between_runs, tmp_path_factory):
    """Every reuse touches the pointer and its build, so a build a run is reading is never old enough to clear."""
    built: list[Path] = []
    root = between_runs / "kept"
    cached(tmp_path_factory, "thing", _builder(built), settings=1)
    cached(tmp_path_factory, "thing", _builder(built), settings=2)
    week = content_cache.STALE_AFTER_S + 60
    old_pointer = next(p for p in root.glob("thing-*.json") if built[0].name.startswith(p.stem))
    for path in (old_pointer, built[0]):
        os.utime(path, (path.stat().st_atime - week, path.stat().st_mtime - week))
    cached(tmp_path_factory, "thing", _builder(built), settings=2)  # reused: touches the second build
    assert built[0].exists()  # cleared only when the name builds again
    cached(tmp_path_factory, "thing", _builder(built), settings=3)
    assert not built[0].exists() and not old_pointer.exists() and built[1].exists() and len(built) == 3
