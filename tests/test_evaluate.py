"""The evaluate stage on the tests' tiny model: looks, stable ids, fidelity, code isolation, bad input."""

from __future__ import annotations

import os

import pytest

from pipelines.core.errors import QuantgateError

from pipelines.core import sandbox
from pipelines.core.io import read_jsonl
from pipelines.core.paths import EVAL_DIR
from pipelines.core.params_sections import CompareParams, EvaluateParams
from pipelines.evaluation import harness, plans
from pipelines.evaluation.plans import by_id, correctness, probe_plans
from pipelines.judging import sequential

P = EvaluateParams(look_items=4, max_items=8, batch_size=8, fidelity_texts=4)
DOMAINS = list(P.probes)


def plans_for(domains, p=P):
    return probe_plans(domains, p)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_variants):
    """fp16 answers every look (8 items per domain) and writes the fidelity base; gptq3 is evaluated against it. Kept
    by content (tests/content_cache.py); whether bubblewrap runs here decides the code items, so it is part of it."""
    from tests.content_cache import cached

    def build(folder) -> dict:
        base_path = folder / "base.safetensors"
        result, items = harness.evaluate_variant(str(tiny_variants["fp16"]), plans_for(DOMAINS), P, "cpu", base_path)
        answers = {d: correctness(by_id(items, d)) for d in DOMAINS}
        gptq3 = harness.evaluate_variant(str(tiny_variants["gptq3"]), plans_for(DOMAINS), P, "cpu", base_path, answers,
                                         CompareParams())
        return {"baseline": (base_path, result, items), "gptq3": gptq3}

    return cached(tmp_path_factory, "evaluate_tiny", build, code=["evaluation.harness"],
                  helpers=["tests/test_evaluate.py"], inputs=[next(iter(tiny_variants.values())).parent],
                  settings=[P.model_dump(), CompareParams().model_dump(), sandbox.isolation_available()])


@pytest.fixture(scope="module")
def baseline(evaluated):
    return evaluated["baseline"]


@pytest.fixture(scope="module")
def gptq3(evaluated):
    return evaluated["gptq3"]


def test_the_baseline_answers_every_look(baseline):
    _, result, items = baseline
    assert result["status"] == "ok", result.get("error")
    counts = {d: r["items"] for d, r in result["probes"].items()}
    assert counts == {"math": 8, "code": 8 if sandbox.isolation_available() else 0, "chat": 8, "code_comment": 8}
    plans = plans_for(DOMAINS)
    for domain in ("math", "chat", "code_comment"):
        assert {i["item_id"] for i in items if i["domain"] == domain} == set(plans[domain]["order"][:8])
        assert len(result["probes"][domain]["blocks"]) == len(plans[domain]["looks"]) == 3  # one lm-eval call per look
        assert 0.0 <= result["probes"][domain]["score"] <= 1.0
    # each record's chance level (no signal, no pass): 1/choices of a multiple-choice item, 0 for generation
    choices = {r["id"]: len(r["choices"]) for r in read_jsonl(EVAL_DIR / "chat" / "items.jsonl")}
    assert {i["chance"] for i in items if i["domain"] in ("math", "code_comment")} == {0.0}
    assert all(i["chance"] == 1 / choices[i["item_id"]] for i in items if i["domain"] == "chat")


def test_a_variant_stops_where_the_rule_decides(baseline, gptq3):
    _, _, base_items = baseline
    result, items = gptq3
    assert result["status"] == "ok", result.get("error")
    plans = plans_for(DOMAINS)
    for domain in ("math", "chat", "code_comment"):
        mine = {i["item_id"]: i["correct"] for i in items if i["domain"] == domain}
        run = sequential.run_looks(correctness(by_id(base_items, domain)), mine, plans[domain]["order"],
                                   plans[domain]["looks"], plans[domain]["families"], 0.05, 0.025,
                                   CompareParams().spending)
        assert sequential.more_items(run) is None  # decided, or every look used
        assert set(mine) == set(plans[domain]["order"][: sequential.needed_items(run)])
        assert result["probes"][domain]["score"] == pytest.approx(sum(mine.values()) / len(mine))


def test_items_pair_with_the_baseline_by_stable_id(baseline, gptq3):
    _, _, base_items = baseline
    _, items = gptq3
    base = {(i["task"], i["item_id"]): (i["doc_hash"], i["prompt_hash"], i["family"]) for i in base_items}
    assert all(base[(i["task"], i["item_id"])] == (i["doc_hash"], i["prompt_hash"], i["family"]) for i in items)
    assert len({i["item_id"] for i in base_items}) == len(base_items)


@pytest.mark.skipif(not sandbox.isolation_available() and not os.environ.get("QUANTGATE_REQUIRE_SANDBOX"),
                    reason="needs the isolated sandbox (CI sets QUANTGATE_REQUIRE_SANDBOX: there it fails instead)")
def test_code_probes_run_in_the_isolated_sandbox(baseline):
    _, result, items = baseline
    assert result["probes"]["code"]["isolation"] == sandbox.FULL
    assert all(isinstance(i["correct"], bool) for i in items if i["domain"] == "code")


def test_fp16_fidelity_against_its_own_base_is_exact(baseline):
    _, result, _ = baseline
    assert all(f["kl"]["max"] < 1e-4 and f["same_top1"] == 1.0 for f in result["fidelity"].values())


def test_fidelity_texts_cover_every_kind():
    """Round-robin over families, spread by kind first: 12 math texts are not 12 additions."""
    probes = P.model_dump()["probes"]
    texts = harness.fidelity_texts(["math", "code_comment"], 18, probes)
    items = plans.probe_items("math")
    kinds = {item["kind"] for item in items}
    picked = [item for item in items if harness.full_text(probes["math"]["text"], item) in texts["math"]]
    assert len(texts["math"]) == 18 and {item["kind"] for item in picked} == kinds  # 9 kinds, additions one of them
    assert sum(item["kind"] == "add" for item in picked) <= 10
    comments = [item for item in plans.probe_items("code_comment")
                if harness.full_text(probes["code_comment"]["text"], item) in texts["code_comment"]]
    assert len({item["template"] for item in comments}) == 14  # every template before a second phrasing of any


def test_with_bubblewrap_hidden_code_is_not_measured_and_the_gate_cannot_decide(monkeypatch, tiny_variants, tmp_path):
    """bwrap missing (a fresh machine): code probes are refused as this machine's failure, with the remedy; compare
    makes the row `inconclusive` (no evidence against the variant) and the gate exits 2 naming bubblewrap."""
    from pipelines import cli
    from pipelines.core.io import read_json, write_json
    from tests.handmade import correctness, rerun_compare, write_pipeline
    from tests.store_helpers import sqlite_store

    real_which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool, *a, **k: None if tool == "bwrap" else real_which(tool, *a, **k))
    sandbox.isolation_level.cache_clear()
    try:
        p = EvaluateParams(look_items=2, max_items=2, fidelity_texts=2)
        result, items = harness.evaluate_variant(str(tiny_variants["fp16"]), plans_for(["code", "math"], p), p, "cpu",
                                                  tmp_path / "base.safetensors")
    finally:
        monkeypatch.undo()
        sandbox.isolation_level.cache_clear()
    refused = result["probes"]["code"]
    assert (refused["status"], refused["cause"]) == ("refused", "environment")
    assert "apt-get install bubblewrap" in refused["remedy"] and "allow_unisolated_code" in refused["remedy"]
    assert refused["remedy"].endswith("dvc repro --force --downstream baseline")  # DVC sees no changed input
    if os.geteuid() == 0:  # as root the sandbox probe reaches bwrap; it is what is missing
        assert "bwrap not found" in refused["reason"]
    assert result["probes"]["math"]["items"] == 2 and not [i for i in items if i["domain"] == "code"]

    repo = tmp_path / "repo"
    monkeypatch.chdir(repo.mkdir() or repo)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_store(repo))
    n = 400
    write_pipeline(repo, {"fp16": {d: correctness(n, 300) for d in ("math", "code")},
                          "int8": {d: correctness(n, 300, lose=1) for d in ("math", "code")},
                          "awq4": {d: correctness(n, 300, lose=1) for d in ("math", "code")}})
    for name in ("fp16", "int8", "awq4"):  # every model met the same machine: its code probes were refused
        summary = read_json(repo / f"results/eval/{name}.json")
        summary["probes"]["code"] = refused
        write_json(repo / f"results/eval/{name}.json", summary)
    report, table = rerun_compare(repo)
    row = report["variants"]["int8"]["domains"]["code"]
    assert report["variants"]["awq4"]["domains"]["code"]["verdict"] == "inconclusive"
    assert row["verdict"] == "inconclusive" and row["unmeasured"]["remedy"] == refused["remedy"]
    assert report["variants"]["int8"]["domains"]["math"]["verdict"] == "pass"
    assert {r["serve"] for r in table["rows"] if r["domain"] == "code"} == {"fp16"}
    assert cli.main(["gate", "--variant", "int8"]) == 2
    gated = read_json(repo / "results/gate.json")
    assert gated["verdict"] == "undecided" and gated["variants"]["int8"]["domains"] == {"math": "pass", "code": "undecided"}
    assert any("not measured on this machine" in r and "apt-get install bubblewrap" in r for r in gated["reasons"])


def test_failed_variant_is_recorded(tmp_path, baseline):
    (tmp_path / "awq4").mkdir()
    (tmp_path / "awq4" / "quantgate.json").write_text('{"variant": "awq4", "status": "failed", "error": "boom"}')
    result, items = harness.evaluate_variant(str(tmp_path / "awq4"), plans_for(["math"]), P, "cpu", baseline[0], {},
                                              CompareParams())
    assert result["status"] == "failed" and "awq4 is not usable: boom" in result["error"] and items == []


def test_item_without_target_is_a_clear_recorded_failure(tmp_path, monkeypatch, tiny_variants, baseline):
    import shutil

    eval_copy = tmp_path / "eval"
    shutil.copytree("eval", eval_copy)
    lines = (eval_copy / "math" / "items.jsonl").read_text().splitlines()
    lines[16] = lines[16].replace('"answer": ', '"answer_typo": ')
    (eval_copy / "math" / "items.jsonl").write_text("\n".join(lines) + "\n")
    for module in (plans, harness):  # the probe files are read where the items are checked and where lm-eval runs
        monkeypatch.setattr(module, "EVAL_DIR", eval_copy)
    result, _ = harness.evaluate_variant(str(tiny_variants["fp16"]), plans_for(["math"]), P, "cpu", baseline[0], {},
                                          CompareParams())
    assert result["status"] == "failed"
    assert result["error"] == f"QuantgateError: {eval_copy}/math/items.jsonl:17: item math-0016 has no answer"


def test_a_task_that_reads_another_file_than_the_declared_pool_is_refused(tmp_path, monkeypatch):
    """lm-eval's doc ids are positions in the file the task YAML reads: a pool declared elsewhere would pair every
    answer with another item, so the two must name the same file (requests.<name>.probes.items)."""
    import shutil

    eval_copy = tmp_path / "eval"
    shutil.copytree("eval", eval_copy)
    monkeypatch.chdir(tmp_path)  # lm-eval reads the YAML's relative file from the working directory, as the plan does
    choice = {"task": "quantgate_math_choice", "items": "choice.jsonl", "fields": ["id"]}
    plans.check_items({"math": choice})  # as shipped: the YAML reads eval/math/choice.jsonl
    with pytest.raises(QuantgateError, match=r"quantgate_math_choice.yaml: dataset_kwargs.data_files.test is "
                                             r"'eval/math/choice.jsonl', but requests.math.probes names the pool items.jsonl"):
        plans.check_items({"math": {**choice, "items": "items.jsonl"}})
    # the YAML is found by its task: key, whatever its file name; one that names no test file is refused too
    (eval_copy / "math" / "quantgate_math_choice.yaml").rename(eval_copy / "math" / "renamed.yaml")
    plans.check_items({"math": choice})
    # lm-eval indexes every YAML under eval/ and keeps one of two that declare a task: another folder's counts too
    shutil.copy(eval_copy / "math" / "renamed.yaml", eval_copy / "chat" / "again.yaml")
    with pytest.raises(QuantgateError, match=r"eval/chat/again.yaml, eval/math/renamed.yaml all declare "
                                             r"`task: quantgate_math_choice`"):
        plans.check_items({"math": choice})
    (eval_copy / "chat" / "again.yaml").unlink()
    text = (eval_copy / "math" / "renamed.yaml").read_text().replace("    test: eval/math/choice.jsonl", "    train: x.jsonl")
    (eval_copy / "math" / "renamed.yaml").write_text(text)
    with pytest.raises(QuantgateError, match=r"renamed.yaml: dataset_kwargs.data_files.test is None"):
        plans.check_items({"math": choice})
    with pytest.raises(QuantgateError, match=r"no task YAML has `task: quantgate_nothing`"):
        plans.check_items({"math": {**choice, "task": "quantgate_nothing"}})


def test_missing_probe_file_is_a_clear_recorded_failure(tmp_path, monkeypatch, tiny_variants, baseline):
    for module in (plans, harness):
        monkeypatch.setattr(module, "EVAL_DIR", tmp_path)
    result, _ = harness.evaluate_variant(str(tiny_variants["fp16"]), plans_for(["chat"]), P, "cpu", baseline[0], {},
                                          CompareParams())
    assert result["status"] == "failed" and result["error"] == f"QuantgateError: {tmp_path}/chat/items.jsonl: file not found"


def test_model_without_pad_token_still_evaluates(monkeypatch, tiny_variants, tmp_path):
    import pipelines.models.loading as models

    real = models.load_variant

    def no_pad(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        tok.pad_token = None
        return model, tok

    monkeypatch.setattr(harness, "load_variant", no_pad)
    p = EvaluateParams(look_items=2, max_items=2, fidelity_texts=2)
    result, items = harness.evaluate_variant(str(tiny_variants["fp16"]), plans_for(["math"], p), p, "cpu",
                                              tmp_path / "base.safetensors")
    assert result["status"] == "ok" and "no pad token" in result["note"] and len(items) == 2
