"""What a checkpoint folder's manifest (quantgate.json) records: library versions and bytes on disk, for a
variant the pipeline made and a candidate alike, and a candidate's admission or refusal with every reason."""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path

from pipelines.core.io import atomic_dir, write_json
from pipelines.core.paths import MANIFEST, VARIANTS_DIR

LIBRARIES = ("torch", "transformers", "autoawq", "gptqmodel", "bitsandbytes", "safetensors", "accelerate")


def library_versions() -> dict[str, str | None]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def disk_bytes(folder: Path) -> dict[str, int]:
    files = [p for p in folder.iterdir() if p.is_file()]
    return {"weights": sum(p.stat().st_size for p in files if p.suffix == ".safetensors"),
            "total": sum(p.stat().st_size for p in files)}


def candidate_manifest(name: str, path: str, base_dir: str, report: dict, copy: Path) -> dict:
    """The manifest of an admission: an admitted candidate is then judged like a variant the pipeline made
    (method, dtype, settings, bytes and sha256 of its copy in `copy`); a refused one records every reason."""
    libraries = library_versions()
    if report.get("method") == "compressed-tensors":  # the loader's format library, beside the quantizers
        libraries["compressed-tensors"] = metadata.version("compressed-tensors")
    manifest = {"variant": name, "candidate": True, "source_path": str(path), "base_model": base_dir,
                "libraries": libraries, "validation": report}
    if report["admitted"]:
        config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float16")
        manifest.update({"status": "ok", "method": report["method"], "dtype": dtype if dtype in
                         ("float16", "bfloat16", "float32") else "float16",
                         "settings": {"method": report["method"], "bits": report["bits"],
                                      "group_size": report["group_size"],
                                      "checkpoint_format": report["checkpoint_format"],
                                      **({"forward": report["forward"]} if report.get("forward") else {})},
                         "theoretical_weight_bytes": report.get("theoretical_weight_bytes"),
                         "disk_bytes": disk_bytes(copy), "files": report["files"]})
    else:
        manifest.update({"status": "failed", "method": report.get("method"), "reasons": report["reasons"],
                         "error": "validation failed: " + "; ".join(report["reasons"][:5])})
    return manifest


def record_failure(name: str, path: str, base_dir: str, cause: str, out_root: Path = VARIANTS_DIR) -> dict:
    """The manifest of a candidate whose admission died outside the stage (`quantgate fanout`): refused, with why."""
    manifest = {"variant": name, "candidate": True, "source_path": str(path), "base_model": base_dir, "status": "failed",
                "reasons": [cause], "validation": {"admitted": False, "reasons": [cause]}, "error": cause}
    for leftover in out_root.glob(f".{name}.*"):  # atomic_dir's temp folders of a killed process
        shutil.rmtree(leftover, ignore_errors=True)
    with atomic_dir(out_root / name) as tmp:
        write_json(tmp / MANIFEST, manifest)
    return manifest
