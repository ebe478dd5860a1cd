"""Candidates behind an OpenAI-compatible endpoint (pipelines/evaluation/endpoints.py), against a real server: llama.cpp
through llama-cpp-python's server, serving GGUFs of the tests' tiny model (tests/llama_server.py). The same weights
evaluated in-process and through the server give the same per-item answers; a quantized GGUF behind a key is judged
like any candidate; a server that is down, unlisted or keyless is a recorded failure naming the URL, never a hang."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelines.core.params_candidates import CandidateParams
from pipelines.core.params_sections import CompareParams, EvaluateParams
from pipelines.diagnose.tools import endpoint_check
from pipelines.evaluation import endpoints, harness
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
    manifest, result, items = evaluate(served, "tiny-q8", served["q8"], tmp_path)
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
