"""Shared fixtures and the hooks that sort tests into tiers and worker groups; the tiny model's fixtures are
tests/tiny_chain.py's."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (before anything below imports Hugging Face code)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tests.tiny_chain import (  # noqa: E402, F401 - fixtures: pytest finds them here
    log_evidence, tiny_calibration, tiny_model, tiny_params, tiny_variants)
from tests.workers import (  # noqa: E402, F401 - hooks: pytest finds them here
    SECONDS_OF_GROUP, group_of, pytest_cmdline_main, pytest_configure, pytest_configure_node, pytest_unconfigure,
    pytest_xdist_auto_num_workers, pytest_xdist_node_collection_finished)

ROOT = Path(__file__).resolve().parents[1]

# ---- the tiers (docs/testing.md): a test is in the quick tier unless it needs one of these. A fixture that starts one
# marks every test that uses it, so a new test lands in the right tier without anyone remembering to mark it; a test
# that starts one itself carries the marker. Keys are module:fixture, so another module's fixture of the same name
# (a cheap one) is not taken for these.
HEAVY = ("e2e", "ray", "server", "browser")
TIER_OF_FIXTURE = {
    "tests.conftest:pipeline_run": ("e2e",),  # the whole pipeline, twice (below)
    "tests.test_fanout:ray_cluster": ("ray",),
    "tests.test_fanout:sequential_and_fanned": ("ray", "e2e"),
    "tests.test_repro:sequential_and_repro": ("ray", "e2e"),
    "tests.test_endpoints:served": ("server",),  # llama.cpp's OpenAI-compatible server
    "tests.test_mlflow_server:server": ("server",),  # MLflow's server on PostgreSQL
    "tests.test_record:server": ("server",),  # MLflow's server on SQLite
    "tests.test_mlflow_ui:two_pipelines": ("browser",),  # Chromium on the MLflow UI
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    group = {}
    for item in items:
        keys = [f"{d.func.__module__}:{name}" for name in item.fixturenames
                for d in item._fixtureinfo.name2fixturedefs.get(name, ())]
        for marker in dict.fromkeys(m for key in keys for m in TIER_OF_FIXTURE.get(key, ())):  # once each, in order
            item.add_marker(marker)
        if not any(item.get_closest_marker(name) for name in HEAVY):
            item.add_marker("quick")
        group[item] = group_of(item, keys)
        if config.pluginmanager.hasplugin("xdist"):  # (its marker is unknown under -p no:xdist)
            item.add_marker(pytest.mark.xdist_group(group[item]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike; one process keeps the files' order
        items.sort(key=lambda item: -SECONDS_OF_GROUP.get(group[item], 0))


# ---- the content cache (tests/content_cache.py): what a failed test read is built anew next run
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        from tests.content_cache import entries_of

        report.user_properties.append(("content_cache_entries", entries_of(item)))
    return report


_FAILED_ENTRIES: set[str] = set()


def pytest_runtest_logreport(report):
    """On the main process (and every worker): the entries failed tests read (user_properties cross from workers)."""
    for key, entries in report.user_properties:
        if key == "content_cache_entries":
            _FAILED_ENTRIES.update(entries)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput") and _FAILED_ENTRIES:  # the main process: the whole run is over
        from tests.content_cache import forget

        forget(_FAILED_ENTRIES)


@pytest.fixture
def every_item(request) -> bool:
    """Whether a test that sweeps a whole shipped pool takes every item (the full run, as CI runs it) or a sample (the
    quick tier: exactly `-m quick`; docs/testing.md)."""
    return " ".join(request.config.getoption("markexpr").split()) != "quick"


@pytest.fixture(autouse=True)
def _dvc_logging_on_live_streams():
    """dvc's in-process API logs through handlers bound to sys.stdout/sys.stderr as they were when its logging was set
    up. Set up inside a test that captured its output (capsys), they write to a closed stream in every later test;
    which test comes first depends on the order, and pytest-xdist's workers take another one."""
    yield
    dvc_logger = sys.modules.get("dvc.logger")
    if not dvc_logger:
        return
    loggers = [logging.getLogger(name) for name in ("dvc", "dvc_objects", "dvc_data")]
    if any(h.stream.closed for lg in loggers for h in lg.handlers if isinstance(h, dvc_logger.LoggerHandler)):
        for lg in loggers:  # setup() adds handlers: drop dvc's old ones first
            for h in [h for h in lg.handlers if isinstance(h, dvc_logger.LoggerHandler)]:
                lg.removeHandler(h)
        dvc_logger.setup()


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Stages resolve shipped sources relative to the repository root, as `dvc repro` runs them."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(autouse=True)
def _mlflow_fluent_store_forgotten():
    """MLflow keeps the store its fluent API was pointed at in a module global (a test's server, stopped since);
    the next test starts without it, as a new process would, whatever order the tests run in."""
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and getattr(utils, "_tracking_uri", None) is not None:
        utils._tracking_uri = None


# ---- third-party checkpoints for the admission tests (tests/test_checkpoints_*.py), built once per session
@pytest.fixture(scope="session")
def direct_checkpoints(tmp_path_factory, tiny_model, tiny_calibration):
    """Checkpoints written by the libraries themselves, not through quantgate (tests/test_checkpoints_*.py)."""
    from tests.checkpoint_helpers import library_written

    return library_written(tiny_model, tiny_calibration, tmp_path_factory.mktemp("direct"))


@pytest.fixture(scope="session")
def ct_checkpoints(tmp_path_factory, tiny_model):
    """compressed-tensors checkpoints, one per admitted format and strategy (tests/checkpoint_helpers.py ct_schemes),
    written by the library's own ModelCompressor."""
    from tests.checkpoint_helpers import compressed_tensors_written

    return compressed_tensors_written(tiny_model, tmp_path_factory.mktemp("ct"))


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory, direct_checkpoints):
    """The library-written GPTQ checkpoint split into 2 shards plus the index."""
    from tests.checkpoint_helpers import reshard

    return reshard(direct_checkpoints["gptq"], tmp_path_factory.mktemp("sharded") / "gptq")


# ---- shared by the record, gate and store tests (tests/test_record.py, tests/test_gate.py, tests/test_store_*.py)
@pytest.fixture()
def recorded(tmp_path):
    """int8 passes both domains, awq4 fails math; recorded once."""
    from pipelines import record
    from tests.handmade import correctness
    from tests.store_helpers import N, sqlite_store, write_recordable

    built = write_recordable(tmp_path, {"fp16": {d: correctness(N, 300) for d in ("math", "code")},
                                        "int8": {d: correctness(N, 300, lose=1) for d in ("math", "code")},
                                        "awq4": {"math": correctness(N, 300, lose=60), "code": correctness(N, 300)}})
    uri = sqlite_store(tmp_path)
    summary = record.record_pipeline(built["params"], uri, built["digest"], {"commit": "abc123", "dirty": False},
                                     root=tmp_path, artifact_root=tmp_path / "artifacts")
    return tmp_path, built, uri, summary


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    from tests.store_helpers import sqlite_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_store(tmp_path))
    return tmp_path


# ---- gsm8k local files for tests/test_standard_tasks.py and tests/test_standard_task_rows.py (per module: cheap)
@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    from pipelines.core.io import write_jsonl
    from tests.standard_task_helpers import PROBLEMS, SHOTS, rows

    root = tmp_path_factory.mktemp("gsm8k")
    write_jsonl(root / "test.jsonl", rows(PROBLEMS))
    write_jsonl(root / "train.jsonl", rows(SHOTS))
    return {"test": str(root / "test.jsonl"), "train": str(root / "train.jsonl")}


# ---- the whole pipeline, run ONCE per session: read by tests/test_pipeline_e2e.py and tests/test_readme_commands.py,
# copied by tests/test_audit.py, and what the fan-out tests (tests/test_fanout.py, tests/test_repro.py) compare their
# own runs against (copies are cheap, runs are not)
@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory):
    """`dvc repro` (twice) in the small repository (tests/chain_helpers.py `small_repo`: every variant, the fifth request
    type) with three candidates: a broken one, one judged from its lm-eval sample log, one served by a real engine."""
    import yaml

    from pipelines.core.params import load_params
    from pipelines.evaluation.plans import probe_plans
    from tests.chain_helpers import SMALL_VARIANTS, small_repo
    from tests.llama_server import serving, write_gguf
    from tests.pipeline_e2e_helpers import dvc
    from tests.sample_log_helpers import lm_eval_log

    # the shipped reference model (copied, not trained): a model that answers the probes, so the verdicts judge
    # something (a model that scores 0 everywhere cannot pass) and the loop runs to promotion
    repo = small_repo(tmp_path_factory.mktemp("repo"), SMALL_VARIANTS)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    broken = repo / "third_party" / "vendor-gptq"  # a candidate that must be rejected, not crash the pipeline
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (broken / "pytorch_model.bin").write_bytes(b"\x80\x04")
    # a candidate judged from its lm-eval sample log (pipelines/evaluation/sample_logs.py): the shipped model in
    # bfloat16 run through the real `lm_eval` command, as a team runs its model where it serves it; memory and KL
    # declared measured elsewhere (a log gives neither)
    # and one served by a real engine (pipelines/evaluation/endpoints.py): the shipped model as llama.cpp's Q8_0,
    # behind llama-cpp-python's OpenAI-compatible server for the whole session; the GGUF is what `path` hashes
    served = repo / "third_party" / "vendor-served"
    served.mkdir()
    gguf_file = write_gguf(repo / "reference_model", served / "model.Q8_0.gguf", "Q8_0")
    with serving(gguf_file, "vendor-q8", tmp_path_factory.mktemp("llama-server") / "server.log") as base_url:
        params["candidates"] = {"vendor-gptq": {"path": "third_party/vendor-gptq"},
                                "vendor-log": {"path": "third_party/vendor-log", "source": "samples",
                                               "judged_elsewhere": ["memory", "fidelity"]},
                                "vendor-served": {"path": "third_party/vendor-served/model.Q8_0.gguf",
                                                  "source": "endpoint", "judged_elsewhere": ["memory", "fidelity"],
                                                  "endpoint": {"base_url": base_url, "model": "vendor-q8",
                                                               # greedy: the server's default penalizes repeats
                                                               "request_fields": {"repeat_penalty": 1.0}}}}
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
        with contextlib.chdir(repo):
            evaluate = load_params().evaluate
            plan = probe_plans(evaluate.domains, evaluate)
        lm_eval_log(repo / "reference_model", repo / "third_party" / "vendor-log", plan, repo, evaluate.batch_size,
                    "bfloat16")
        first = dvc(["repro"], repo)
        assert first.returncode == 0, first.stdout + first.stderr
        second = dvc(["repro"], repo)
        yield repo, first, second


@pytest.fixture(scope="session", autouse=True)
def _ray_token_removed_after():
    """The fan-out tests' Ray token (tests/chain_helpers.py) goes with the session, whichever test made it last."""
    yield
    import shutil

    from tests.chain_helpers import TOKEN

    shutil.rmtree(TOKEN.parent, ignore_errors=True)
