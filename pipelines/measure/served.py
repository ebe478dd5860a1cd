"""What the memory stage can see of a model served elsewhere (a candidate behind an OpenAI-compatible endpoint,
pipelines/evaluation/endpoints.py): the engine's own Prometheus metrics and, on this machine, its process's memory.
Labelled as seen from outside, never compared with a footprint measured in-process."""

from __future__ import annotations

import re

from pipelines.core.errors import QuantgateError
from pipelines.evaluation.endpoints import key_of

MEMORY_METRIC = re.compile(r"(?i)kv_cache|cache_usage|memory|_bytes")  # vLLM's vllm:kv_cache_usage_perc, SGLang's ...


def observe(endpoint: dict) -> dict:
    """What the memory stage can see of a served candidate from outside: the engine's Prometheus /metrics lines about
    KV cache and memory (vLLM, SGLang and llama.cpp's own server expose them), and, when the server runs on this
    machine, its process's resident memory. Labelled as seen from outside: another engine's bytes, never compared with
    fp16's footprint measured in-process."""
    import urllib.parse

    import psutil
    import requests

    out: dict = {"metrics": None, "process": None}
    root = endpoint["base_url"].removesuffix("/v1")
    try:
        key = key_of(endpoint)
    except QuantgateError:
        key = None
    try:
        answer = requests.get(f"{root}/metrics", timeout=endpoint.get("timeout_s", 30),
                              headers={"Authorization": f"Bearer {key}"} if key else {})
        if answer.status_code == 200:
            out["metrics"] = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in answer.text.splitlines()
                              if line and not line.startswith("#") and MEMORY_METRIC.search(line.split("{")[0])
                              and _number(line.rsplit(" ", 1)[-1])}
    except (requests.RequestException, ValueError, IndexError):
        pass
    url = urllib.parse.urlsplit(endpoint["base_url"])
    if url.hostname in ("127.0.0.1", "localhost", "::1"):
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            pids = {c.pid for c in psutil.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
            out["process"] = [{"pid": pid, "name": psutil.Process(pid).name(),
                               "rss_bytes": psutil.Process(pid).memory_info().rss} for pid in sorted(pids)] or None
        except (psutil.Error, OSError):
            pass
    return out


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
