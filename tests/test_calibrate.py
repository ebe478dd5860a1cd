"""Calibration sets and coverage: extraction on real code, determinism, dedup, PII, the classifier, the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipelines import calibrate
from pipelines.core.errors import QuantgateError
from pipelines.core.params import Params
from pipelines.core.params_requests import SourceParams
from pipelines.core.params_sections import CalibrationParams, CoverageParams
from pipelines.text import coverage
from pipelines.text.classify import AMBIGUOUS, UNKNOWN, Classifier
from pipelines.text.code_comments import bare_functions, extract
from pipelines.text.pii import mask

SMALL = {"samples": 64}
classify = Classifier(Params().coverage.classify).classify


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# ---- extraction on real source text -------------------------------------------------------------

HEAPQ = Path("calibration_sets/sources/code/cpython/heapq.py")


def test_comments_come_with_the_code_they_describe():
    samples = extract(HEAPQ.read_text(), "heapq.py")
    by_line = {s.line: s for s in samples}
    # heapq.py line 173: "# Transform bottom-up. ..." above `for i in reversed(range(n//2)):`
    sample = by_line[173]
    assert sample.kind == "comment" and sample.comment.startswith("# Transform bottom-up.")
    assert sample.code.splitlines() == ["for i in reversed(range(n//2)):", "    _siftup(x, i)"]
    doc = next(s for s in samples if s.kind == "docstring" and s.code.startswith("def heappush("))
    assert doc.comment == "Push item onto heap, maintaining the heap invariant."


def test_trivial_comments_are_dropped():
    source = (
        "#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n# Copyright 2024 Someone\n# SPDX-License-Identifier: MIT\n"
        "import os  # noqa: F401\n\n"
        "# pragma: no cover\nx = 1\n\n"
        "# type: ignore\ny = 2\n\n"
        "# Retry the request twice before giving up on the mirror.\nfor attempt in range(2):\n    fetch()\n"
    )
    samples = extract(source, "demo.py")
    assert [s.comment for s in samples] == ["# Retry the request twice before giving up on the mirror."]
    assert samples[0].code == "for attempt in range(2):\n    fetch()"


def test_hash_inside_a_string_is_not_a_comment():
    samples = extract('URL = "http://example.com/#anchor-is-not-a-comment"\nx = 1\n', "s.py")
    assert samples == []


def test_bare_functions_have_no_comments_or_docstrings():
    funcs = bare_functions(HEAPQ.read_text(), "heapq.py")
    assert len(funcs) > 10
    assert not any("#" in f.code or '"""' in f.code for f in funcs)


def test_bad_python_names_file_and_line():
    with pytest.raises(SyntaxError, match=r"broken.py:2"):
        extract("x = 1\ndef f(:\n", "broken.py")


# ---- recipe, determinism, dedup -----------------------------------------------------------------


def test_quotas_split_exactly_and_honour_exclude():
    assert calibrate.quotas(CalibrationParams()) == {"chat": 128, "code": 128, "code_comment": 128, "math": 128}
    r = CalibrationParams(samples=10, exclude=["code_comment"])
    assert calibrate.quotas(r) == {"chat": 4, "code": 3, "math": 3}
    assert sum(calibrate.quotas(CalibrationParams(samples=513)).values()) == 513


def test_unknown_domain_in_exclude_is_refused():
    with pytest.raises(ValueError, match="unknown request type 'comments' in calibration.exclude"):
        CalibrationParams(exclude=["comments"])


def test_same_recipe_gives_byte_identical_sets(tmp_path, tokenizer):
    recipe, cov = CalibrationParams(**SMALL), CoverageParams()
    a = calibrate.run(recipe, cov, tokenizer, "tiny", tmp_path / "a", tmp_path / "ca")
    b = calibrate.run(recipe, cov, tokenizer, "tiny", tmp_path / "b", tmp_path / "cb")
    for name in ("chat", "code", "code_comment", "math", "mixed", "manifest"):
        ext = "json" if name == "manifest" else "jsonl"
        assert (tmp_path / "a" / f"{name}.{ext}").read_bytes() == (tmp_path / "b" / f"{name}.{ext}").read_bytes()
    assert a["calibration_sha256"] == b["calibration_sha256"]
    rows = [json.loads(line) for line in (tmp_path / "a" / "mixed.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and {r["domain"] for r in rows} == {"chat", "code", "code_comment", "math"}
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["domains"]["code"]["count"] == 16
    assert all(16 <= r["tokens"] <= 192 for r in rows)
    assert all(":" in r["source"] for r in rows)


def test_another_seed_gives_another_set(tmp_path, tokenizer):
    a, _, _ = calibrate.build_sets(CalibrationParams(**SMALL, seed=0), tokenizer)
    b, _, _ = calibrate.build_sets(CalibrationParams(**SMALL, seed=1), tokenizer)
    assert [r["text"] for r in a["code"]] != [r["text"] for r in b["code"]]


def test_exact_and_near_duplicates_are_removed(tmp_path, tokenizer):
    base = "Customer: my parcel for order 12345 never arrived, where is it?\nAgent: it ships tomorrow morning."
    rows = [{"text": base}, {"text": base}, {"text": base.replace("12345", "67890")},
            {"text": "Customer: how do I change the e-mail on my account?\nAgent: open settings, then profile."}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = CalibrationParams(samples=2, weights={"chat": 1.0}, min_tokens=1,
                               sources=[SourceParams(domain="chat", kind="jsonl", path=str(path))])
    assert calibrate.jaccard(calibrate.shingles(rows[0]["text"]), calibrate.shingles(rows[2]["text"])) >= 0.8
    sets, _, _ = calibrate.build_sets(recipe, tokenizer)
    texts = [r["text"] for r in sets["chat"]]
    assert len(texts) == 2 and rows[3]["text"] in texts  # the one distinct text, plus one of the three near-copies
    with pytest.raises(QuantgateError, match=r"domain 'chat' needs 3 samples but its sources hold only 2 .*"
                                             r"'out_of_length_bounds': 0, 'exact_duplicates': 1, 'near_duplicates': 1"):
        calibrate.build_sets(recipe.model_copy(update={"samples": 3}), tokenizer)


def test_bad_jsonl_line_is_reported_with_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    recipe = CalibrationParams(samples=1, weights={"chat": 1.0},
                               sources=[SourceParams(domain="chat", kind="jsonl", path=str(path))])
    with pytest.raises(QuantgateError, match=rf"{path}:2: not valid JSON"):
        calibrate.build_sets(recipe, tokenizer)


def test_missing_source_and_empty_domain(tmp_path, tokenizer):
    missing = CalibrationParams(samples=4, sources=[SourceParams(domain="chat", kind="jsonl", path="nope.jsonl")])
    with pytest.raises(QuantgateError, match="nope.jsonl: file not found"):
        calibrate.build_sets(missing, tokenizer)
    # the request types a recipe samples are those its sources give: one source, one type
    only_math = CalibrationParams(samples=4, sources=[SourceParams(domain="math", kind="math", count=10)])
    assert only_math.domains == ["math"]
    with pytest.raises(ValueError, match="unknown request type 'chat'"):
        CalibrationParams(samples=4, weights={"chat": 1.0}, sources=only_math.sources)


def test_failed_build_leaves_previous_output_untouched(tmp_path, tokenizer):
    out = tmp_path / "built"
    calibrate.run(CalibrationParams(**SMALL), CoverageParams(), tokenizer, "tiny", out, tmp_path / "cov")
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert (out / "by_method" / "gptq.jsonl").read_bytes() == (out / "mixed.jsonl").read_bytes()
    assert (out / "by_method" / "none.jsonl").read_bytes() == b""  # fp16 reads no calibration set
    too_many = CalibrationParams(samples=100000)
    with pytest.raises(QuantgateError):
        calibrate.run(too_many, CoverageParams(), tokenizer, "tiny", out, tmp_path / "cov")
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---- PII ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("mail me at jane.doe42@mail.example.org please", "mail me at [EMAIL] please"),
    ("call (415) 555-0199 or +44 20 7946 0958", "call [PHONE] or [PHONE]"),
    ("我的手机号是13812345678。", "我的手机号是[PHONE]。"),
    ("身份证号11010119900307123X。", "身份证号[ID]。"),
    ("SSN 123-45-6789", "SSN [ID]"),
    ("card 4111 1111 1111 1111 ok", "card [CARD] ok"),
])
def test_personal_data_is_masked(text, expected):
    assert mask(text) == expected


@pytest.mark.parametrize("text", ["Where is order 50521?", "12+34=46", "(12+7)×3=57", "订单88435的发票", "√144=12"])
def test_order_numbers_and_arithmetic_are_kept(text):
    assert mask(text) == text


def test_coverage_report_never_writes_unmasked_traffic(tmp_path, tokenizer):
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text(json.dumps({"text": "Refund order 12345 please, I am jane@example.com, 13812345678"}) + "\n"
                       + json.dumps({"text": "What is 12+30?"}) + "\n")
    calibrate.run(CalibrationParams(**SMALL), CoverageParams(traffic=str(traffic)), tokenizer, "tiny",
                  tmp_path / "built", tmp_path / "cov")
    written = "".join(p.read_text(errors="ignore") for p in (tmp_path / "cov").glob("*.json"))
    assert "[EMAIL]" in written and "jane@example.com" not in written and "13812345678" not in written


# ---- the classifier ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, domain", [
    ("Hi, my order 44120 arrived broken. Can I get a refund?", "chat"),
    ("我想取消订单，谢谢", "chat"),
    ("What are your opening hours on Sunday?", "chat"),
    ("What is 3/4 + 1/8?", "math"),
    ("Compute \\frac{2}{3}\\times 9", "math"),
    ("计算 √144 × 3", "math"),
    ("def area(r):\n    return 3.14159 * r * r", "code"),
    ("Why is this slow?\n```python\nfor i in range(n):\n    total = total + items[i]\n```", "code"),
    ("# Keep only the even numbers\nevens = [x for x in xs if x % 2 == 0]", "code_comment"),
    ("Write a docstring for this:\ndef area(r):\n    return 3.14159 * r * r", "code_comment"),
    ("给这段代码加上注释：\ndef f(x):\n    return x * 2", "code_comment"),
])
def test_classifier_on_examples_of_each_domain(text, domain):
    assert classify(text) == domain


def test_classifier_agrees_with_the_traffic_generator_labels():
    sys.path.insert(0, "scripts")
    import make_sources

    from pipelines.text import synthetic
    from pipelines.text.corpus import code_samples

    bare = [s.code for p in sorted(Path("calibration_sets/sources/code").rglob("*.py"))
            for s in bare_functions(p.read_text(), p.name) if 3 <= s.code.count("\n") <= 12]
    commented = [(s.comment, s.code) for s in code_samples() if s.kind == "comment"]
    trained, _ = synthetic.split_commented_cases(0)
    zh = [synthetic.commented_function(*case)[:2] for case in trained[:200]]
    rows = synthetic.traffic_sample(99, 300, bare, commented, zh)
    agree = sum(classify(r["text"]) == r["kind"] for r in rows) / len(rows)
    assert agree >= 0.97
    assert make_sources.traffic_rows() == [json.loads(line) for line in
                                           Path(make_sources.TRAFFIC).read_text().splitlines()]
    assert make_sources.dialogue_rows() == [json.loads(line) for line in
                                            Path(make_sources.DIALOGUES).read_text().splitlines()]
    assert make_sources.zh_function_rows() == [json.loads(line) for line in
                                               Path(make_sources.ZH_FUNCTIONS).read_text().splitlines()]


# ---- the coverage flag -------------------------------------------------------------------------


def test_default_recipe_covers_shipped_traffic(tmp_path, tokenizer):
    report = calibrate.run(CalibrationParams(), CoverageParams(), tokenizer, "tiny", tmp_path / "b", tmp_path / "c")
    assert report["under_represented"] == [] and report["covered"]
    shares = {d: v["production_share"] for d, v in report["domains"].items()}
    assert shares["code_comment"] > 0.1 and abs(sum(shares.values()) + report["unknown"]["production_share"] - 1) < 1e-3
    assert report["unknown"]["production_requests"] == 20 and not report["unknown"]["flagged"]  # JSON, logs, ... (5 %)
    assert (tmp_path / "c" / "coverage.png").stat().st_size > 1000
    # the shipped sample is labelled by its generator: every request counts, and the classifier names all but one
    # right: a code question about shlex.split, whose parameter `comments=False` the code_comment rule's ask words match
    measured = json.loads((tmp_path / "c" / "classifier.json").read_text())
    assert measured == report["classifier"] and measured["labelled_requests"] == report["traffic_requests"] == 420
    assert {t: (v["requests"], v["accuracy"]) for t, v in measured["types"].items()} == {
        "chat": (180, 1.0), "code": (80, 0.9875), "code_comment": (60, 1.0), "math": (80, 1.0), "unknown": (20, 1.0)}
    assert measured["confusion"]["code"]["code_comment"] == 1
    assert report["classifier_flagged"] == [] and report["domains"]["math"]["classifier_accuracy"] == 1.0
    assert (tmp_path / "c" / "classifier_confusion.png").stat().st_size > 1000
    pairs = json.loads((tmp_path / "c" / "classifier_predictions.json").read_text())
    assert len(pairs) == 420 and {"actual": "code", "predicted": "code"} in pairs


def test_leaving_out_code_comments_is_flagged(tmp_path, tokenizer):
    recipe = CalibrationParams(exclude=["code_comment"])
    report = calibrate.run(recipe, CoverageParams(), tokenizer, "tiny", tmp_path / "b", tmp_path / "c")
    assert report["under_represented"] == ["code_comment"]
    row = report["domains"]["code_comment"]
    assert row["calibration_share"] == 0 and row["production_share"] > 0.1 and row["length_js_distance"] == 1.0
    assert not (tmp_path / "b" / "code_comment.jsonl").exists()


# ---- the classifier, measured against the sample's labels ---------------------------------------

FRUIT = {"a": {"patterns": {"x": "apple"}, "when": "x >= 1", "priority": 1},
         "b": {"patterns": {"y": "banana"}, "when": "y >= 1", "priority": 1},
         "c": {"patterns": {"z": "cherry"}, "when": "z >= 1", "priority": 2}}
# (text, label): a is right 2 of 4 (one ambiguous, one unknown), b 2 of 3 (one taken for c), c 1 of 1
LABELLED = [("apple", "a"), ("apple pie", "a"), ("apple banana", "a"), ("kiwi", "a"),
            ("banana", "b"), ("banana split", "b"), ("cherry apple", "b"), ("cherry", "c"),
            ("banana", None), ("kiwi", None)]


def fruit(threshold: float, **kw) -> CoverageParams:
    return CoverageParams(classify=FRUIT, min_classifier_accuracy=threshold, **kw)


def test_classifier_report_counts_each_type_and_the_confusion_matrix():
    texts, labels = zip(*LABELLED)
    measured = coverage.classifier_report(list(texts), list(labels), fruit(0.6))
    assert measured["labelled_requests"] == 8 and measured["unlabelled_requests"] == 2
    assert measured["correct"] == 5 and measured["accuracy"] == 0.625
    assert (measured[UNKNOWN], measured[AMBIGUOUS]) == (1, 1)  # the unlabelled "kiwi" is not counted
    assert measured["columns"] == ["a", "b", "c", UNKNOWN, AMBIGUOUS]
    assert measured["confusion"] == {
        "a": {"a": 2, "b": 0, "c": 0, UNKNOWN: 1, AMBIGUOUS: 1},
        "b": {"a": 0, "b": 2, "c": 1, UNKNOWN: 0, AMBIGUOUS: 0},
        "c": {"a": 0, "b": 0, "c": 1, UNKNOWN: 0, AMBIGUOUS: 0},
    }
    assert {t: (v["requests"], v["correct"], v["accuracy"]) for t, v in measured["types"].items()} == {
        "a": (4, 2, 0.5), "b": (3, 2, 0.6667), "c": (1, 1, 1.0)}
    assert measured["types"]["a"][UNKNOWN] == 1 and measured["types"]["a"][AMBIGUOUS] == 1


@pytest.mark.parametrize("threshold, flagged", [(0.5, []), (0.6, ["a"]), (0.7, ["a", "b"]), (1.0, ["a", "b"])])
def test_a_type_below_the_accuracy_threshold_is_flagged(threshold, flagged):
    texts, labels = zip(*LABELLED)
    measured = coverage.classifier_report(list(texts), list(labels), fruit(threshold))
    assert measured["flagged"] == flagged  # strictly below: a at exactly 0.5 passes a 0.5 threshold
    assert [t for t, v in measured["types"].items() if v["below_threshold"]] == flagged


def test_unlabelled_sample_measures_nothing_and_flags_nothing():
    measured = coverage.classifier_report(["apple", "kiwi"], [None, None], fruit(0.9))
    assert measured["labelled_requests"] == 0 and measured["accuracy"] is None and measured["flagged"] == []
    assert all(v["accuracy"] is None and not v["below_threshold"] for v in measured["types"].values())


def test_a_label_that_is_no_declared_type_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text(json.dumps({"text": "apple", "label": "a"}) + "\n" + json.dumps({"text": "kiwi"}) + "\n"
                    + json.dumps({"text": "a poem", "label": "poetry"}) + "\n")
    with pytest.raises(QuantgateError, match=rf"{path}:3: label 'poetry' \(label\) is not a declared request type; "
                                             r"declared: a, b, c"):
        coverage.load_traffic(fruit(0.8, traffic=str(path)))
    path.write_text(json.dumps({"text": "apple", "kind": "a"}) + "\n" + json.dumps({"text": "kiwi"}) + "\n")
    assert coverage.load_traffic(fruit(0.8, traffic=str(path), label_field="kind")) == (["apple", "kiwi"], ["a", None])
    with pytest.raises(QuantgateError, match="label 'poetry' is not a declared request type"):
        coverage.classifier_report(["a poem"], ["poetry"], fruit(0.8))


def test_run_writes_the_classifier_report_and_flags_a_type_it_misses(tmp_path, tokenizer):
    traffic = tmp_path / "traffic.jsonl"
    rows = [{"text": "What is 3/4 + 1/8?", "label": "math"}, {"text": "Where is my parcel, order 44120?", "label": "math"},
            {"text": "def area(r):\n    return 3.14159 * r * r", "label": "code"},
            {"text": "Hi, my order arrived broken. Can I get a refund?", "label": "chat"}, {"text": "What is 12+30?"}]
    traffic.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cov = CoverageParams(traffic=str(traffic))
    report = calibrate.run(CalibrationParams(**SMALL), cov, tokenizer, "tiny", tmp_path / "built", tmp_path / "cov")
    assert report["classifier_flagged"] == ["math"]  # 1 of 2 < 0.8
    assert {d: v["classifier_accuracy"] for d, v in report["domains"].items()} == {
        "chat": 1.0, "code": 1.0, "code_comment": None, "math": 0.5}
    assert report["classifier"]["confusion"]["math"]["chat"] == 1
    assert json.loads((tmp_path / "cov" / "classifier.json").read_text()) == report["classifier"]
    assert json.loads((tmp_path / "cov" / "coverage.json").read_text())["classifier_flagged"] == ["math"]
    assert (tmp_path / "cov" / "classifier_confusion.png").stat().st_size > 1000
    assert len(json.loads((tmp_path / "cov" / "classifier_predictions.json").read_text())) == 4


def calibrate_main_with(monkeypatch, report: dict, on_gap: str) -> int:
    """`calibrate.main()` with params' coverage.on_gap set and `run` giving `report`: how a flagged coverage
    report becomes a warning or a failure, without building a calibration set."""
    from pipelines.core import params as params_module
    from pipelines.models import loading as models

    params = Params()
    params = params.model_copy(update={"coverage": params.coverage.model_copy(update={"on_gap": on_gap})})
    monkeypatch.setattr(params_module, "load_params", lambda: params)
    monkeypatch.setattr(models, "resolve_model", lambda model: type("Source", (), {"location": "tiny"})())
    monkeypatch.setattr(models, "load_tokenizer", lambda source: None)
    monkeypatch.setattr(calibrate, "run", lambda *args, **kw: report)
    return calibrate.main()


@pytest.mark.parametrize("on_gap", ["warn", "fail"])
def test_on_gap_applies_to_a_flagged_classifier(monkeypatch, caplog, on_gap):
    texts, labels = zip(*LABELLED)
    measured = coverage.classifier_report(list(texts), list(labels), fruit(0.6))
    report = {"domains": {}, "under_represented": [], "classifier_flagged": measured["flagged"],
              "classifier": measured, "rule": "-", "unknown": {"production_share": 0.0, "flagged": False}}
    expected = r"classifier recognises too few labelled requests of a \(50.0%, 2/4\)"
    if on_gap == "fail":
        with pytest.raises(QuantgateError, match=expected + r".*coverage.on_gap is 'fail'"):
            calibrate_main_with(monkeypatch, report, on_gap)
    else:
        assert calibrate_main_with(monkeypatch, report, on_gap) == 0
        assert "too few labelled requests of a (50.0%, 2/4)" in caplog.text
