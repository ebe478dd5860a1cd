"""Admission of a third-party quantized checkpoint: validate it before anything loads it, copying it in the
same single read.

Loading a checkpoint can run code (pickle, remote code) and a malformed one can crash or silently mis-load,
so nothing here loads the model through a framework. Phase 1 reads no weight bytes: the file policy, the
JSON files, the quantization configs, the config and generation config against the base model's, the
tokenizer, every safetensors header, the index and the tensor names, dtypes and shapes. Phase 2 reads every
byte once (copying.py). Nothing a candidate contains can stop the stage: an unexpected error in a check is
that candidate's refusal, naming what was being checked. An admitted candidate lands in
models/variants/<name>/ and is judged like a variant the pipeline made; a rejected one gets a manifest with
every reason, each naming its file and tensor.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipelines.checkpoints import copying, drift, files, quant_config, shards, tensors, tokenizer
from pipelines.checkpoints.context import Candidate, Check, could_not_check
from pipelines.checkpoints.manifest import candidate_manifest
from pipelines.core.io import atomic_dir, write_json
from pipelines.core.paths import MANIFEST, VARIANTS_DIR

Group = list[tuple[str, Check]]  # (what is checked, for the reason if a check fails unexpectedly; check)

# Cheapest and most dangerous first. A group with any reason ends the run: code, pickle or no config stops
# everything after the first group, and only a folder that passed every file check reaches a loader.
PHASE_1: list[Group] = [
    [("{folder}", files.file_policy),
     ("the JSON, tokenizer and text files", files.small_files),
     ("the JSON, tokenizer and text files", files.config_present)],
    [("the quantization config", quant_config.quantization),
     ("config.json", drift.config_against_base),
     ("the tokenizer files", tokenizer.tokenizer_length),
     ("generation_config.json against the base model", drift.generation_against_base),
     ("the tokenizer against the base model", tokenizer.tokenizer_against_base),
     ("the safetensors headers", shards.shard_headers)],
    [(shards.INDEX, shards.index_matches_shards),
     (shards.INDEX, shards.one_copy_per_tensor)],
    [("the tensors against the base model", tensors.tensors_match_base)],
]
PHASE_2: list[Group] = [[("the bytes", copying.copy_and_hash)]]


def run(c: Candidate, groups: list[Group]) -> None:
    """Each check in order, its reasons appended to c.reasons; stop after the first group that has any."""
    for group in groups:
        for what, check in group:
            c.step = what.format(folder=c.folder)
            c.reasons += check(c)
        if c.reasons:
            return


def inspect(c: Candidate) -> None:
    """Phase 1 alone: every check that reads no tensor bytes."""
    run(c, PHASE_1)


def run_checks(folder: str | Path, base_dir: str, copy_to: Path | None) -> dict:
    """Every check; when `copy_to` is given, the accepted files are copied there in the same single read.

    It never raises for anything a candidate contains: an unexpected error is that candidate's refusal.
    """
    c = Candidate(Path(folder), base_dir, copy_to)
    try:
        if not c.folder.is_dir():
            return {"admitted": False, "reasons": [not_a_folder(c.folder)], "files": {}, "bytes_read": 0}
        run(c, PHASE_1 + PHASE_2)
        reasons = c.reasons
    except OSError as err:  # unreadable or vanished: this candidate's failure
        reasons = [f"{err.filename or c.step}: {err.strerror or err}"]
    except Exception as err:  # noqa: BLE001 - a malformed candidate is refused, it never stops the stage
        reasons = [could_not_check(c.step, err)]
    sizes = {**c.sizes, **{rel: shard.size for rel, shard in c.shards.items()}}
    return {"admitted": not reasons, "reasons": reasons, "files": c.hashes, **c.quant, **c.details,
            "bytes_read": sum(sizes.get(rel, 0) for rel in c.hashes)}


def not_a_folder(path: Path) -> str:
    """Why a candidate that is no folder is refused; a GGUF file is named as one (pipelines/models/gguf.py)."""
    from pipelines.models.gguf import MAGIC

    if path.is_file():
        with path.open("rb") as fh:
            if fh.read(len(MAGIC)) == MAGIC:
                return (f"{path}: a GGUF file (llama.cpp's format), not a checkpoint folder: a GGUF is taken as the model "
                        "under test (model: FILE.gguf in params.yaml; the reference stage dequantizes it), not as a "
                        "candidate: llama.cpp's kernels quantize activations too, so its dequantized weights are not the "
                        "model llama.cpp serves")
    return f"{path}: not a directory"


def validate(folder: str | Path, base_dir: str) -> dict:
    """Every check, cheapest and most dangerous first; reasons name the file, key and tensor."""
    return run_checks(folder, base_dir, copy_to=None)


def admit(name: str, path: str, base_dir: str, out_root: Path = VARIANTS_DIR) -> dict:
    """Validate while copying the bytes into out_root/name, with a manifest; or record the rejection."""
    with atomic_dir(out_root / name) as tmp:
        report = run_checks(path, base_dir, copy_to=tmp)
        if not report["admitted"]:
            for child in sorted(tmp.iterdir()):  # nothing of a rejected checkpoint stays
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        manifest = candidate_manifest(name, path, base_dir, report, tmp)
        write_json(tmp / MANIFEST, manifest)
    return manifest
