"""Candidates behind an OpenAI-compatible endpoint (pipelines/evaluation/endpoints.py), against a real server: llama.cpp
through llama-cpp-python's server, serving GGUFs of the tests' tiny model (tests/llama_server.py). The same weights
evaluated in-process and through the server give the same per-item answers; a quantized GGUF behind a key is judged
like any candidate; a server that is down, unlisted or keyless is a recorded failure naming the URL, never a hang."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelines.core.errors import QuantgateError
from pipelines.core.params import Params
from pipelines.core.params_candidates import BaselineParams, CandidateParams
from pipelines.core.params_sections import CompareParams, EvaluateParams
from pipelines.diagnose.tools import endpoint_check
from pipelines.evaluation import baseline_log, endpoints, harness, redeploy, sample_logs
from pipelines.evaluation.plans import by_id, probe_plans
from pipelines.judging import comparison
from tests.llama_server import free_port, serving, write_gguf

P = EvaluateParams(look_items=4, max_items=8, batch_size=8, fidelity_texts=4)
DOMAINS = ["math", "chat", "code_comment"]  # generation (exact match) and multiple choice (prompt logprobs)
GENERATED = ["math", "code_comment"]
COMPARE = CompareParams()
KEY = "QG_TEST_ENDPOINT_KEY"
GREEDY = {"repeat_penalty": 1.0}  # llama-cpp-python's server penalizes repeats (1.1) even at temperature 0
EVAL = Path(__file__).resolve().parents[1] / "eval"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_variants):
    """fp16's weights as an F32 GGUF and as llama.cpp's Q8_0 (behind a key), each on its own llama.cpp server; fp16
    evaluated in-process on the same plan."""
    tmp = tmp_path_factory.mktemp("endpoints")
    f32 = write_gguf(tiny_variants["fp16"], tmp / "tiny.F32.gguf", "F32")
    q8 = write_gguf(tiny_variants["fp16"], tmp / "tiny.Q8_0.gguf", "Q8_0")
    plan = probe_plans(DOMAINS, P)
    base = harness.evaluate_variant(str(tiny_variants["fp16"]), plan, P, "cpu", tmp / "base.st")
    with serving(f32, "tiny-f32", tmp / "f32.log") as f32_url, \
            serving(q8, "tiny-q8", tmp / "q8.log", api_key="s3cret-test-key") as q8_url:
        yield {"tmp": tmp, "plan": plan, "base": base, "model": tiny_variants["fp16"],
               "f32": {"base_url": f32_url, "model": "tiny-f32", "timeout_s": 30, "max_retries": 1,
                       "request_fields": GREEDY},
               "q8": {"base_url": q8_url, "model": "tiny-q8", "api_key_env": KEY, "timeout_s": 30, "max_retries": 1,
                      "request_fields": GREEDY}}


def evaluate(served, name, endpoint, tmp_path):
    manifest = endpoints.admit(name, "tiny.gguf", endpoint, tmp_path / "variants", served["model"])
    base_result, base_items = served["base"]
    result, items = endpoints.evaluate(name, tmp_path / "variants" / name, served["plan"], base_items, base_result,
                                       COMPARE, False, tmp_path / "eval" / name / "samples", served["model"], EVAL,
                                       600)
    return manifest, result, items


def test_the_same_weights_served_by_llama_cpp_answer_as_they_do_in_process(served, tmp_path):
    """Greedy generation: the same answer, item for item. Multiple choice: refused, because llama-cpp-python's echo
    leaves out the generated token that lm-eval drops as the last (and shifts the rest by a token,
    abetlen/llama-cpp-python#1983): admit's check catches it."""
    manifest, result, items = evaluate(served, "tiny-f32", served["f32"], tmp_path)
    assert manifest["status"] == "ok" and manifest["evidence"]["logprobs"] is False
    said = re.search(r"echo returned (\d+) logprobs for \1 prompt and 1 generated tokens",
                     manifest["evidence"]["logprobs_problem"])
    assert said, manifest["evidence"]["logprobs_problem"]
    assert result["status"] == "ok", result.get("error")
    assert result["probes"]["chat"]["status"] == "refused" and said.group(0) in result["probes"]["chat"]["reason"]
    base_items = served["base"][1]
    for domain in GENERATED:
        assert result["probes"][domain]["status"] == "ok", result["probes"][domain]
        mine, theirs = by_id(items, domain), by_id(base_items, domain)
        assert list(mine) and set(mine) <= set(theirs)
        for item, record in mine.items():  # greedy text, item for item, from another engine
            assert (record["response"], record["correct"]) == (theirs[item]["response"], theirs[item]["correct"]), \
                (domain, item)
            assert (record["doc_hash"], record["prompt_hash"]) == (theirs[item]["doc_hash"], theirs[item]["prompt_hash"])
    # the log lm-eval wrote against the server is kept beside the records, one samples file per task
    assert sorted(p.name.split("_2")[0] for p in (tmp_path / "eval" / "tiny-f32" / "samples").iterdir()) \
        == ["results", "samples_quantgate_code_comment", "samples_quantgate_math"]


MBPP = [("Write a function to add two numbers.", "def add(a, b):\n    return a + b", "add", [(1, 2, 3), (2, 2, 4), (0, 5, 5)]),
        ("Write a function to multiply two numbers.", "def mul(a, b):\n    return a * b", "mul",
         [(2, 3, 6), (1, 4, 4), (0, 9, 0)]),
        ("Write a function to subtract two numbers.", "def sub(a, b):\n    return a - b", "sub",
         [(5, 2, 3), (2, 2, 0), (9, 1, 8)])]


@pytest.mark.parametrize("domain, task", [("math", "gsm8k"), ("code", "mbpp")])
def test_a_standard_task_goes_through_the_server_with_the_settings_fp16_ran_here(served, gsm8k_files, tmp_path,
                                                                                  domain, task):
    """gsm8k and mbpp from local files, 0-shot, as `requests.<name>.tasks` declares them: lm-eval runs quantgate's own
    config of each against the server (a YAML file with its functions named by module; mbpp scored by quantgate's
    sandbox in lm-eval's process, then again here), and the answers are fp16's in-process ones, item for item."""
    from pipelines.core.io import write_jsonl

    files = gsm8k_files
    if task == "mbpp":
        files = {"test": str(tmp_path / "mbpp.jsonl")}
        write_jsonl(tmp_path / "mbpp.jsonl", [
            {"task_id": n, "text": text, "code": code, "test_setup_code": "", "challenge_test_list": [],
             "test_list": [f"assert {name}({a}, {b}) == {c}" for a, b, c in cases]}
            for n, (text, code, name, cases) in enumerate(MBPP)])
    tasks = EvaluateParams.model_validate({"tasks": {domain: [{"name": task, "data_files": files,
                                                                "num_fewshot": 0}]}}).tasks
    params = P.model_copy(update={"domains": [domain], "tasks": tasks})
    plans = {row: plan for row, plan in probe_plans([domain], params).items() if "spec" in plan}
    base, base_items = harness.evaluate_variant(str(served["model"]), plans, params, "cpu", tmp_path / "base.st")
    endpoints.admit("tiny-f32", "tiny.gguf", served["f32"], tmp_path / "variants", served["model"])
    result, items = endpoints.evaluate("tiny-f32", tmp_path / "variants" / "tiny-f32", plans, base_items, base,
                                       COMPARE, False, tmp_path / "log", served["model"], EVAL, 600)
    row = f"{domain}:{task}"
    assert result["status"] == "ok" and result["probes"][row]["status"] == "ok", result
    mine, theirs = by_id(items, row), by_id(base_items, row)
    assert list(mine) and set(mine) <= set(theirs)
    for item, record in mine.items():
        assert (record["response"], record["correct"], record["prompt_hash"]) == \
            (theirs[item]["response"], theirs[item]["correct"], theirs[item]["prompt_hash"]), item
    if task == "mbpp":  # its log carries quantgate's scorer; without that mark, or with a score edited, it is refused
        for edit, said in ((lambda text: text.replace('"sandbox": true', '"sandbox": false'), "in its own sandbox"),
                           (lambda text: text.replace('"pass@1": 0.0', '"pass@1": 1.0', 1), "scores its response")):
            log = tmp_path / f"edited-{len(said)}"
            shutil.copytree(tmp_path / "log", log)
            edited = next(log.glob("results_*.json") if "sandbox" in said else log.glob("samples_mbpp_*.jsonl"))
            edited.write_text(edit(edited.read_text()))
            again, _ = sample_logs.records(sample_logs.read_log(log, GREEDY), plans, base_items, base, COMPARE.policy_for,
                                           COMPARE)
            assert again[row]["status"] == "refused" and said in again[row]["reason"], again[row]


def test_where_they_differ_is_the_servers_default_repeat_penalty(served, tmp_path):
    """Without repeat_penalty: 1.0, llama-cpp-python's server penalizes tokens already generated even at temperature 0:
    the tiny model's near-tied generations ("1111..." vs "1 111...") change."""
    _, result, items = evaluate(served, "tiny-f32", {k: v for k, v in served["f32"].items() if k != "request_fields"},
                                tmp_path)
    base_items = served["base"][1]
    differ = {d: [i for i, r in by_id(items, d).items() if r["response"] != by_id(base_items, d)[i]["response"]]
              for d in GENERATED}
    assert differ["math"], "the tiny model's repeated digits are where the penalty shows"
    for item in differ["math"]:
        here = by_id(base_items, "math")[item]["response"]
        assert len(set(here.replace(" ", ""))) <= 2, here  # a run of one repeated token, penalized on the server


def test_a_quantized_gguf_behind_a_key_is_judged_like_any_candidate(served, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY, raising=False)
    refused = endpoints.admit("tiny-q8", "tiny.gguf", served["q8"], tmp_path / "variants")
    assert refused["status"] == "failed" and KEY in refused["reasons"][0]  # the variable named, never a value
    monkeypatch.setenv(KEY, "wrong")
    assert "HTTP 401" in endpoints.check(served["q8"])["problem"]
    monkeypatch.setenv(KEY, "s3cret-test-key")
    # an engine knob whose string holds a comma and an "=" reaches lm-eval whole (one JSON --gen_kwargs value)
    noted = {**served["q8"], "request_fields": {**GREEDY, "x_note": "a,b=c"}}
    manifest, result, items = evaluate(served, "tiny-q8", noted, tmp_path)
    assert manifest["status"] == "ok"
    # what lm-eval prints of a failed request (aiohttp's error with its headers) reaches the report with no key in it
    said = endpoints.scrubbed("ClientResponseError(headers={'Authorization': 'Bearer s3cret-test-key'}) s3cret-test-key",
                              served["q8"])
    assert "s3cret" not in said and said.count("<redacted>") == 2
    assert result["status"] == "ok" and all(result["probes"][d]["status"] == "ok" for d in GENERATED)
    base_items = served["base"][1]
    for domain in GENERATED:
        mine = by_id(items, domain)
        assert 0 < len(mine) <= served["plan"][domain]["looks"][-1]
        not_here = {"fidelity": {"reason": "an endpoint", "judged_elsewhere": True}}
        row = comparison.compare_domain(by_id(base_items, domain), mine, result["probes"][domain], None,
                                        {"growth_excess_pct": 0.0}, served["plan"][domain], COMPARE.policy_for(domain),
                                        COMPARE, None, not_here)
        assert row["paired"]["items"] == len(mine) and row["looks"]["look"] >= 1, row


def test_the_shadow_replay_through_the_server_matches_the_in_process_replay(served):
    from transformers import AutoTokenizer

    from pipelines.replay.engine import replay

    tok = AutoTokenizer.from_pretrained(served["model"])
    prompts = ["def add(a, b):\n    # add two numbers", "12 + 30 =", "User: hello\nAssistant:"]
    ids = [[tok(p, add_special_tokens=True)["input_ids"]] for p in prompts]
    here = replay(str(served["model"]), ids, 12, "cpu", 1, None)
    there = endpoints.replay(served["f32"], prompts, 12)
    assert [tok.decode(a, skip_special_tokens=True) for a in here["answers"]] == there["texts"]
    assert len(there["latency_s"]) == len(prompts) and all(s > 0 for s in there["latency_s"])


def test_a_server_that_is_down_or_does_not_list_the_model_is_a_recorded_failure(served, tmp_path):
    dead = {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "x", "timeout_s": 5, "max_retries": 1}
    assert "unreachable" in endpoints.check(dead)["problem"]
    unlisted = {**served["f32"], "model": "not-served"}
    assert "lists ['tiny-f32'], not 'not-served'" in endpoints.check(unlisted)["problem"]
    assert endpoint_check("vendor", dead).status == "fail"
    assert endpoint_check("vendor", served["f32"]).status == "warn"  # serves, but its prompt logprobs are shifted
    # admitted while it was up, down when evaluate runs: that candidate's failure, in seconds
    endpoints.admit("gone", "tiny.gguf", served["f32"], tmp_path / "variants")
    manifest = tmp_path / "variants" / "gone" / "quantgate.json"
    manifest.write_text(manifest.read_text().replace(served["f32"]["base_url"], dead["base_url"]))
    started = time.monotonic()
    base_result, base_items = served["base"]
    result, items = endpoints.evaluate("gone", tmp_path / "variants" / "gone", served["plan"], base_items,
                                       base_result, COMPARE, False, tmp_path / "gone-log", served["model"], EVAL,
                                       120)
    assert result["status"] == "failed" and dead["base_url"] in result["error"] and items == []
    assert "ran past" not in result["error"] and time.monotonic() - started < 120  # lm-eval gave up, not the timeout
    with pytest.raises(Exception, match="unreachable"):
        endpoints.replay(dead, ["1 + 1 ="], 4)


def test_fp16s_baseline_through_its_endpoint_is_the_baseline_fp16_gives_here(served, tmp_path):
    """baseline.source: endpoint, through the stage's own writing (pipelines/baseline.py): fp16 served by llama.cpp
    answers every look's item as fp16 in-process does, the multiple-choice row is refused with the server's logprob
    problem, the log lm-eval wrote is kept, no distributions file is left, and KL is not measured for a variant
    evaluated here (inconclusive, never a pass); a server that is down stops the stage, naming it."""
    import contextlib

    from pipelines import baseline
    from pipelines.core.io import read_json, read_jsonl
    from pipelines.core.paths import BASELINE_RESULTS, FIDELITY_BASE
    from pipelines.evaluation.baseline_log import NO_DISTRIBUTIONS_SERVED

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "reference").symlink_to(served["model"])
    (tmp_path / "eval").symlink_to(EVAL)
    spec = tmp_path / "deploy-fp16.yaml"
    spec.write_text("image: llama-cpp-python 0.3.36\nmodel: tiny.F32.gguf\n")
    params = BaselineParams(source="endpoint", path=str(spec), endpoint=served["f32"])
    with contextlib.chdir(tmp_path):
        FIDELITY_BASE.parent.mkdir(parents=True)
        FIDELITY_BASE.write_bytes(b"an earlier run's")
        assert baseline._from_log(params, served["plan"], P) == 0
        assert not FIDELITY_BASE.exists()
        result, items = read_json(BASELINE_RESULTS / "eval.json"), read_jsonl(BASELINE_RESULTS / "items.jsonl")
        copied = sorted(p.name.split("_2")[0] for p in (BASELINE_RESULTS / "samples").iterdir())
        assert redeploy.stale_endpoints(Params(baseline=params.model_dump()), []) == []  # the gate's ask: fp16 still served
        recorded = read_json(BASELINE_RESULTS / "eval.json")
        (BASELINE_RESULTS / "eval.json").write_text(json.dumps({**recorded, "evidence": {}}))  # made before fingerprints
        assert "baseline fp16: no fingerprint of" in redeploy.stale_endpoints(Params(baseline=params.model_dump()), [])[0]
        down = params.model_copy(update={"endpoint": params.endpoint.model_copy(
            update={"base_url": f"http://127.0.0.1:{free_port()}/v1"})})
        with pytest.raises(QuantgateError, match=r"fp16's endpoint http://127.0.0.1:\d+/v1 \(tiny-f32\): .*unreachable"):
            baseline._from_log(down, served["plan"], P)
    assert result["baseline"] == {"source": "endpoint", "path": str(spec), "base_url": served["f32"]["base_url"],
                                  "model": "tiny-f32"}
    assert result["not_measured"]["fidelity"] == NO_DISTRIBUTIONS_SERVED and result["evidence"]["listed"] == ["tiny-f32"]
    assert copied == ["results", "samples_quantgate_code_comment", "samples_quantgate_math"]
    assert result["probes"]["chat"]["status"] == "refused"
    assert "fp16's endpoint cannot give this row: scored by log-likelihood" in result["probes"]["chat"]["reason"]
    here = served["base"][1]
    for domain in GENERATED:  # every item the looks can ask, answered as fp16 answers it in-process
        mine, theirs = by_id(items, domain), by_id(here, domain)
        assert len(mine) == served["plan"][domain]["looks"][-1] and set(mine) == set(theirs)
        for item, record in mine.items():
            assert (record["response"], record["correct"], record["doc_hash"], record["prompt_hash"]) == \
                (theirs[item]["response"], theirs[item]["correct"], theirs[item]["doc_hash"], theirs[item]["prompt_hash"])
    assert baseline_log.unpaired_rows([r for r in here if r["domain"] in GENERATED], items) == {}
    kl = comparison.not_checked_here({"manifest": {"source": "here"}}, None, [], result)["fidelity"]
    assert kl["reason"] == NO_DISTRIBUTIONS_SERVED and "fp16 evaluated here" in kl["remedy"]


def test_a_redeploy_behind_the_same_address_and_name_makes_the_gate_undecided(served, tmp_path):
    """DVC hashes a served candidate's deployment spec, not its server: other weights behind the same URL and model
    name leave every stage up to date. admit records the server's fingerprint and the gate asks again: the same
    server answers the same; the same model re-quantized to Q8_0 on the same port under the same name (its greedy
    answers to the probes unchanged on this tiny model) is named by its logprobs, and another model by its answers; a
    server that is gone cannot vouch for the evidence; each is undecided, never a pass."""
    from pipelines.gate import decide

    other = write_gguf(served["model"], tmp_path / "other.F32.gguf", "F32", noise=1.5)  # 0.5 kept its greedy answers
    port = free_port()
    endpoint = {"base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny", "timeout_s": 30, "max_retries": 1,
                "request_fields": GREEDY}
    params = Params(candidates={"vendor": {"path": "deploy.yaml", "source": "endpoint", "endpoint": endpoint}})
    with serving(served["tmp"] / "tiny.F32.gguf", "tiny", tmp_path / "first.log", port=port):
        manifest = endpoints.admit("vendor", "deploy.yaml", endpoint, tmp_path / "models" / "variants", served["model"])
        assert manifest["status"] == "ok" and len(manifest["evidence"]["fingerprint"]["greedy"]) == 3
        assert redeploy.stale_endpoints(params, ["vendor"], tmp_path) == []  # asked again: the same answers
    with serving(served["tmp"] / "tiny.Q8_0.gguf", "tiny", tmp_path / "second.log", port=port):
        requantized = redeploy.stale_endpoints(params, ["vendor"], tmp_path)
    with serving(other, "tiny", tmp_path / "third.log", port=port):
        swapped = redeploy.stale_endpoints(params, ["vendor"], tmp_path)
    with serving(write_gguf(served["model"], tmp_path / "tiny.F16.gguf", "F16"), "tiny", tmp_path / "f16.log", port=port):
        rebuilt = redeploy.stale_endpoints(params, ["vendor"], tmp_path)
    assert rebuilt == []  # what the tolerance misses (docs/evaluate.md): F16 moves the logprobs by < 0.0002 nats
    assert len(requantized) == 1 and "candidate vendor: " in requantized[0] and "now serves another" in requantized[0]
    assert " -> " not in requantized[0] and re.search(r"logprobs of its greedy answer to .* moved by 0\.00\d+ nats",
                                                       requantized[0]), requantized[0]  # the same text, other numbers
    assert re.search(r"greedy answer to '.*': '.*' -> '", swapped[0]) and "dvc repro -f -s admit@vendor" in swapped[0]
    gone = redeploy.stale_endpoints(params, ["vendor"], tmp_path)
    assert len(gone) == 1 and "cannot check that" in gone[0] and "unreachable" in gone[0]
    assert redeploy.stale_endpoints(params, [], tmp_path) == []  # not gated: not asked
    said = decide(None, None, params, [], None, ["vendor"], served=swapped)
    assert said["verdict"] == "undecided" and said["reasons"][1] == f"  {swapped[0]}"


def test_endpoint_params_refuse_a_key_in_params_and_a_missing_address():
    ok = CandidateParams(path="deploy.yaml", source="endpoint",
                         endpoint={"base_url": "http://10.0.0.5:8000/v1/", "model": "m", "api_key_env": "VLLM_KEY"})
    assert ok.endpoint.base_url == "http://10.0.0.5:8000/v1"
    for bad, said in [({"path": "d", "source": "endpoint"}, "source endpoint needs endpoint"),
                      ({"path": "d", "endpoint": {"base_url": "http://h/v1", "model": "m"}}, "only it takes one"),
                      ({"path": "d", "source": "endpoint", "endpoint": {"base_url": "h:8000", "model": "m"}},
                       "not an http(s) URL"),
                      ({"path": "d", "source": "endpoint", "endpoint": {"base_url": "http://u:key@h/v1", "model": "m"}},
                       "without credentials"),
                      ({"path": "d", "source": "endpoint",
                        "endpoint": {"base_url": "http://h/v1", "model": "m", "request_fields": {"Temperature": 1}}},
                       "only an engine's own knobs"),
                      ({"path": "d", "source": "endpoint",
                        "endpoint": {"base_url": "http://h/v1", "model": "m", "api_key_env": "sk-abc123"}},
                       "the key itself never goes in")]:
        with pytest.raises(ValidationError, match=re.escape(said)):
            CandidateParams(**bad)


def test_a_dead_address_or_a_missing_key_is_the_checks_problem_and_a_key_never_shows(monkeypatch):
    """What admit and the doctor get back without a server (the ones above run against llama.cpp's)."""
    dead = {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m", "timeout_s": 5}
    got = endpoints.check(dead)
    assert got["reachable"] is False and got["problem"].startswith(f"{dead['base_url']}/models: unreachable")
    keyed = {**dead, "api_key_env": "QG_TEST_KEY"}
    monkeypatch.delenv("QG_TEST_KEY", raising=False)
    assert "environment variable QG_TEST_KEY is not set" in endpoints.check(keyed)["problem"]
    monkeypatch.setenv("QG_TEST_KEY", "s3cret")
    said = endpoints.scrubbed("headers={'Authorization': 'Bearer s3cret'} url=http://h/?k=s3cret", keyed)
    assert "s3cret" not in said and said.count("<redacted>") == 2


def test_a_standard_tasks_config_reaches_lm_eval_as_quantgate_built_it(tmp_path):
    """config_files writes each standard task's config as quantgate evaluates it here, and lm-eval's own loader reads
    it back equal, in this process and in a fresh one (as the lm_eval command does), functions included: the
    sandboxed scorer (mbpp), a task's own utils function (hellaswag) and functools.partial (mmlu_pro); a config holding
    a function with no importable name is that row's refusal, never a changed config."""
    from pipelines.evaluation import standard_tasks

    plans = {"code:mbpp": {"domain": "code", "task": "mbpp", "spec": {"name": "mbpp", "num_fewshot": 1}},
             "chat:hellaswag": {"domain": "chat", "task": "hellaswag", "spec": {"name": "hellaswag"}},
             "chat:mmlu_pro_biology": {"domain": "chat", "task": "mmlu_pro_biology",
                                       "spec": {"name": "mmlu_pro_biology"}}}
    configs = harness.task_configs(plans)
    assert isinstance(configs["chat:mmlu_pro_biology"]["process_docs"], functools.partial)
    odd = {**configs["chat:hellaswag"], "task": "odd", "process_docs": lambda docs: docs}
    files, refused = standard_tasks.config_files({**configs, "chat:odd": odd}, tmp_path)
    assert sorted(files) == ["hellaswag", "mbpp", "mmlu_pro_biology"] and list(refused) == ["chat:odd"]
    assert "has no name lm-eval can import it by" in refused["chat:odd"] and "sample log" in refused["chat:odd"]
    assert re.search(r"process_results: !function '?pipelines\.evaluation\.standard_tasks\.mbpp_results",
                     (tmp_path / "mbpp.yaml").read_text())
    fresh = ("import json, sys; from lm_eval.tasks._yaml_loader import load_yaml; print(json.dumps({t: repr("
             "load_yaml(f, resolve_func=True)[k]) for t, f, k in json.loads(sys.argv[1])}))")
    named = {"mbpp": "process_results", "hellaswag": "process_docs", "mmlu_pro_biology": "process_docs"}
    read = json.loads(subprocess.run([sys.executable, "-c", fresh, json.dumps([[t, files[t], k] for t, k in named.items()])],
                                     capture_output=True, text=True, check=True).stdout)
    assert "mbpp_results" in read["mbpp"] and "process_docs" in read["hellaswag"]
    assert re.fullmatch(r"functools\.partial\(<function process_docs at 0x\w+>, subject='biology'\)",
                        read["mmlu_pro_biology"])


def test_rows_that_run_code_are_refused_before_the_run_where_the_sandbox_cannot_isolate(monkeypatch):
    """As in-process (harness.run_probes): a code row through an endpoint is refused by name where the sandbox cannot
    isolate and unisolated runs are not allowed, instead of failing lm-eval's whole run; allowed, it goes."""
    from pipelines.core import sandbox

    plans = probe_plans(["code", "math"], P)
    server = {"base_url": "http://10.0.0.5:8000/v1", "model": "m"}
    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    refused = endpoints.unservable_rows(plans, server, {"logprobs": True}, EVAL, False)
    assert list(refused) == ["code"] and "sandbox cannot isolate here" in refused["code"]
    assert endpoints.unservable_rows(plans, server, {"logprobs": True}, EVAL, True) == {}

