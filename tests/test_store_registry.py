"""pipelines/store/registry.py: versions, aliases, the stored checkpoint and its hashes, and `quantgate fetch` verifying it."""

from __future__ import annotations

import hashlib
import json

import pytest
from mlflow import MlflowClient

from pipelines import record
from pipelines.core.io import sha256_file
from tests.handmade import correctness
from tests.store_helpers import N, fetch, sqlite_store, stored_checkpoint, write_recordable


def test_passing_variants_are_registered_and_candidate_points_at_the_newest(recorded):
    root, built, uri, summary = recorded
    client = MlflowClient(uri)
    versions = client.search_model_versions("name = 'quantgate-reference'")
    assert [v.tags["variant"] for v in versions] == ["int8"]  # awq4 failed: not registered
    candidate = client.get_model_version_by_alias("quantgate-reference", "candidate")
    assert candidate.version == versions[0].version and candidate.run_id == summary["children"]["int8"]
    assert candidate.tags["verdict"] == "pass" and candidate.tags["quantgate.results_digest"] == built["digest"]


def test_a_version_names_a_stored_copy_of_the_gated_files(recorded):
    """The source is the child run's artifact, inside the store's artifact root, tagged with one sha256."""
    root, built, uri, summary = recorded
    version = MlflowClient(uri).get_model_version_by_alias("quantgate-reference", "candidate")
    run = summary["children"]["int8"]
    assert version.source == f"runs:/{run}/checkpoint"
    stored = stored_checkpoint(uri, run)
    assert stored.is_relative_to((root / "artifacts").resolve()) and not stored.is_relative_to(root / "models")
    folder = root / "models/variants/int8"
    names = ["config.json", "model.safetensors", "quantgate.json", "tokenizer.json"]
    assert sorted(p.name for p in stored.iterdir()) == names
    assert all((stored / n).read_bytes() == (folder / n).read_bytes() for n in names)
    listing = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in names)  # sha256sum's
    assert version.tags["checkpoint.sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    assert version.tags["checkpoint.files"] == "4"
    assert MlflowClient(uri).get_run(run).data.tags["checkpoint.sha256"] == version.tags["checkpoint.sha256"]
    awq4 = summary["children"]["awq4"]  # failed a domain: nothing uploaded for it
    assert MlflowClient(uri).list_artifacts(awq4, "checkpoint") == []


def test_fetch_gives_the_gated_bytes_even_after_the_workspace_is_overwritten(recorded, monkeypatch, capsys):
    root, built, uri, summary = recorded
    folder = root / "models/variants/int8"
    gated = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "model.safetensors").write_bytes(b"the next dvc repro's weights")  # what the next run would leave
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(root / "elsewhere/int8")) == 0
    got = root / "elsewhere/int8"
    assert {p.name: p.read_bytes() for p in got.iterdir()} == gated
    assert fetch(uri, monkeypatch, "1", "--dest", str(got)) == 0  # the same bytes there already: accepted
    (got / "config.json").write_bytes(b"{}")
    assert fetch(uri, monkeypatch, "v1", "--dest", str(got)) == 2  # other bytes there: never overwritten
    assert "config.json: sha256 " in capsys.readouterr().err and (got / "config.json").read_bytes() == b"{}"


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_damaged_store_fails_fetch_naming_the_file(recorded, monkeypatch, capsys, damage):
    root, built, uri, summary = recorded
    stored = stored_checkpoint(uri, summary["children"]["int8"]) / "model.safetensors"
    if damage == "delete":
        stored.unlink()
    else:
        data = bytearray(stored.read_bytes())
        data[1000] ^= 1
        stored.write_bytes(bytes(data))
    dest = root / "fetched"
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(dest)) == 2
    err = capsys.readouterr().err
    assert "quantgate-reference version 1: checkpoint runs:/" in err
    assert ("model.safetensors: missing" if damage == "delete" else "model.safetensors: sha256 ") in err
    assert not dest.exists() and list(root.glob(".fetched.*")) == []  # nothing half-fetched left behind


def test_rewritten_hashes_in_the_store_are_caught_by_the_registry_tag(recorded, monkeypatch, capsys):
    """Someone with write access to the artifact store replaces a file and its recorded hash: the version's
    tag (in the tracking database) no longer matches."""
    root, built, uri, summary = recorded
    run = summary["children"]["int8"]
    stored = stored_checkpoint(uri, run)
    (stored / "model.safetensors").write_bytes(b"other weights")
    hashes_path = stored.parent / "checkpoint.json"
    hashes = json.loads(hashes_path.read_text())
    hashes["files"]["model.safetensors"] = sha256_file(stored / "model.safetensors")
    hashes_path.write_text(json.dumps(hashes))
    assert fetch(uri, monkeypatch, "candidate", "--dest", str(root / "fetched")) == 2
    assert "checkpoint.json in run " in capsys.readouterr().err


def test_an_unknown_alias_is_named(recorded, monkeypatch, capsys):
    root, _, uri, _ = recorded
    assert fetch(uri, monkeypatch, "production", "--dest", str(root / "x")) == 2
    assert "quantgate-reference: no version or alias 'production'" in capsys.readouterr().err


def test_a_passing_variant_whose_files_are_not_its_manifests_is_not_registered(tmp_path):
    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                        "awq4": {d: correctness(N, 300) for d in ("math", "code")}})
    (tmp_path / "models/variants/awq4/model.safetensors").write_bytes(b"replaced after it was gated")
    uri = sqlite_store(tmp_path)
    summary = record.record_pipeline(built["params"], uri, built["digest"], {}, root=tmp_path,
                                     artifact_root=tmp_path / "artifacts")
    assert [r["variant"] for r in summary["registered"]] == ["int8"]
    assert summary["unregistered"][0]["variant"] == "awq4"
    assert "models/variants/awq4/model.safetensors: sha256 " in summary["unregistered"][0]["reason"]
    client = MlflowClient(uri)
    assert client.get_model_version_by_alias("quantgate-reference", "candidate").tags["variant"] == "int8"
    assert client.list_artifacts(summary["children"]["awq4"], "checkpoint") == []
