"""Check the MLflow UI in a real browser: what a first-time visitor sees of quantgate's runs.

Starts `mlflow server` on localhost over a tracking store (or, given a server's http:// URI, uses that server's own
UI) and opens it in headless Chromium (Playwright driving the system's /usr/bin/chromium; nothing is downloaded),
each page in a fresh browser profile, so nothing MLflow keeps in a browser's storage plays a part. It checks:

1. runs table, as MLflow 3.17 shows it by default: the latest pipeline run's child runs are listed without a click
   (their parent opens expanded) and each one's verdict is readable in the visible part of its name (the variant
   and 4 letters of its first verdict: MLflow shows no metric or tag column by default, docs/record-gate.md,
   "What the MLflow UI shows");
2. the saved view `quantgate-verdicts` that `record` writes (MLflow's Views menu, or its link): every child run's
   verdict per request type and the numbers deciding it, each cell equal to the recorded value;
3. the comparison view of the latest pipeline's child runs: their names, the chosen metrics, the verdict tags;
4. with two pipeline runs or more, the comparison view of two of them (the two latest, or --parent-run twice): the
   chosen metric's value for each (default: the `<type>/<variant>/accuracy` that fell most between them).

    python scripts/check_mlflow_ui.py --tracking-uri sqlite:///mlflow.db --screenshot docs/img/mlflow_compare.png

Screenshots: SCREENSHOT (3), and beside it *_experiment.png (1), *_verdicts.png (2), *_parents.png (4).
Prints what was shown; exit 0 when everything was there, 1 with the list of what was missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
VIEW_ID = "quantgate-verdicts"  # pipelines/store/layout.py VIEW_ID (repeated: this script imports no quantgate)
VIEW_TAG = "mlflow.sharedViewState." + VIEW_ID
VIEWPORT = {"width": 1600, "height": 1000}

# The part of an element's text that is not cut off by an ancestor that clips it (the runs table cuts run names
# at its column's width with an ellipsis): [visible prefix, whether anything was cut].
VISIBLE_TEXT_JS = """el => {
  let clip = el;
  while (clip && getComputedStyle(clip).overflowX === 'visible') clip = clip.parentElement;
  const right = (clip || el).getBoundingClientRect().right;
  const probe = document.createElement('span');
  probe.textContent = '\u2026';
  el.appendChild(probe);
  const ellipsis = probe.getBoundingClientRect().width;
  probe.remove();
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  const range = document.createRange();
  const chars = [];
  let cut = false;
  for (let node = walker.nextNode(); node; node = walker.nextNode())
    for (let i = 0; i < node.length; i++) {
      range.setStart(node, i); range.setEnd(node, i + 1);
      const box = range.getBoundingClientRect();
      chars.push([node.data[i], box.right]);
      if (box.right > right + 0.5) cut = true;
    }
  const limit = cut ? right - ellipsis : right + 0.5;
  let shown = '';
  for (const [c, r] of chars) { if (r > limit) break; shown += c; }
  return [shown, cut];
}"""

# Every rendered cell of the runs table's scrolling part: [run id, column id, text].
GRID_CELLS_JS = """() => [...document.querySelectorAll('.ag-center-cols-container .ag-row')].flatMap(row =>
  [...row.querySelectorAll('.ag-cell')].map(cell => [row.getAttribute('row-id'), cell.getAttribute('col-id'),
                                                     cell.innerText.trim()]))"""

# In the comparison view's metrics table (two virtualised grids: names, then one value per run): the values of the
# row named `metric` if it is rendered, left to right, else null.
COMPARE_ROW_JS = """([grids, metric]) => {
  const [names, values] = grids;
  const cell = [...names.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer > div')]
    .find(c => c.innerText.trim() === metric);
  if (!cell) return null;
  return [cell.style.top, [...values.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer > div')]
    .filter(c => c.style.top === cell.style.top)
    .sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left)).map(c => c.innerText.trim())];
}"""


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


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None


def verdict_prefix(name: str) -> str:
    """What must be readable of a child run's name: the variant and the first 4 letters of its first verdict
    (`awq4 · fail`, `gptq3 · inco`: enough to tell fail, inconclusive and pass apart)."""
    variant, _, rest = name.partition(" · ")
    return f"{variant} · {rest[:4]}" if rest else name


def fresh_page(browser):
    """A page in a new browser context: a fresh profile, no MLflow view state in its storage; a server with MLflow's
    login gets MLFLOW_TRACKING_USERNAME/PASSWORD, as MLflow's clients do."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    login = {"http_credentials": {"username": user, "password": password}} if user and password else {}
    return browser.new_context(viewport=VIEWPORT, **login).new_page()


def runs_table(browser, base: str, exp_id: str, parent, children: list, runs: list, shot: Path,
               missing: list[str], shown: list[str]) -> None:
    """(1) The runs table as a first-time visitor gets it: no click, no column chosen."""
    page = fresh_page(browser)
    page.goto(f"{base}/#/experiments/{exp_id}/runs", wait_until="load", timeout=120_000)
    page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
    close_assistant(page)
    if f"{len(runs)} matching runs" not in page.inner_text("body"):
        missing.append(f"the experiment page does not list {len(runs)} runs")
    for i, child in enumerate(children):
        name = child.info.run_name
        row = page.locator(f'.ag-pinned-left-cols-container .ag-row[row-id="{child.info.run_id}"]')
        try:
            row.first.wait_for(timeout=20_000 if i == 0 else 3_000)  # the rows come together
        except Exception:  # noqa: BLE001 - reported, with everything else missing
            missing.append(f"child run {name!r} not listed under its parent on the experiment page of a fresh browser")
            continue
        link = row.locator(".ag-cell").get_by_text(name, exact=True).first
        visible, cut = link.evaluate(VISIBLE_TEXT_JS)
        shown.append(f"runs table, fresh browser: {name!r} shows {visible + ('…' if cut else '')!r}")
        if not visible.startswith(verdict_prefix(name)):
            missing.append(f"child run {name!r}: the runs table shows only {visible!r} of its name, "
                           f"not {verdict_prefix(name)!r}")
    page.screenshot(path=str(shot))
    page.context.close()


def view_columns(client, exp_id: str) -> list[str] | None:
    """The saved view's columns as `record` wrote them (None: no such view)."""
    raw = client.get_experiment(exp_id).tags.get(VIEW_TAG)
    if not raw:
        return None
    return json.loads(json.loads(raw)["state"])["selectedColumns"]


def saved_view(browser, base: str, client, exp_id: str, parent, children: list, shot: Path,
               missing: list[str], shown: list[str]) -> None:
    """(2) The saved view, opened by its link in a fresh browser: every verdict and deciding number, cell by cell."""
    columns = view_columns(client, exp_id)
    if columns is None:
        missing.append(f"no saved view {VIEW_ID!r} on the experiment (experiment tag {VIEW_TAG}; `record` writes it)")
        return
    page = fresh_page(browser)
    page.goto(f"{base}/#/experiments/{exp_id}/runs?viewStateShareKey={VIEW_ID}", wait_until="load", timeout=120_000)
    page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
    close_assistant(page)
    page.wait_for_timeout(1000)
    page.screenshot(path=str(shot))
    cells: dict[tuple[str, str], str] = {}
    scroller = page.locator(".ag-body-horizontal-scroll-viewport").first
    width, step = scroller.evaluate("e => [e.scrollWidth, e.clientWidth]")
    for left in range(0, max(width, 1), max(step - 50, 100)):  # the table renders only the columns in sight
        scroller.evaluate("(e, x) => { e.scrollLeft = x; }", left)
        page.wait_for_timeout(400)
        cells.update({(r, c): t for r, c, t in page.evaluate(GRID_CELLS_JS)})
    scroller.evaluate("e => { e.scrollLeft = 0; }")
    page.context.close()
    for child in children:
        data, name, seen = child.data, child.info.run_name, []
        for column in columns:
            kind, key = column.split(".", 1)
            key = key.strip("`")
            text = cells.get((child.info.run_id, column))
            if kind == "tags" and key in data.tags:
                expected = data.tags[key]
                if text != expected:
                    missing.append(f"saved view: {name!r} {key} shows {text!r}, recorded {expected!r}")
                seen.append(f"{key} {text}")
            elif kind == "metrics" and key in data.metrics:
                value, got = data.metrics[key], number(text or "")
                if got is None or not math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-12):
                    missing.append(f"saved view: {name!r} {key} shows {text!r}, recorded {value!r}")
                seen.append(f"{key} {text}")
        if not any(s.startswith("verdict.") for s in seen) and data.tags.get("quantgate.kind") != "baseline":
            missing.append(f"saved view: no verdict of {name!r} shown")
        shown.append(f"saved view {VIEW_ID}, fresh browser: {name}: " + ", ".join(seen))


def compare_children(browser, base: str, exp_id: str, children: list, metrics: list[str], shot: Path,
                     missing: list[str]) -> None:
    """(3) The comparison view of the child runs (as docs/img/mlflow_compare.png shows it)."""
    page = fresh_page(browser)
    ids = json.dumps([r.info.run_id for r in children])
    page.goto(f"{base}/#/compare-runs?runs={quote(ids)}&experiments={quote(json.dumps([exp_id]))}",
              wait_until="load", timeout=120_000)
    page.get_by_text("Run details").first.wait_for(timeout=60_000)
    page.get_by_text(metrics[0], exact=True).first.wait_for(state="attached", timeout=60_000)
    close_assistant(page)
    body = page.inner_text("body")
    missing += [f"run {r.info.run_name!r} not shown in the comparison view" for r in children if r.info.run_name not in body]
    missing += [f"metric {m!r} not shown in the comparison view" for m in metrics if m not in body]
    missing += [f"tag {t!r} not shown in the comparison view" for t in ("verdict", "verdict.code") if t not in body]
    for section in ("Visualizations", "Parameters"):  # collapsed: run names sit right above the metrics
        page.get_by_text(section, exact=True).first.click()
    page.wait_for_timeout(800)
    page.screenshot(path=str(shot), full_page=False)
    page.context.close()


def falling_metric(older, newer) -> str | None:
    """The `<type>/<variant>/accuracy` of the parent runs that fell most from `older` to `newer`."""
    common = [k for k in older.data.metrics if k in newer.data.metrics and re.fullmatch(r"[^/]+/[^/]+/accuracy", k)
              and k.split("/")[1] != "fp16"]
    return max(sorted(common), key=lambda k: older.data.metrics[k] - newer.data.metrics[k], default=None)


def compare_parents(browser, base: str, exp_id: str, pair: list, metrics: list[str], shot: Path,
                    missing: list[str], shown: list[str]) -> None:
    """(4) The comparison view of two pipeline runs: the metrics' values side by side, equal to the recorded ones."""
    page = fresh_page(browser)
    ids = json.dumps([r.info.run_id for r in pair])
    page.goto(f"{base}/#/compare-runs?runs={quote(ids)}&experiments={quote(json.dumps([exp_id]))}",
              wait_until="load", timeout=120_000)
    page.get_by_text("Run details").first.wait_for(timeout=60_000)
    close_assistant(page)
    for section in ("Visualizations", "Parameters"):
        page.get_by_text(section, exact=True).first.click()
    section = page.locator(".du-bois-light-collapse-content").filter(
        has=page.locator('button[aria-label="Metrics - Show diff only"]')).first
    grids = section.locator(".ReactVirtualized__Grid")
    try:
        grids.nth(1).wait_for(timeout=60_000)
    except Exception:  # noqa: BLE001
        missing.append("comparison of the pipeline runs: no metrics table")
        page.context.close()
        return
    handles = [grids.nth(0).element_handle(), grids.nth(1).element_handle()]
    names = " and ".join(r.info.run_name for r in pair)

    def scroll(y: float) -> None:
        """Both grids to `y` (a scroll of the values grid reaches the names grid one event late: set each)."""
        for handle in handles[::-1]:
            handle.evaluate("(e, y) => { e.scrollTop = y; e.dispatchEvent(new Event('scroll')); }", y)
        page.wait_for_timeout(300)

    for metric in metrics:
        found, height, client_height = None, *handles[1].evaluate("e => [e.scrollHeight, e.clientHeight]")
        for top in range(0, max(height, 1), max(client_height - 45, 45)):  # virtualised: scroll until it is drawn
            scroll(top)
            found = page.evaluate(COMPARE_ROW_JS, [handles, metric])
            if found:  # bring the row to the top, then read its values (both grids drawn there)
                scroll(float(found[0].rstrip("px")))
                for _ in range(20):
                    page.wait_for_timeout(300)
                    found = page.evaluate(COMPARE_ROW_JS, [handles, metric]) or found
                    if len(found[1]) >= len(pair):
                        break
                break
        if not found:
            missing.append(f"metric {metric!r} not in the comparison of {names}")
            continue
        texts = found[1]
        recorded = [r.data.metrics.get(metric) for r in pair]
        shown.append(f"comparison of {names}: {metric} " + " -> ".join(texts))
        for run, text, value in zip(pair, texts + [None] * len(pair), recorded):
            got = number(text or "")
            if value is None or got is None or abs(got - value) > 5e-4 + 1e-6 * abs(value):  # shown to 3 decimals
                missing.append(f"comparison of {names}: {metric} of {run.info.run_name!r} shows {text!r}, "
                               f"recorded {value!r}")
    page.screenshot(path=str(shot), full_page=False)
    page.context.close()


def check(tracking_uri: str, experiment: str, metrics: list[str], screenshot: Path, chromium: str,
          compare_metrics: list[str] | None = None, parent_runs: list[str] | None = None) -> tuple[list[str], list[str]]:
    """What the UI failed to show (empty: all there), and what it showed."""
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return [f"no experiment {experiment!r} in {tracking_uri}"], []
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    parents = [r for r in runs if r.data.tags.get("quantgate.kind") == "pipeline"]
    if not parents:
        return ["no pipeline (parent) run recorded"], []
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    if parent_runs:
        by_id = {r.info.run_id: r for r in parents}
        unknown = [i for i in parent_runs if i not in by_id]
        if unknown or len(parent_runs) != 2:
            return [f"--parent-run needs two pipeline runs of {experiment!r}; not pipeline runs: {unknown}"], []
        pair = [by_id[i] for i in parent_runs]
    else:
        pair = sorted(parents[:2], key=lambda r: r.info.start_time) if len(parents) > 1 else []
    stem = screenshot.with_name(screenshot.stem)
    if tracking_uri.split(":", 1)[0] in ("http", "https"):  # a tracking server is its own UI: open it
        server, base = None, tracking_uri.rstrip("/")
    else:
        port = free_port()
        server = start_server(tracking_uri, port, Path(tempfile.gettempdir()) / f"quantgate-mlflow-server-{port}.log")
        base = f"http://127.0.0.1:{port}"
    missing: list[str] = []
    shown: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            runs_table(browser, base, exp.experiment_id, parent, children, runs, Path(f"{stem}_experiment.png"),
                       missing, shown)
            saved_view(browser, base, client, exp.experiment_id, parent, children, Path(f"{stem}_verdicts.png"),
                       missing, shown)
            compare_children(browser, base, exp.experiment_id, children, metrics, screenshot, missing)
            if pair:
                wanted = compare_metrics or [m for m in [falling_metric(*pair)] if m]
                if not wanted:
                    missing.append("the pipeline runs share no <type>/<variant>/accuracy metric to compare")
                else:
                    compare_parents(browser, base, exp.experiment_id, pair, wanted, Path(f"{stem}_parents.png"),
                                    missing, shown)
            elif compare_metrics:
                missing.append("--compare-metric needs two pipeline runs; the experiment has one")
            browser.close()
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)
    return missing, shown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", default=f"sqlite:///{Path('mlflow.db').resolve()}")
    ap.add_argument("--experiment", default="quantgate")
    ap.add_argument("--metric", action="append", default=None,
                    help="metric that must be visible in the comparison of the child runs (repeatable)")
    ap.add_argument("--compare-metric", action="append", default=None,
                    help="parent-run metric whose values the comparison of two pipeline runs must show, e.g. "
                         "code_comment/gptq3/accuracy (repeatable; default: the accuracy that fell most)")
    ap.add_argument("--parent-run", action="append", default=None,
                    help="run id of a pipeline run to compare (twice; default: the two latest)")
    ap.add_argument("--screenshot", type=Path, default=Path("docs/img/mlflow_compare.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    if not Path(args.chromium).exists():
        print(f"check_mlflow_ui: {args.chromium} not found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    args.screenshot.parent.mkdir(parents=True, exist_ok=True)
    # the comparison view renders only the first rows of its metric table (virtualised): check those
    metrics = args.metric or ["chat/accuracy", "chat/ci_low", "chat/flip_rate", "memory/footprint_bytes"]
    missing, shown = check(args.tracking_uri, args.experiment, metrics, args.screenshot, args.chromium,
                           args.compare_metric, args.parent_run)
    for line in shown:
        print(f"check_mlflow_ui: {line}")
    if missing:
        print("check_mlflow_ui: missing:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print(f"check_mlflow_ui: child runs and {', '.join(metrics)} shown; screenshot {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
