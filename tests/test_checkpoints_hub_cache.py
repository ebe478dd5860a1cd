"""A huggingface_hub cache snapshot (relative links into the repo's blobs/) is admitted as it is: the blobs are
what is hashed and copied. Every other link is refused, naming the file, also when it changes between phases."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

from pipelines.checkpoints import admission, copying
from pipelines.checkpoints.shards import INDEX
from tests.checkpoint_helpers import SHARDS, broken_copy, edit_config, hub_cache, reasons_of

TEMPLATE = "additional_chat_templates/tool_use.jinja"  # a link one folder deeper: ../../../../blobs/<hash>


def test_a_hub_cache_snapshot_of_a_sharded_checkpoint_is_admitted(tmp_path, sharded_checkpoint, tiny_model):
    src = broken_copy(sharded_checkpoint, tmp_path / "src")
    (src / "additional_chat_templates").mkdir()
    (src / TEMPLATE).write_text("{{ tools }}")
    base = shutil.copytree(tiny_model, tmp_path / "base")  # the base model has the same named template
    shutil.copytree(src / "additional_chat_templates", base / "additional_chat_templates")
    snapshot = Path(hub_cache(src, tmp_path / "hub"))

    manifest = admission.admit("hub-gptq", str(snapshot), str(base), tmp_path / "variants")
    assert manifest["status"] == "ok", manifest.get("reasons")
    # huggingface_hub's own view of its cache: every file of the revision, each with the blob it points to
    (repo,) = scan_cache_dir(tmp_path / "hub").repos
    (revision,) = repo.revisions
    blobs = {f.file_path.relative_to(snapshot).as_posix(): f.blob_path for f in revision.files}
    assert set(blobs) == set(manifest["files"]) >= {*SHARDS, INDEX, TEMPLATE, "config.json"}
    copy = tmp_path / "variants" / "hub-gptq"
    for rel, blob in blobs.items():
        digest = hashlib.sha256(blob.read_bytes()).hexdigest()
        assert manifest["files"][rel] == digest == blob.name  # the blob's bytes, hashed (blobs named by sha256)
        assert not (copy / rel).is_symlink() and (copy / rel).read_bytes() == blob.read_bytes()  # copied, not linked
    assert manifest["validation"]["bytes_read"] == sum(blob.stat().st_size for blob in blobs.values())


def _snapshot(tmp_path, checkpoint):
    snapshot = Path(hub_cache(checkpoint, tmp_path / "hub"))
    return snapshot, snapshot.parent.parent / "blobs"


def _repoint(link: Path, target) -> None:
    link.unlink()
    link.symlink_to(target)


def _outside(tmp_path, snapshot, blobs):
    (tmp_path / "elsewhere.json").write_bytes((snapshot / "tokenizer.json").read_bytes())  # the same bytes
    return "../../../../elsewhere.json"


def _other_repo(tmp_path, snapshot, blobs):
    other = tmp_path / "hub" / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    shutil.copy(snapshot / "tokenizer.json", other / "tok")
    return "../../../models--other--repo/blobs/tok"


def _directory(tmp_path, snapshot, blobs):
    (blobs / "a-folder").mkdir()
    return "../../blobs/a-folder"


def _chain(tmp_path, snapshot, blobs):
    """blobs/<x> is itself a link (to a file with the same bytes): one hop only."""
    (tmp_path / "elsewhere.json").write_bytes((snapshot / "tokenizer.json").read_bytes())
    (blobs / "x").symlink_to(tmp_path / "elsewhere.json")
    return "../../blobs/x"


def _fifo(tmp_path, snapshot, blobs):
    os.mkfifo(blobs / "fifo")
    return "../../blobs/fifo"


@pytest.mark.parametrize("make,why", [
    (_outside, "it points to ../../../../elsewhere.json, outside {blobs}"),
    (_other_repo, "it points to ../../../models--other--repo/blobs/tok, outside {blobs}"),
    (lambda *_: "/etc/passwd", "it points to /etc/passwd, outside {blobs}"),
    (_directory, "it points to ../../blobs/a-folder, which is not a regular file"),
    (_chain, "it points to ../../blobs/x, which is not a regular file"),
    (_fifo, "it points to ../../blobs/fifo, which is not a regular file"),
    (lambda *_: "../../blobs/" + "0" * 64, "it points to ../../blobs/" + "0" * 64 + ", which does not exist "
     "(an incomplete download?)"),
], ids=["out-of-repo", "other-repo", "absolute", "directory", "chain", "fifo", "dangling"])
def test_a_link_anywhere_but_its_own_blobs_is_refused(tmp_path, direct_checkpoints, tiny_model, make, why):
    snapshot, blobs = _snapshot(tmp_path, direct_checkpoints["gptq"])
    _repoint(snapshot / "tokenizer.json", make(tmp_path, snapshot, blobs))
    only = "; only a snapshot's links into its own repo's blobs/ are followed" if "outside" in why else ""
    assert reasons_of(snapshot, tiny_model) == [
        f"tokenizer.json: symbolic link refused ({why.format(blobs=blobs)}{only})"]


def test_a_symlinked_blobs_folder_is_not_the_hub_layout(tmp_path, direct_checkpoints, tiny_model):
    snapshot, blobs = _snapshot(tmp_path, direct_checkpoints["gptq"])
    blobs.rename(tmp_path / "real-blobs")
    blobs.symlink_to(tmp_path / "real-blobs")
    no_layout = ("symbolic link refused (not in a huggingface_hub cache snapshot; copy the real files, e.g. "
                 "`hf download --local-dir`)")
    assert reasons_of(snapshot, tiny_model) == [f"{p.name}: {no_layout}" for p in sorted(snapshot.iterdir())] + [
        "config.json: missing"]


def test_the_same_links_outside_a_models_folder_are_refused(tmp_path, direct_checkpoints, tiny_model):
    """The layout is recognised by its structure (models--*/snapshots/<rev> beside blobs/), not by links alone."""
    snapshot, _ = _snapshot(tmp_path, direct_checkpoints["gptq"])
    repo = snapshot.parent.parent
    moved = repo.rename(repo.parent / "datasets--vendor--tiny-gptq") / "snapshots" / snapshot.name
    assert reasons_of(moved, tiny_model) == [
        f"{p.name}: symbolic link refused (not in a huggingface_hub cache snapshot; copy the real files, e.g. "
        "`hf download --local-dir`)" for p in sorted(moved.iterdir())] + ["config.json: missing"]


def test_a_link_repointed_between_the_checks_and_the_copy_is_refused(tmp_path, direct_checkpoints, tiny_model,
                                                                       monkeypatch):
    """Same bytes, other place: the digest alone would not see it; the link is checked again when opened."""
    snapshot, blobs = _snapshot(tmp_path, direct_checkpoints["gptq"])
    stream_all = copying.stream_all

    def repoint(folder, *args):
        _repoint(folder / "tokenizer.json", _outside(tmp_path, folder, blobs))
        return stream_all(folder, *args)
    monkeypatch.setattr(copying, "stream_all", repoint)
    manifest = admission.admit("raced", str(snapshot), str(tiny_model), tmp_path / "variants")
    assert manifest["status"] == "failed"
    assert manifest["reasons"] == [
        f"tokenizer.json: symbolic link refused (it points to ../../../../elsewhere.json, outside {blobs}; only a "
        "snapshot's links into its own repo's blobs/ are followed; changed since it was checked) "
        f"({snapshot / 'tokenizer.json'})"]
    assert [p.name for p in (tmp_path / "variants" / "raced").iterdir()] == ["quantgate.json"]


def test_other_formats_in_a_snapshot_are_refused_through_their_links(tmp_path, direct_checkpoints, tiny_model):
    """A followed link is still judged by its name: a pickle blob is refused, and the hint keeps off the cache."""
    src = broken_copy(direct_checkpoints["gptq"], tmp_path / "src")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04junk")
    snapshot, _ = _snapshot(tmp_path, src)
    assert reasons_of(snapshot, tiny_model) == [
        "pytorch_model.bin: pickle-based file refused (loading it can run code); only safetensors weights",
        f"{snapshot}: the safetensors weights are here too, in a hub cache snapshot: download without the other "
        'formats into a folder of your own: hf download <repo> --exclude "*.bin" --local-dir DIR']


def test_the_tokenizer_is_judged_on_the_bytes_that_are_copied(tmp_path, direct_checkpoints, tiny_model, monkeypatch):
    """The race: the link shows a good tokenizer config while transformers loads it, the bad one before and after
    (when it is hashed, and copied). transformers reads a private copy of the hashed bytes, so it sees the bad."""
    src = broken_copy(direct_checkpoints["gptq"], tmp_path / "src")
    good = (src / "tokenizer_config.json").read_bytes()
    edit_config(src, lambda c: c.update(padding_side="left"), name="tokenizer_config.json")
    snapshot, blobs = _snapshot(tmp_path, src)
    assert [r for r in reasons_of(snapshot, tiny_model) if "padding_side is 'left'" in r]  # unraced: refused
    bad = os.readlink(snapshot / "tokenizer_config.json")
    (blobs / hashlib.sha256(good).hexdigest()).write_bytes(good)

    def swap(target):
        def step(c):
            _repoint(c.folder / "tokenizer_config.json", target)
            return []
        return step
    first, second, *rest = admission.PHASE_1
    raced = [first, [("swap in", swap("../../blobs/" + hashlib.sha256(good).hexdigest())), *second,
                     ("swap back", swap(bad))], *rest]
    monkeypatch.setattr(admission, "PHASE_1", raced)
    manifest = admission.admit("raced", str(snapshot), str(tiny_model), tmp_path / "variants")
    assert manifest.get("reasons") == [
        "tokenizer_config.json: changed while being read (its bytes differ from those checked)"]
