"""What the memory stage sees of a model served elsewhere (pipelines/measure/served.py)."""

from __future__ import annotations

import http.server
import os
import threading

from pipelines.measure.served import observe
from tests.llama_server import free_port


def test_what_the_memory_stage_sees_of_a_served_model_is_its_metrics_and_its_process():
    """pipelines/measure/served.py against a real HTTP server in this process: the engine's Prometheus lines about KV
    cache and memory (not the others), and, the server being on this machine, its process's resident memory; from an
    address where nothing answers, nothing."""
    lines = ('vllm:kv_cache_usage_perc{model_name="m"} 0.25\nvllm:num_requests_running 3\n'
             "# HELP process_resident_memory_bytes rss\nprocess_resident_memory_bytes 1.5e9\n").encode()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(lines if self.path == "/metrics" else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        seen = observe({"base_url": f"http://127.0.0.1:{server.server_address[1]}/v1", "model": "m", "timeout_s": 5})
    finally:
        server.shutdown()
    assert seen["metrics"] == {'vllm:kv_cache_usage_perc{model_name="m"}': 0.25, "process_resident_memory_bytes": 1.5e9}
    assert [p["pid"] for p in seen["process"]] == [os.getpid()] and seen["process"][0]["rss_bytes"] > 10_000_000
    assert observe({"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m", "timeout_s": 5}) == \
        {"metrics": None, "process": None}
