"""The traffic log a shadow replay reads: requests in log order, each classified, tokenized once and bucketed.

The log is production data: nothing here writes or logs a request's text. A bad log stops with its file and line
(JSONL, CSV) or row (Parquet), before any model is loaded.
"""

from __future__ import annotations

import csv
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_jsonl

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Request:
    """One logged request; `where` is file:line (JSONL, CSV) or file:row N (Parquet)."""

    id: str
    text: str
    where: str
    label: str | None = None
    reference: str | None = None
    timestamp: float | None = None
    type: str = ""
    ids: list[int] = field(default_factory=list)
    bucket: int | None = None  # None: skipped (too long)


def kind_of(path: Path, kind: str) -> str:
    if kind != "auto":
        return kind
    if path.suffix.lower() not in SUFFIXES:
        raise QuantgateError(f"{path}: cannot tell the log's format from its suffix; set shadow.kind "
                             f"(jsonl, parquet or csv)")
    return SUFFIXES[path.suffix.lower()]


def _rows(path: Path, kind: str) -> list[tuple[str, dict]]:
    """(where, row) for every row of the log. Parquet through pyarrow and CSV through the csv module, read here and
    kept in memory only: nothing is cached on disk (an unmasked copy of production data), and CSV values stay the
    strings they are ("007" stays "007")."""
    if not path.is_file():
        raise QuantgateError(f"{path}: traffic log not found (shadow.traffic)")
    if path.stat().st_size == 0:
        return []
    try:
        if kind == "jsonl":
            rows = read_jsonl(path)  # bad JSON: file:line
            with path.open(encoding="utf-8") as fh:
                lines = [n for n, line in enumerate(fh, start=1) if line.strip()]
            return [(f"{path}:{n}", row) for n, row in zip(lines, rows)]
        if kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            return [(f"{path}:row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
        with path.open(encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)  # every value a string; the header is line 1
            return [(f"{path}:{reader.line_num}", row) for row in reader]  # the line the row ends on
    except QuantgateError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise QuantgateError(f"{path}: cannot read the traffic log as {kind} ({first})") from None


def _seconds(value, where: str, key: str) -> float:
    if isinstance(value, dt.datetime):  # a Parquet timestamp column; a naive one is taken as UTC
        return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # a CSV's seconds
        except ValueError:
            pass
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise QuantgateError(f"{where}: field '{key}' (shadow.timestamp_field) is not seconds or an ISO 8601 time: "
                         f"{str(value)[:40]!r}")


def _given(value):
    """None for a missing field; a CSV's empty cell counts as missing."""
    return None if value is None or value == "" else value


def read_traffic(path: str | Path, kind: str, text_field: str, id_field: str, label_field: str | None,
                 reference_field: str | None, timestamp_field: str | None) -> list[Request]:
    """Every request of the log, in order; a row without a string text field stops with its file and line."""
    path = Path(path)
    rows = _rows(path, kind_of(path, kind))
    if not rows:
        raise QuantgateError(f"{path}: no requests (the traffic log is empty: nothing to replay)")
    out = []
    for n, (where, row) in enumerate(rows):
        text = row.get(text_field)
        if not isinstance(text, str) or not text.strip():
            raise QuantgateError(f"{where}: no text in field '{text_field}' (shadow.text_field)")
        ident = _given(row.get(id_field))
        label = _given(row.get(label_field)) if label_field else None
        ref = _given(row.get(reference_field)) if reference_field else None
        stamp = _given(row.get(timestamp_field)) if timestamp_field else None
        out.append(Request(id=str(ident) if ident is not None else f"line-{n + 1}", text=text, where=where,
                           label=str(label) if label is not None else None,
                           reference=str(ref) if ref is not None else None,
                           timestamp=_seconds(stamp, where, timestamp_field) if stamp is not None else None))
    if timestamp_field and any(r.timestamp is None for r in out):
        missing = next(r for r in out if r.timestamp is None)
        raise QuantgateError(f"{missing.where}: no field '{timestamp_field}' (shadow.timestamp_field)")
    return out


def prepare(requests: list[Request], tokenizer, classifier, buckets: list[int], context: int,
            max_new_tokens: int) -> None:
    """Classify, tokenize (once, shared by every model) and bucket each request; a request too long for the model's
    context (with room for max_new_tokens) or for the largest bucket keeps bucket None: skipped, never truncated."""
    encoded = tokenizer([r.text for r in requests], add_special_tokens=True)["input_ids"]
    for request, ids in zip(requests, encoded):
        request.type = classifier.classify(request.text)
        request.ids = list(ids)
        fits = len(ids) + max_new_tokens <= context
        request.bucket = next((b for b in buckets if b >= len(ids)), None) if fits else None


def batches(requests: list[Request], max_batch: int) -> list[list[int]]:
    """Indices of the replayed requests, in log order, max_batch at a time."""
    kept = [i for i, r in enumerate(requests) if r.bucket is not None]
    return [kept[i : i + max_batch] for i in range(0, len(kept), max_batch)]


def arrivals(requests: list[Request], time_compression: float | None) -> list[float] | None:
    """Seconds after the replay's start at which each request arrives: (t_i - t_0) / F; None: back to back."""
    if not time_compression or any(r.timestamp is None for r in requests):
        return None
    t0 = min(r.timestamp for r in requests)
    return [(r.timestamp - t0) / time_compression for r in requests]
