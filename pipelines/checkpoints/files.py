"""The file policy, checked before anything parses a weight: which files a candidate may hold, and each small
file read once, hashed and (JSON) parsed.

Loading a checkpoint can run code (pickle, remote code), so code, pickle, other frameworks' weights,
symlinks, PEFT adapters and unknown files are refused by name; JSON that asks for remote code is refused.
The one link followed is huggingface_hub's cache layout (a snapshot's file -> its own repo's blobs/<hash>):
every read opens the blob itself, re-checked at open time and never through another link (`open_member`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path

from pipelines.checkpoints.context import Candidate

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".joblib", ".dill"}
CODE_SUFFIXES = {".py", ".pyc", ".pyo", ".pyd", ".so", ".dll", ".dylib", ".sh", ".ipynb", ".exe"}
IGNORED_DIRS = {".cache": "download tool state (huggingface_hub --local-dir)",
                "original": "the publisher's original-format weights, not what transformers loads"}
# transformers writes extra chat templates as additional_chat_templates/<name>.jinja beside the tokenizer
TEMPLATE_DIRS = {"additional_chat_templates": {".jinja"}}
# vocab.json / vocab.txt: the only vocab.* names transformers' tokenizers read (VOCAB_FILES_NAMES); any other
# vocab.<suffix> is an unexpected file, not a wildcard
TOKENIZER_NAMES = {"tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "merges.txt", "vocab.json",
                   "vocab.txt"}
TOKENIZER_SUFFIXES = {".tiktoken", ".spm", ".jinja"}
TEXT_PREFIXES = ("LICENSE", "LICENCE", "README", "NOTICE", "COPYING", "USE_POLICY")
TEXT_SUFFIXES = {".md", ".txt", ".csv"}  # inert text: READMEs, GPTQModel's quant_log.csv
# llm-compressor saves the recipe it ran as recipe.yaml beside every checkpoint (and hub repos ship it): no loader
# reads it, nothing here parses it; copied as text, so the team sees how the candidate was made
TEXT_NAMES = {"recipe.yaml"}
# other frameworks' weights, which hub repositories often ship beside the safetensors ones (pickle or code-capable)
OTHER_WEIGHT_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx_data", ".gguf"}
OTHER_WEIGHT_DIRS = {"onnx", "openvino", "coreml"}
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}
# every non-weights file is read whole in phase 1 (its bytes parsed and hashed); the largest real
# tokenizer.json files are tens of MB
MAX_SMALL_BYTES = 256 << 20
# huggingface_hub's cache (file_download._create_symlink): <cache>/models--org--name/snapshots/<rev>/<file> is a
# relative link to ../../blobs/<hash> (one more ../ per sub-folder); these are the hub's names, not the project's
HUB_REPO_PREFIX, HUB_SNAPSHOTS, HUB_BLOBS = "models--", "snapshots", "blobs"
NO_LINKS = "copy the real files, e.g. `hf download --local-dir`"


def classify(rel: str) -> tuple[str | None, str | None]:
    """(kind, None) for an accepted file, (None, reason) for a refused one; `rel` is relative to the folder."""
    parts = rel.split("/")
    name, suffix = parts[-1], Path(parts[-1]).suffix.lower()
    if name in PEFT_FILES:
        return None, (f"{rel}: a PEFT adapter, not a full checkpoint; merge it into its base model "
                      "(peft's merge_and_unload, then save_pretrained) and admit the merged folder")
    if suffix in PICKLE_SUFFIXES:
        return None, f"{rel}: pickle-based file refused (loading it can run code); only safetensors weights"
    if suffix in OTHER_WEIGHT_SUFFIXES:
        return None, f"{rel}: {suffix} weights refused (another framework's format); only safetensors weights"
    if suffix in CODE_SUFFIXES:
        return None, f"{rel}: {suffix} file refused (executable code)"
    if len(parts) > 1:
        allowed = TEMPLATE_DIRS.get(parts[0], set())
        if len(parts) == 2 and suffix in allowed:
            return "tokenizer", None
        return None, f"{rel}: unexpected file in sub-folder {parts[0]}/ (only {sorted(allowed)} files are accepted there)"
    if name.endswith(".safetensors"):
        return "weights", None
    if suffix == ".json":
        return "json", None
    if name in TOKENIZER_NAMES or suffix in TOKENIZER_SUFFIXES:
        return "tokenizer", None
    if name.startswith(TEXT_PREFIXES) or name == ".gitattributes" or suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
        return "text", None
    return None, f"{rel}: unexpected file type; accepted: safetensors, JSON, tokenizer and plain-text files"


def list_files(folder: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """({relative path: kind} to copy, reasons to refuse, notes) under the file policy."""
    files: dict[str, str] = {}
    reasons: list[str] = []
    notes: list[str] = []

    def visit(path: Path) -> None:
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            problem = link_problem(folder, rel, hub_blobs(folder))
            if problem:
                reasons.append(f"{rel}: symbolic link refused ({problem})")
            else:
                accept(rel)
        elif path.is_dir():
            if path.parent == folder and path.name in IGNORED_DIRS:
                count = sum(1 for p in path.rglob("*") if not p.is_dir())
                notes.append(f"{rel}/: ignored, not copied ({count} files; {IGNORED_DIRS[path.name]})")
            elif path.parent == folder and path.name in TEMPLATE_DIRS:
                for child in sorted(path.iterdir()):
                    visit(child)
            else:
                reasons.append(f"{rel}/: sub-folder refused (only {sorted(IGNORED_DIRS)} are ignored and "
                               f"{sorted(TEMPLATE_DIRS)} accepted)")
        elif not path.is_file():
            reasons.append(f"{rel}: not a regular file")
        else:
            accept(rel)

    def accept(rel: str) -> None:
        kind, reason = classify(rel)
        if kind:
            files[rel] = kind
        else:
            reasons.append(reason)

    for entry in sorted(folder.iterdir()):
        visit(entry)
    hint = download_hint(folder, files, reasons)
    return files, reasons + ([hint] if hint else []), notes


def hub_blobs(folder: Path) -> Path | None:
    """The real path of the repo's blobs/ when `folder` is a snapshot of huggingface_hub's cache, found by its
    structure (models--*/snapshots/<rev>, blobs/ a real folder beside snapshots/); None for any other folder."""
    real = Path(os.path.realpath(folder))
    repo = real.parent.parent
    if real.parent.name != HUB_SNAPSHOTS or not repo.name.startswith(HUB_REPO_PREFIX):
        return None
    blobs = repo / HUB_BLOBS
    return blobs if blobs.is_dir() and not blobs.is_symlink() else None


def link_problem(folder: Path, rel: str, blobs: Path | None) -> str | None:
    """Why the link `rel` may not be followed; None only for one hop to a regular file in its own repo's blobs/.

    Checked on the link's text, not only its resolution: a chain through another link (in or out of the repo),
    a symlinked blobs/, another repo's blobs, a directory, a FIFO or a dangling link are all refused.
    """
    if blobs is None:
        return f"not in a huggingface_hub cache snapshot; {NO_LINKS}"
    link, text, hop = one_hop(folder, rel)
    if hop.parent != blobs:
        return f"it points to {text}, outside {blobs}; only a snapshot's links into its own repo's blobs/ are followed"
    try:
        mode = os.lstat(hop).st_mode
    except FileNotFoundError:
        return f"it points to {text}, which does not exist (an incomplete download?)"
    if not stat.S_ISREG(mode) or os.path.realpath(link) != str(hop):
        return f"it points to {text}, which is not a regular file"
    return None


def one_hop(folder: Path, rel: str) -> tuple[Path, str, Path]:
    """(the link's real path, its text, where that text leads, resolved lexically: one hop, no link followed)."""
    link = Path(os.path.realpath(folder)) / rel  # its parent folders are real: a linked sub-folder is refused
    text = os.readlink(link)
    return link, text, Path(os.path.normpath(link.parent / text))


def open_member(folder: Path, rel: str):
    """An accepted file opened for reading: the file itself, or the hub blob its link points to, re-checked now
    (a file turned into a link, or a link re-pointed, since the file policy ran is refused, not followed)."""
    path = folder / rel
    if path.is_symlink():
        problem = link_problem(folder, rel, hub_blobs(folder))
        if problem:
            raise OSError(errno.ELOOP, f"symbolic link refused ({problem}; changed since it was checked)", str(path))
        path = one_hop(folder, rel)[2]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in is refused below, not waited on
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (changed since it was checked)", str(path))
    return os.fdopen(fd, "rb")


def download_hint(folder: Path, files: dict[str, str], reasons: list[str]) -> str | None:
    """What to do when other frameworks' weights sit beside safetensors ones (a common hub layout)."""
    if not any(kind == "weights" for kind in files.values()):
        return None
    patterns = []
    for reason in reasons:
        rel = reason.split(": ", 1)[0]
        if rel.rstrip("/") in OTHER_WEIGHT_DIRS and rel.endswith("/"):
            patterns.append(f'"{rel}*"')
        elif "/" not in rel and Path(rel).suffix.lower() in OTHER_WEIGHT_SUFFIXES | PICKLE_SUFFIXES:
            patterns.append(f'"*{Path(rel).suffix.lower()}"')
    if not patterns:
        return None
    exclude = " ".join(dict.fromkeys(patterns))
    if hub_blobs(folder):  # the hub cache's files are shared by every user of that cache: not to be deleted
        return (f"{folder}: the safetensors weights are here too, in a hub cache snapshot: download without the other "
                f"formats into a folder of your own: hf download <repo> --exclude {exclude} --local-dir DIR")
    return (f"{folder}: the safetensors weights are here too: delete the other formats, or download without them: "
            f"hf download <repo> --exclude {exclude} --local-dir {folder}")


def find_remote_code(data, where: str = "") -> list[str]:
    """Paths of auto_map keys and truthy trust_remote_code anywhere in a parsed JSON document."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{where}.{key}" if where else key
            if key == "auto_map":
                found.append(f"{path} {sorted(value) if isinstance(value, dict) else value!r}")
            elif key == "trust_remote_code" and value:
                found.append(f"{path} = {value!r}")
            else:
                found += find_remote_code(value, path)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += find_remote_code(value, f"{where}[{i}]")
    return found


def read_small(folder: Path, files: dict[str, str]) -> tuple[dict, dict[str, str], dict[str, int], list[str]]:
    """(parsed JSON files, {file: sha256}, {file: size} of every non-weights file, reasons) from one read of each.

    The data pass copies these files again and must find the same sha256: a config.json rewritten
    between the checks and the copy (to add auto_map, say) is refused, not copied unchecked.
    """
    docs, digests, sizes, reasons = {}, {}, {}, []
    for rel, kind in files.items():
        if kind == "weights":
            continue
        with open_member(folder, rel) as fh:
            raw = fh.read(MAX_SMALL_BYTES + 1)
        if len(raw) > MAX_SMALL_BYTES:
            reasons.append(f"{rel}: larger than {MAX_SMALL_BYTES >> 20} MiB; refused for a {kind} file")
            continue
        digests[rel], sizes[rel] = hashlib.sha256(raw).hexdigest(), len(raw)
        if kind != "json":
            continue
        try:
            docs[rel] = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            reasons.append(f"{rel}: not valid JSON ({type(err).__name__}: {err})")
            continue
        for hit in find_remote_code(docs[rel]):
            reasons.append(f"{rel}: {hit} asks to run remote code; refused")
    return docs, digests, sizes, reasons


def file_policy(c: Candidate) -> list[str]:
    """Check: every file's name and type (sets c.files, the accepted files, and the notes on ignored folders)."""
    c.files, reasons, c.details["notes"] = list_files(c.folder)
    return reasons


def small_files(c: Candidate) -> list[str]:
    """Check: every non-weights file read once, its sha256 kept and (JSON) parsed without remote code."""
    c.docs, c.checked, c.sizes, reasons = read_small(c.folder, c.files)
    return reasons


def config_present(c: Candidate) -> list[str]:
    """Check: config.json is there and a JSON object (every later check reads it)."""
    c.config = c.docs.get("config.json")
    if isinstance(c.config, dict):
        return []
    return ["config.json: missing" if "config.json" not in c.files else "config.json: not a JSON object"]
