"""Check the MLflow UI in a real browser: the child runs and their metrics are there, side by side.

Starts `mlflow server` on localhost over a tracking store (or, given a server's http:// URI, uses that
server's own UI), opens the experiment and the runs-comparison
view in headless Chromium (Playwright driving the system's /usr/bin/chromium; nothing is downloaded),
checks that every child run's name and the chosen metrics appear, and saves screenshots.

    python scripts/check_mlflow_ui.py --tracking-uri sqlite:///mlflow.db --screenshot docs/img/mlflow_compare.png

Exit 0 when everything was found; 1 with the list of what was missing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tracking_uri: str, port: int, log_path: Path) -> subprocess.Popen:
    mlflow = Path(sys.executable).with_name("mlflow")
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", tracking_uri, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlflow server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"mlflow server did not answer on port {port} within 120 s; see {log_path}")


def close_assistant(page) -> None:
    """MLflow 3.17 opens an assistant side panel; close it so the screenshot shows the runs."""
    close = page.get_by_role("button", name="Close", exact=True)
    if close.count():
        close.first.click()
        page.wait_for_timeout(500)


def check(tracking_uri: str, experiment: str, metrics: list[str], screenshot: Path, chromium: str) -> list[str]:
    """What the UI failed to show (empty: all there)."""
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return [f"no experiment {experiment!r} in {tracking_uri}"]
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    parent = next((r for r in runs if r.data.tags.get("quantgate.kind") == "pipeline"), None)
    if parent is None:
        return ["no pipeline (parent) run recorded"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = [r.info.run_name for r in children]
    if tracking_uri.split(":", 1)[0] in ("http", "https"):  # a tracking server is its own UI: open it
        server, base = None, tracking_uri.rstrip("/")
    else:
        port = free_port()
        server = start_server(tracking_uri, port, Path(tempfile.gettempdir()) / f"quantgate-mlflow-server-{port}.log")
        base = f"http://127.0.0.1:{port}"
    missing = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{base}/#/experiments/{exp.experiment_id}/runs", wait_until="load", timeout=120_000)
            page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
            close_assistant(page)
            if f"{len(runs)} matching runs" not in page.inner_text("body"):
                missing.append(f"the experiment page does not list {len(runs)} runs")
            parent_row = page.locator(".ag-row").filter(has_text=parent.info.run_name)
            parent_row.locator("button:not([data-testid])").first.click()  # expand the parent: its children show
            for name in names:
                try:
                    page.locator(".ag-row").filter(has_text=name).first.wait_for(timeout=20_000)
                except Exception:  # noqa: BLE001 - reported below, with everything else missing
                    missing.append(f"child run {name!r} not listed under the parent on the experiment page")
            page.screenshot(path=str(screenshot.with_name(screenshot.stem + "_experiment.png")))
            ids = json.dumps([r.info.run_id for r in children])
            page.goto(f"{base}/#/compare-runs?runs={quote(ids)}&experiments={quote(json.dumps([exp.experiment_id]))}",
                      wait_until="load", timeout=120_000)
            page.get_by_text("Run details").first.wait_for(timeout=60_000)
            page.get_by_text(metrics[0], exact=True).first.wait_for(state="attached", timeout=60_000)
            close_assistant(page)
            body = page.inner_text("body")
            missing += [f"run {n!r} not shown in the comparison view" for n in names if n not in body]
            missing += [f"metric {m!r} not shown in the comparison view" for m in metrics if m not in body]
            missing += [f"tag {t!r} not shown in the comparison view" for t in ("verdict", "verdict.code") if t not in body]
            for section in ("Visualizations", "Parameters"):  # collapsed: run names sit right above the metrics
                page.get_by_text(section, exact=True).first.click()
            page.wait_for_timeout(800)
            page.screenshot(path=str(screenshot), full_page=False)
            browser.close()
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)
    return missing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", default=f"sqlite:///{Path('mlflow.db').resolve()}")
    ap.add_argument("--experiment", default="quantgate")
    ap.add_argument("--metric", action="append", default=None, help="metric that must be visible (repeatable)")
    ap.add_argument("--screenshot", type=Path, default=Path("docs/img/mlflow_compare.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    if not Path(args.chromium).exists():
        print(f"check_mlflow_ui: {args.chromium} not found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    args.screenshot.parent.mkdir(parents=True, exist_ok=True)
    # the comparison view renders only the first rows of its metric table (virtualised): check those
    metrics = args.metric or ["chat/accuracy", "chat/ci_low", "chat/flip_rate", "memory/footprint_bytes"]
    missing = check(args.tracking_uri, args.experiment, metrics, args.screenshot, args.chromium)
    if missing:
        print("check_mlflow_ui: missing:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print(f"check_mlflow_ui: child runs and {', '.join(metrics)} shown; screenshot {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
