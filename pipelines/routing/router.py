"""The routing table at serving time: a request's text and length -> the variant that serves it.

Light on purpose: it runs in front of every request, so it imports no torch, numpy or quantgate stage
module, only the classifier (regular expressions) and the table `quantgate route` wrote. Load it once
and ask it per request:

    from pipelines.routing.router import Router
    router = Router.from_file("results/routing_table.json")
    router.route("What is 12 + 35?", context_tokens=40)["serve"]   # -> "int8"
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.text.classify import Classifier


class Router:
    """Rows of a routing table indexed by (domain, context bucket)."""

    def __init__(self, table: dict):
        self.buckets: list[int] = sorted(table["buckets"])
        self.rows: dict[tuple[str, int], dict] = {(r["domain"], r["max_context_tokens"]): r for r in table["rows"]}
        self.classifier = Classifier(table["classifier"])  # the rules the table was built with (params.yaml requests)
        self.digest: str | None = table.get("dvc_lock_sha256")

    @classmethod
    def from_file(cls, path: str | Path) -> Router:
        path = Path(path)
        if not path.is_file():
            raise QuantgateError(f"{path} not found: run `dvc repro` (or `quantgate route`) first")
        try:
            return cls(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise QuantgateError(f"{path}: not a routing table ({type(err).__name__}: {err})") from None

    def lookup(self, domain: str, context_tokens: int) -> dict:
        """The row serving `domain` at `context_tokens`: the smallest bucket that holds it."""
        if context_tokens < 0:
            raise QuantgateError(f"--context-tokens must be >= 0, got {context_tokens}")
        at = bisect.bisect_left(self.buckets, context_tokens)
        if at == len(self.buckets):
            raise QuantgateError(f"{context_tokens} tokens exceed the largest context bucket ({self.buckets[-1]}); "
                                 "add a bucket to route.context_buckets in params.yaml")
        row = self.rows.get((domain, self.buckets[at]))
        if row is None:
            raise QuantgateError(f"the routing table has no row for domain {domain!r} (evaluate.domains leaves it out)")
        return row

    def route(self, text: str, context_tokens: int) -> dict:
        """Classify the request with the classifier calibration coverage uses, then look its row up (requests it
        cannot decide have rows `unknown` and `ambiguous`, served by fp16)."""
        return self.lookup(self.classifier.classify(text), context_tokens)


def table_id(digest: str | None) -> str:
    """The routing table a row came from, as the router config names it: the first 16 hex digits of its dvc.lock
    digest ("none" for a table built without one)."""
    return (digest or "none")[:16]


def metadata(row: dict, digest: str | None) -> dict[str, str]:
    """The request metadata results/vllm-sr.yaml routes on (pipelines/routing/semantic_router.py): the row quantgate
    decided (type and bucket) and the routing table it came from, so a gateway on older rules matches nothing."""
    return {"quantgate_type": row["domain"], "quantgate_bucket": str(row["max_context_tokens"]),
            "quantgate_table": table_id(digest)}


def print_route(text: str, context_tokens: int, as_json: bool = False) -> int:
    """`quantgate route lookup TEXT --context-tokens N [--json]`: print the variant serving the request (with --json,
    the row and the router metadata for it), and why on the log."""
    import logging

    from pipelines.core.paths import ROUTING_TABLE

    router = Router.from_file(ROUTING_TABLE)
    row = router.route(text, context_tokens)
    if as_json:
        print(json.dumps({"serve": row["serve"], "domain": row["domain"], "max_context_tokens": row["max_context_tokens"],
                          "metadata": metadata(row, router.digest)}))
    else:
        print(row["serve"])
    logging.getLogger("pipelines.route").info(
        "route: %s request, %d tokens (bucket <= %d): serve %s, fallback under memory pressure %s (%s)",
        row["domain"], context_tokens, row["max_context_tokens"], row["serve"], row["fallback_under_memory_pressure"],
        row["reason"])
    return 0
