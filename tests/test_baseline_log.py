"""fp16's baseline from its own lm-eval sample log (pipelines/evaluation/baseline_log.py): the real `lm_eval` log of
the tests' tiny fp16 gives the records the baseline stage writes from an evaluation here; a log that is not this
checkout's items, settings or answer key is refused by row; KL is not measured for anyone, never passed."""

from __future__ import annotations

import json
import re

import pytest

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, write_json
from pipelines.evaluation import baseline_log, sample_logs
from pipelines.evaluation.plans import by_id
from pipelines.gate import render_report
from pipelines.judging import comparison
from tests.conftest import ROOT
from tests.handmade import correctness as answers_of
from tests.handmade import memory_row, plans, write_eval_items, write_memory, write_model
from tests.sample_log_helpers import COMPARE, DOMAINS, edited_log, from_log, refusal, rewrite_line, samples_file
from tests.sample_log_helpers import P as EVALUATE

N = 400


def test_fp16s_log_as_the_baseline_gives_the_records_fp16_writes_here(log_evidence, tmp_path):
    """fp16's lm-eval log as the baseline: every item of every look, each record as the baseline stage writes it from
    an evaluation here, the log copied with its hashes; int8's log pairs with it as with fp16's own records."""
    base_result, base_items = log_evidence["base"]
    result, items = baseline_log.evaluate(log_evidence["logs"]["fp16"], log_evidence["plan"], tmp_path / "copy")
    assert result["status"] == "ok", result
    assert result["fidelity"] is None and "no token distributions" in result["not_measured"]["fidelity"]
    assert sorted(result["evidence"]["files"]) == sorted(p.name for p in (tmp_path / "copy").iterdir())
    for domain in DOMAINS:
        mine, theirs = by_id(items, domain), by_id(base_items, domain)
        assert set(mine) == set(theirs) and len(mine) == log_evidence["plan"][domain]["looks"][-1]
        for item, record in mine.items():
            assert record == {k: theirs[item][k] for k in record}, item
        assert result["probes"][domain]["score"] == pytest.approx(base_result["probes"][domain]["score"])
        assert result["probes"][domain]["task_version"] == base_result["probes"][domain]["task_version"]
    on_log = sample_logs.records(sample_logs.read_log(log_evidence["logs"]["int8"]), log_evidence["plan"], items, result,
                                 COMPARE.policy_for, COMPARE)
    assert on_log == from_log(log_evidence, log_evidence["logs"]["int8"])
    assert baseline_log.unpaired_rows(log_evidence["int8"][1], items) == {}  # int8 evaluated here pairs with it too


def test_a_baseline_log_that_is_not_this_checkouts_items_is_refused_by_row(log_evidence, tmp_path):
    def other_doc(line):
        record = json.loads(line)
        record["doc"]["question"] = record["doc"].get("question", "") + " (edited)"
        record["doc_hash"] = "1" * 64
        return json.dumps(record)

    def fewer(d):
        path = samples_file(d, "quantgate_chat")
        path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")

    def version(d):
        results = next(d.glob("results_*.json"))
        data = json.loads(results.read_text())
        data["versions"]["quantgate_code_comment"] = 9.0
        results.write_text(json.dumps(data))

    folder = edited_log(log_evidence, "base-doc", lambda d: rewrite_line(samples_file(d, "quantgate_math"), 3, other_doc))
    for edit in (fewer, version):
        edit(next(folder.rglob("results_*.json")).parent)
    result, items = baseline_log.evaluate(folder, log_evidence["plan"], tmp_path / "copy")
    assert result["status"] == "ok"
    reasons = {row: s.get("reason", "") for row, s in result["probes"].items()}
    assert re.search(r"samples_quantgate_math_.*\.jsonl:3: doc \d+'s doc_hash is not the hash of", reasons["math"])
    assert re.search(r"samples_quantgate_chat_.*: fp16 answers every item .* lacks 1 of them", reasons["chat"])
    assert re.search(r"versions.quantgate_code_comment is 9.0, the task here is version 3.0", reasons["code_comment"])
    assert not items
    failed, _ = baseline_log.evaluate(tmp_path / "nowhere", log_evidence["plan"], tmp_path / "copy")
    assert failed["status"] == "failed" and "no such folder" in failed["error"]


def test_an_edited_answer_key_or_config_in_a_log_is_refused_though_its_hashes_were_kept(log_evidence, tmp_path):
    """The doc a log carries must be the one its doc_hash was made from (an item's answer key edited with the score,
    the hash kept), and a task's answering and scoring settings the task's here (prompt_hash covers the prompt only);
    a quantized run is not fp16's."""
    def other_key(line):
        record = json.loads(line)
        record["doc"]["gold"] = (record["doc"]["gold"] + 1) % len(record["doc"]["choices"])
        record["acc"] = 1.0 - record["acc"]
        return json.dumps(record)

    def other_settings(d):
        results = next(d.glob("results_*.json"))
        data = json.loads(results.read_text())
        data["configs"]["quantgate_math"]["generation_kwargs"]["max_gen_toks"] = 7
        data["configs"]["quantgate_chat"]["output_type"] = "generate_until"
        results.write_text(json.dumps(data))

    key = edited_log(log_evidence, "key", lambda d: rewrite_line(samples_file(d, "quantgate_chat"), 2, other_key))
    assert re.search(r"samples_quantgate_chat_.*\.jsonl:2: the record's doc or target is not what its doc_hash",
                     refusal(log_evidence, key, "chat"))
    result, _ = baseline_log.evaluate(key, log_evidence["plan"], tmp_path / "copy")
    # as the baseline, the answer is scored on the doc here (its hash the logged one's): the edited score is caught
    assert re.search(r"jsonl:2: item .*: the log scores it acc .*, the task here scores its response",
                     result["probes"]["chat"]["reason"])
    settings = edited_log(log_evidence, "settings", other_settings)
    summary, _ = from_log(log_evidence, settings)
    assert re.search(r"configs.quantgate_math.generation_kwargs is .*'max_gen_toks': 7", summary["math"]["reason"])
    assert "configs.quantgate_chat.output_type is 'generate_until'" in summary["chat"]["reason"]
    result, _ = baseline_log.evaluate(settings, log_evidence["plan"], tmp_path / "copy")
    assert {r for r, s in result["probes"].items() if s["status"] != "ok"} == {"math", "chat"}

    def quantized(d):
        results = next(d.glob("results_*.json"))
        data = json.loads(results.read_text())
        data["config"]["model_args"]["quantization"] = "awq"
        results.write_text(json.dumps(data))

    result, _ = baseline_log.evaluate(edited_log(log_evidence, "awq", quantized), log_evidence["plan"], tmp_path / "copy")
    assert result["status"] == "failed" and "model_args quantization=awq: a quantized run" in result["error"]


def test_a_variant_asked_with_other_prompts_than_fp16s_log_does_not_pair(log_evidence):
    base_items = log_evidence["base"][1]
    mine = [dict(r) for r in log_evidence["int8"][1]]
    for domain, key in (("code_comment", "prompt_hash"), ("math", "doc_hash"), ("chat", "item_id")):
        next(r for r in mine if r["domain"] == domain)[key] = "2" * 64
    unpaired = baseline_log.unpaired_rows(mine, base_items)
    assert set(unpaired) == {"code_comment", "math", "chat"}
    assert "prompt_hash differs from fp16's: another prompt" in unpaired["code_comment"]
    assert "doc_hash differs from fp16's" in unpaired["math"]
    assert "fp16's baseline has no answer to it" in unpaired["chat"]


def test_with_fp16_from_a_log_kl_is_not_measured_for_any_model(tmp_path):
    """A variant evaluated here has no KL against a log baseline: inconclusive, never a pass (and not a failure)."""
    write_model(tmp_path, "fp16", {d: answers_of(N, 300) for d in ("math", "code")})
    write_model(tmp_path, "int8", {d: answers_of(N, 300) for d in ("math", "code")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    write_memory(tmp_path, {"fp16": memory_row("fp16"), "int8": memory_row("int8")})
    for name in ("fp16", "int8"):
        path = tmp_path / "results/eval" / f"{name}.json"
        write_json(path, {**read_json(path), "fidelity": None,
                          "not_measured": {"fidelity": baseline_log.NO_DISTRIBUTIONS}})
    base = read_json(tmp_path / "results/eval/fp16.json")
    base["baseline"] = {"source": "samples", "path": "/logs/fp16"}
    base["evidence"] = {"backend": "vllm", "model_args": "pretrained=org/model-70b", "lm_eval_version": "0.4.13"}
    base["probes"]["code"] = {"task": "quantgate_code", "status": "refused", "items": 0,
                              "reason": "fp16's sample log cannot give this row: no samples_quantgate_code_<date>.jsonl"}
    write_json(tmp_path / "results/eval/fp16.json", base)
    report = comparison.compare_all(["fp16", "int8"], [], plans(tmp_path), COMPARE, tmp_path / "results",
                                    tmp_path / "models/variants")
    math, code = (report["variants"]["int8"]["domains"][d] for d in ("math", "code"))
    assert math["verdict"] == "inconclusive", math["reasons"]
    assert any("KL not measured here" in r and "only against fp16 evaluated here" in r for r in math["reasons"])
    assert code["verdict"] == "inconclusive", code["reasons"]  # fp16's gap, not the variant's failure
    assert any("no samples_quantgate_code" in r and "give fp16's log this row's task" in r for r in code["reasons"])
    said = render_report({"verdict": "undecided", "gated": ["int8"], "reasons": []}, report, None)
    assert "- fp16 (the baseline): lm-eval sample log, backend `vllm`, model_args `pretrained=org/model-70b`" in said


def test_the_baseline_section_says_where_fp16s_answers_come_from():
    from pydantic import ValidationError

    from pipelines.core.params_candidates import BaselineParams

    assert BaselineParams().source == "here"
    with pytest.raises(ValidationError, match="set source: samples for a log"):
        BaselineParams(path="/logs/fp16")
    with pytest.raises(ValidationError, match="needs the folder of fp16's lm-eval sample log"):
        BaselineParams(source="samples")
    assert BaselineParams(source="samples", path="/logs/fp16").path == "/logs/fp16"
    server = {"base_url": "http://127.0.0.1:8000/v1", "model": "fp16"}
    with pytest.raises(ValidationError, match="source endpoint needs endpoint"):
        BaselineParams(source="endpoint", path="deploy/fp16.yaml")
    with pytest.raises(ValidationError, match="and only it takes one"):
        BaselineParams(source="samples", path="/logs/fp16", endpoint=server)
    with pytest.raises(ValidationError, match="needs fp16's deployment spec, outside models/"):
        BaselineParams(source="endpoint", path="models/variants/fp16", endpoint=server)
    assert BaselineParams(source="endpoint", path="deploy/fp16.yaml", endpoint=server).endpoint.model == "fp16"


def test_the_baseline_stage_writes_fp16s_records_from_its_log_and_no_distributions(log_evidence, tmp_path):
    """The stage's own writing (pipelines/baseline.py): records, an empty fidelity-text list, the log copied, no
    distributions file left from an earlier run here; a log that does not read stops the stage with its reason."""
    import contextlib

    from pipelines import baseline
    from pipelines.core.io import read_jsonl
    from pipelines.core.paths import BASELINE_RESULTS, FIDELITY_BASE, FIDELITY_TEXTS

    (tmp_path / "eval").symlink_to(ROOT / "eval")
    with contextlib.chdir(tmp_path):
        FIDELITY_BASE.parent.mkdir(parents=True)
        FIDELITY_BASE.write_bytes(b"an earlier run's")
        assert baseline._from_log(logged(log_evidence["logs"]["fp16"]), log_evidence["plan"], EVALUATE) == 0
        assert not FIDELITY_BASE.exists()
        assert read_jsonl(BASELINE_RESULTS / "items.jsonl") and read_jsonl(BASELINE_RESULTS / FIDELITY_TEXTS) == []
        written = read_json(BASELINE_RESULTS / "eval.json")
        assert written["status"] == "ok" and written["baseline"]["source"] == "samples"
        assert sorted(p.name for p in (BASELINE_RESULTS / "samples").iterdir()) == sorted(written["evidence"]["files"])
        with pytest.raises(QuantgateError, match="fp16 baseline could not be read from fp16's sample log .*no such "
                                                 "folder"):
            baseline._from_log(logged(tmp_path / "nowhere"), log_evidence["plan"], EVALUATE)


def logged(folder):
    from pipelines.core.params_candidates import BaselineParams

    return BaselineParams(source="samples", path=str(folder))
