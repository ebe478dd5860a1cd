"""File I/O that never leaves a half-written output: write beside the target, then rename."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from pipelines.core.errors import QuantgateError


def _json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: write them as null so readers see 'missing', never a fake number."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temp file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(_json_safe(data), indent=2, ensure_ascii=False, sort_keys=False) + "\n")


def write_yaml(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, yaml.safe_dump(_json_safe(data), sort_keys=False, allow_unicode=True))


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantgateError(f"{path}: file not found") from None
    except json.JSONDecodeError as err:
        raise QuantgateError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None


def read_jsonl(path: str | Path) -> list[dict]:
    """Every line of a JSONL file as a dict; a bad line is reported with its file and line number."""
    path = Path(path)
    if not path.is_file():
        raise QuantgateError(f"{path}: file not found")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise QuantgateError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise QuantgateError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(_json_safe(r), ensure_ascii=False) + "\n" for r in rows))


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success it replaces `path`, on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
