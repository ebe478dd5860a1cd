"""Helpers for the checkpoint admission tests (tests/test_checkpoints_*.py): copy a real checkpoint and break
one thing in it, the way a real writer would; the checkpoints themselves are session fixtures in conftest.py."""

from __future__ import annotations

import json
import shutil

from pipelines.checkpoints import admission
from pipelines.checkpoints.shards import INDEX

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def broken_copy(src, dest):
    shutil.copytree(src, dest)
    return dest


def edit_config(folder, change, name="config.json"):
    config = json.loads((folder / name).read_text())
    change(config)
    (folder / name).write_text(json.dumps(config))


def edit_tensors(path, change):
    """Rewrite one safetensors file with `change(tensors)` applied, as a real writer would."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def reshard(src, dest):
    """The checkpoint split into 2 shards plus the index, the way save_pretrained(max_shard_size=...) lays it out."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    (dest / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2:]}
    for shard, members in parts.items():
        save_file({n: tensors[n] for n in members}, dest / shard, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: shard for shard, members in parts.items() for n in members}}
    (dest / INDEX).write_text(json.dumps(index, indent=2))
    return dest


def edit_index(folder, change):
    index = json.loads((folder / INDEX).read_text())
    change(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def reasons_of(folder, tiny_model):
    report = admission.validate(folder, str(tiny_model))
    assert not report["admitted"]
    return report["reasons"]


def hub_cache(src, cache, repo_id="vendor/tiny-gptq", revision="a" * 40):
    """`src` laid out as huggingface_hub lays out a download in its cache, with the hub's own link maker:
    blobs named by their sha256 (an LFS file's etag), snapshots/<revision>/<file> a relative link to its blob,
    refs/main naming the revision. Returns what snapshot_download() itself returns for it, offline."""
    import hashlib
    import os

    from huggingface_hub import snapshot_download
    from huggingface_hub.file_download import _create_symlink, repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        link = repo / "snapshots" / revision / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(link), new_blob=False)
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))  # the layout under test: relative links
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
