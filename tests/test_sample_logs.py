"""Candidates judged from lm-eval sample logs (pipelines/evaluation/sample_logs.py): logs written by the real
`lm_eval` command on the tests' tiny model pair with the pipeline's own records item for item, give the same verdict
rows, and a log that does not pair is refused naming file and line; what a log cannot measure is said, never passed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pipelines.core.errors import QuantgateError
from pipelines.core.io import read_json, write_json
from pipelines.evaluation import log_records, sample_logs
from pipelines.evaluation.plans import by_id
from pipelines.judging import comparison
from pipelines.judging.verdict import KEY_NUMBERS, check_row
from tests.handmade import correctness as answers_of
from tests.handmade import memory_row, plans, write_eval_items, write_memory, write_model
from tests.sample_log_helpers import COMPARE, DOMAINS, edited_log, from_log, refusal, rewrite_line, samples_file


def test_a_log_of_the_baseline_pairs_item_for_item_with_the_pipelines_own_records(log_evidence):
    summary, items = from_log(log_evidence, log_evidence["logs"]["fp16"])
    base_result, base_items = log_evidence["base"]
    for domain in DOMAINS:
        mine, theirs = by_id(items, domain), by_id(base_items, domain)
        assert list(mine) and set(mine) <= set(theirs)
        for item, record in mine.items():  # the same item, prompt, answer and score, from another process
            assert record == {k: theirs[item][k] for k in record}, item
        assert summary[domain]["task_version"] == base_result["probes"][domain]["task_version"]


def test_a_log_gives_the_verdict_rows_of_the_pipelines_own_evaluation(log_evidence):
    """int8 evaluated here and int8's lm-eval log: the same records, so the same paired numbers and verdict; the log's
    row leaves KL to a declaration (inconclusive without one). A multiple-choice row whose every response equals
    fp16's (the tiny model's int8 on chat, its log-likelihoods the same to float16's last digit) cannot be told from
    fp16's own log without distributions: the log fails, naming that, whatever is declared."""
    summary, items = from_log(log_evidence, log_evidence["logs"]["int8"])
    in_process_result, in_process_items = log_evidence["int8"]
    base_items = log_evidence["base"][1]
    for domain in DOMAINS:
        ours = by_id(in_process_items, domain)
        assert by_id(items, domain) == ours  # exactly the items the looks needed, each as evaluate wrote it
        assert summary[domain]["items"] == in_process_result["probes"][domain]["items"]
        policy = COMPARE.policy_for(domain)
        mem = {"growth_excess_pct": 0.0}
        args = (by_id(base_items, domain), ours, in_process_result["probes"][domain])
        here = comparison.compare_domain(*args, in_process_result["fidelity"][domain], mem, log_evidence["plan"][domain],
                                         policy, COMPARE)
        log_args = (by_id(base_items, domain), by_id(items, domain), summary[domain])
        base = by_id(base_items, domain)
        as_fp16 = (all(base[i]["response"] == r["response"] for i, r in ours.items())
                   and any(r["chance"] for r in ours.values()))
        for declared, expected in (([], "inconclusive" if here["verdict"] == "pass" else here["verdict"]),
                                   (["fidelity"], here["verdict"])):
            expected = "fail" if as_fp16 else expected
            not_here = {"fidelity": {"reason": "a log", "judged_elsewhere": "fidelity" in declared}}
            logged = comparison.compare_domain(*log_args, None, mem, log_evidence["plan"][domain], policy, COMPARE,
                                               None, not_here)
            assert {k: logged["paired"][k] for k in KEY_NUMBERS} == {k: here["paired"][k] for k in KEY_NUMBERS}
            assert logged["verdict"] == expected, (domain, declared, logged["reasons"], here["reasons"])
            assert as_fp16 == any("the log is fp16's own run" in r for r in logged["reasons"]), logged["reasons"]


def test_logs_that_do_not_pair_are_refused_naming_file_and_line(log_evidence):
    def other_prompt(line):
        record = json.loads(line)
        record["prompt_hash"] = "0" * 64  # as a chat template or another few-shot seed would make it
        return json.dumps(record)

    folder = edited_log(log_evidence, "prompt", lambda d: rewrite_line(samples_file(d, "quantgate_math"), 2, other_prompt))
    assert re.search(r"samples_quantgate_math_.*\.jsonl:2: item .* prompt_hash differs", refusal(log_evidence, folder, "math"))

    folder = edited_log(log_evidence, "truncated", lambda d: samples_file(d, "quantgate_chat").write_text(
        samples_file(d, "quantgate_chat").read_text()[:-40]))
    with pytest.raises(QuantgateError, match=r"samples_quantgate_chat_.*\.jsonl:\d+: not a JSON record .*truncated"):
        sample_logs.read_log(folder)

    def version(d):
        results = next(d.glob("results_*.json"))
        data = json.loads(results.read_text())
        data["versions"]["quantgate_math"] = 2.0
        results.write_text(json.dumps(data))

    assert re.search(r"results_.*\.json: versions.quantgate_math is 2.0, fp16 .* 1.0",
                     refusal(log_evidence, edited_log(log_evidence, "version", version), "math"))

    def fewer(d):  # the first look's items not all there: an evaluation stopped early, or another --limit
        path = samples_file(d, "quantgate_chat")
        path.write_text("\n".join(path.read_text().splitlines()[1:]) + "\n")

    assert re.search(r"samples_quantgate_chat_.*: look \d of row chat needs the pool's first \d items .* lacks 1",
                     refusal(log_evidence, edited_log(log_evidence, "fewer", fewer), "chat"))

    def second_run(d):
        results = next(d.glob("results_*.json"))
        shutil.copyfile(results, d / "results_2020-01-01T00-00-00.000001.json")

    with pytest.raises(QuantgateError, match=r"2 lm-eval runs"):
        sample_logs.read_log(edited_log(log_evidence, "two", second_run))

    def sampled(d):
        results = next(d.glob("results_*.json"))
        data = json.loads(results.read_text())
        data["config"]["gen_kwargs"] = {"temperature": 0.7, "do_sample": True}
        results.write_text(json.dumps(data))

    with pytest.raises(QuantgateError, match=r"gen_kwargs"):
        sample_logs.read_log(edited_log(log_evidence, "sampled", sampled))

    def cached(d):
        results = next(d.glob("results_*.json"))
        data = json.loads(results.read_text())
        data["config"]["use_cache"] = "/tmp/lm_cache"
        results.write_text(json.dumps(data))

    with pytest.raises(QuantgateError, match=r"use_cache .* another model's"):
        sample_logs.read_log(edited_log(log_evidence, "cached", cached))

    def not_utf8(d):
        path = samples_file(d, "quantgate_math")
        path.write_bytes(path.read_bytes().replace(b'"doc_id"', b'"doc\xff_id"', 1))

    with pytest.raises(QuantgateError, match=r"samples_quantgate_math_.*\.jsonl:1: not UTF-8"):
        sample_logs.read_log(edited_log(log_evidence, "bytes", not_utf8))
    with pytest.raises(QuantgateError, match=r"samples_quantgate_chat_.*\.jsonl: no records \(an empty samples file\)"):
        sample_logs.read_log(edited_log(log_evidence, "empty", lambda d: samples_file(d, "quantgate_chat").write_text("")))


def test_a_row_that_does_not_pair_is_that_rows_refusal_and_an_edited_score_is_caught(log_evidence):
    """A missing task refuses its row only; a score edited in the log (the response kept) is scored again here."""
    summary, items = from_log(log_evidence, edited_log(log_evidence, "no-math",
                                                   lambda d: samples_file(d, "quantgate_math").unlink()))
    assert summary["math"]["status"] == "refused" and "no samples_quantgate_math_<date>.jsonl" in summary["math"]["reason"]
    assert summary["chat"]["status"] == "ok" and by_id(items, "chat")

    base_items = by_id(log_evidence["base"][1], "math")
    wrong = next(i for i, r in base_items.items() if not r["correct"])  # an item fp16 gets wrong: the log claims right

    def edit(d):
        path = samples_file(d, "quantgate_math")
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            record = json.loads(line)
            if str(record["doc"]["id"]) == wrong:
                record["exact_match"] = 1.0
                lines[n] = json.dumps(record, ensure_ascii=False)
        path.write_text("\n".join(lines) + "\n")

    summary, _ = from_log(log_evidence, edited_log(log_evidence, "rescored", edit))
    assert summary["math"]["status"] == "refused"
    assert f"item {wrong}: the log scores it exact_match 1.0, the task here scores its response 0.0" in \
        summary["math"]["reason"], summary["math"]["reason"]


def test_a_log_of_fp16s_own_run_is_not_a_candidate(log_evidence):
    """fp16's log as a candidate: every answer and multiple-choice log-likelihood equal to fp16's own fails."""
    summary, items = from_log(log_evidence, log_evidence["logs"]["fp16"])
    base_items = log_evidence["base"][1]
    not_here = {"fidelity": {"reason": "a log", "judged_elsewhere": True}}
    row = comparison.compare_domain(by_id(base_items, "chat"), by_id(items, "chat"), summary["chat"], None,
                                    {"growth_excess_pct": 0.0}, log_evidence["plan"]["chat"], COMPARE.policy_for("chat"),
                                    COMPARE, None, not_here)
    assert row["identical_to_fp16"] and row["verdict"] == "fail"
    assert any("the log is fp16's own run" in r for r in row["reasons"])


def test_admit_copies_a_good_log_with_its_hashes_and_refuses_a_bad_one(log_evidence, tmp_path):
    manifest = sample_logs.admit("vendor-log", str(log_evidence["logs"]["int8"]), tmp_path)
    assert manifest["status"] == "ok" and manifest["evidence"]["backend"] == "hf"
    copied = tmp_path / "vendor-log" / sample_logs.LOG_DIR
    assert sorted(manifest["files"]) == sorted(p.name for p in copied.iterdir())
    assert read_json(tmp_path / "vendor-log" / "quantgate.json")["source"] == "samples"

    bad = edited_log(log_evidence, "bad", lambda d: samples_file(d, "quantgate_math").write_text("{not json\n"))
    refused = sample_logs.admit("vendor-bad", str(bad), tmp_path)
    assert refused["status"] == "failed"
    assert ":1: not a JSON record" in refused["reasons"][0]
    assert (tmp_path / "vendor-bad" / "quantgate.json").is_file()  # the refusal is recorded, the stage goes on


# ---- compare and gate on a log candidate (hand-made records: no model needed)
N = 400


def log_candidate(root: Path, name: str, memory_status: str = "not_measured") -> dict | None:
    """A log candidate as admit, memory and evaluate leave it: no fidelity, memory not measured."""
    write_model(root, name, {d: answers_of(N, 300) for d in ("math", "code")}, kind="candidate")
    manifest = read_json(root / "models/variants" / name / "quantgate.json")
    write_json(root / "models/variants" / name / "quantgate.json",
               {**manifest, "source": "samples", "method": "samples", "evidence": {"backend": "vllm"}})
    result = read_json(root / "results/eval" / f"{name}.json")
    write_json(root / "results/eval" / f"{name}.json", {**result, "fidelity": None})
    return {"status": memory_status, "reason": "an lm-eval sample log: no model here"} if memory_status else None


@pytest.mark.parametrize("declared, verdict", [([], "inconclusive"), (["fidelity"], "inconclusive"),
                                               (["fidelity", "memory"], "pass")])
def test_what_a_log_cannot_measure_is_inconclusive_until_declared_judged_elsewhere(tmp_path, declared, verdict):
    write_model(tmp_path, "fp16", {d: answers_of(N, 300) for d in ("math", "code")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    write_memory(tmp_path, {"fp16": memory_row("fp16"), "vendor-log": log_candidate(tmp_path, "vendor-log")})
    report = comparison.compare_all(["fp16"], ["vendor-log"], plans(tmp_path), COMPARE, tmp_path / "results",
                                    tmp_path / "models/variants", {"vendor-log": declared})
    row = report["variants"]["vendor-log"]
    assert row["evidence"] == {"backend": "vllm"}
    for domain in ("math", "code"):
        d = row["domains"][domain]
        assert d["verdict"] == verdict, d["reasons"]
        assert set(d["not_checked_here"]) == {"fidelity", "memory"}
        said = " ".join(d["reasons"])
        for check in ("KL", "memory growth"):
            assert f"{check} not measured here" in said  # said either way: open, or judged elsewhere
        gate_verdict, why = check_row("vendor-log", domain, d, _params({"vendor-log": declared}))
        assert gate_verdict == {"pass": "pass", "inconclusive": "undecided"}[verdict]
        assert any("not measured here" in line for line in why)


def test_only_a_log_candidate_may_leave_memory_unmeasured(tmp_path):
    """A checkpoint variant whose memory record says `not_measured` (or whose evaluation has no KL) still fails."""
    write_model(tmp_path, "fp16", {d: answers_of(N, 300) for d in ("math", "code")})
    write_model(tmp_path, "int8", {d: answers_of(N, 300) for d in ("math", "code")})
    write_eval_items(tmp_path, {"math": N, "code": N})
    write_memory(tmp_path, {"fp16": memory_row("fp16"), "int8": {"status": "not_measured", "reason": "edited"}})
    report = comparison.compare_all(["fp16", "int8"], [], plans(tmp_path), COMPARE, tmp_path / "results",
                                    tmp_path / "models/variants", {"int8": ["memory", "fidelity"]})
    assert report["variants"]["int8"]["verdict"] == "fail"
    assert "no memory results" in report["variants"]["int8"]["domains"]["math"]["reasons"]


def test_judged_elsewhere_is_only_for_logs():
    from pydantic import ValidationError

    from pipelines.core.params_candidates import CandidateParams

    with pytest.raises(ValidationError, match="only a candidate evaluated elsewhere"):
        CandidateParams(path="ckpt", judged_elsewhere=["memory"])
    with pytest.raises(ValidationError, match="listed twice"):
        CandidateParams(path="logs", source="samples", judged_elsewhere=["memory", "memory"])
    assert CandidateParams(path="logs", source="samples", judged_elsewhere=["memory"]).judged_elsewhere == ["memory"]


def _params(judged: dict[str, list[str]]):
    from pipelines.core.params import Params

    return Params(candidates={n: {"path": "logs", "source": "samples", "judged_elsewhere": j} for n, j in judged.items()})


def test_doc_hash_is_the_one_the_real_lm_eval_logs_beside_each_doc(log_evidence):
    rows = [json.loads(line) for path in sorted(Path(log_evidence["logs"]["int8"]).rglob("samples_*.jsonl"))
            for line in path.read_text().splitlines()]
    assert len(rows) > 20 and all(log_records.doc_hash(row["doc"]) == row["doc_hash"] for row in rows)
    assert log_records.doc_hash({**rows[0]["doc"], "edited": 1}) != rows[0]["doc_hash"]
