"""Stage `shadow` on the tests' tiny model: agreement with fp16, skipped requests, bad logs, privacy, a failed load."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines import shadow
from pipelines.core.errors import QuantgateError
from pipelines.core.params import Params
from pipelines.replay import agreement, traffic
from pipelines.replay import plots as replay_plots

EMAIL = "alice.smith@example.org"
REQUESTS = [
    {"id": "m1", "text": "25+60=", "label": "math"},
    {"id": "m2", "text": "What is 12 * 7? Answer: ", "label": "math"},
    {"id": "m3", "text": "31+51=", "label": "math"},
    {"id": "c1", "text": f"How do I reset my password? You can reach me at {EMAIL}.", "label": "chat"},
    {"id": "c2", "text": "Where is my order 5420? It was due last week.", "label": "chat"},
    {"id": "k1", "text": "def add(a, b):\n    return a + b\n", "label": "code"},
    {"id": "long", "text": " ".join(f"word{i}" for i in range(400)), "label": "chat"},  # over the largest bucket
]


def _copy(src, dst, noise: float = 0.0, broken: bool = False, vocab: int | None = None):
    shutil.copytree(src, dst)
    if noise:  # a variant that differs: every linear weight moved by `noise` x its own spread
        gen = torch.Generator().manual_seed(0)
        weights = load_file(dst / "model.safetensors")
        weights = {k: (v + noise * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
                   if v.ndim == 2 else v for k, v in weights.items()}
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    if broken:
        (dst / "config.json").write_text("{not json", encoding="utf-8")
    if vocab:  # loads, then crashes in the replay: the prompts' token ids are past its embedding (IndexError)
        config = json.loads((dst / "config.json").read_text("utf-8"))
        weights = load_file(dst / "model.safetensors")
        weights = {k: v[:vocab].contiguous() if v.shape[0] == config["vocab_size"] else v for k, v in weights.items()}
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
        config.update(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=None)
        (dst / "config.json").write_text(json.dumps(config), encoding="utf-8")
        (dst / "generation_config.json").unlink(missing_ok=True)  # its eos/pad ids would be past the vocabulary
    return dst


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_model):
    """fp16 of the tiny model, an exact copy, a noisy copy, a copy whose config does not parse and one that loads but
    crashes in the replay (its vocabulary is cut below the prompts' token ids)."""
    from pipelines import quantize
    from pipelines.core.params_sections import DEFAULT_VARIANTS
    from pipelines.models.loading import ModelSource

    from tests.content_cache import cached

    def build(root: Path) -> Path:
        manifest, _ = quantize.quantize_variant("fp16", DEFAULT_VARIANTS["fp16"], ModelSource("local", str(tiny_model)),
                                                tmp_path_factory.mktemp("unused"), "cpu", root)
        assert manifest["status"] == "ok", manifest.get("error")
        _copy(root / "fp16", root / "same")
        _copy(root / "fp16", root / "noisy", noise=1.5)  # 0.5 moved none of the undertrained tiny model's 16 tokens
        _copy(root / "fp16", root / "broken", broken=True)
        _copy(root / "fp16", root / "crashes", vocab=4)
        return root

    return cached(tmp_path_factory, "shadow_variants", build, code=["quantize"], helpers=["tests/test_shadow.py"],
                  inputs=[tiny_model.parent])


def _params(log, **shadow_settings) -> Params:
    params = Params()
    return params.model_copy(update={"shadow": params.shadow.model_copy(update={"traffic": str(log), "max_batch": 4,
                                                                               "timeout_s": 120,
                                                                               **shadow_settings})})


def _log(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _passed(*names):
    return {"variants": {n: {"domains": {"math": {"verdict": "pass"}, "chat": {"verdict": "fail"}},
                             "memory": {"footprint_saving_pct": 0.0}} for n in names}}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory, variants):
    from tests.content_cache import cached

    def build(out: Path) -> tuple:
        log = _log(out / "traffic.jsonl", REQUESTS)
        report = shadow.run(_params(log), _passed("same", "noisy", "broken", "crashes"), variants, "cpu",
                            out / "shadow.json", out / "metrics.json", out / "shadow", out / "plots")
        return report, out

    return cached(tmp_path_factory, "shadow_replayed", build, code=["shadow"], helpers=["tests/test_shadow.py"],
                  inputs=[variants])


def test_fp16_against_itself_agrees_exactly(replayed):
    report, _ = replayed
    assert report["models"]["fp16"]["status"] == "ok" and "agreement" not in report["models"]["fp16"]
    for cells in report["models"]["same"]["agreement"].values():
        for cell in cells.values():
            assert cell["exact"]["share"] == 1.0 and cell["exact"]["high"] == 1.0
            assert cell["similarity"]["mean"] == 1.0 and cell["first_difference"]["median"] is None


def test_a_variant_that_differs_matches_a_hand_computation(replayed):
    report, out = replayed
    rows = [json.loads(line) for line in (out / "shadow" / "answers.jsonl").read_text("utf-8").splitlines()]
    answer = {(r["model"], r["id"]): r["answer"] for r in rows}
    for type_, cells in report["models"]["noisy"]["agreement"].items():
        ids = [r["id"] for r in rows if r["model"] == "fp16" and r["type"] == type_]
        # answers.jsonl keeps the PII-masked text: equal tokens give equal text, but two digit runs both read [CARD]
        same_text = sum(answer["fp16", i] == answer["noisy", i] for i in ids)
        exact = cells["all"]["exact"]
        n, same, z = len(ids), round(exact["share"] * len(ids)), 1.959963984540054
        assert cells["all"]["requests"] == n and same <= same_text and exact["share"] == pytest.approx(same / n)
        if same_text < n:  # a text that differs is a token that differs
            assert same < n
        p = same / n
        centre, spread = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        assert exact["low"] == pytest.approx(max(0.0, (centre - spread) / (1 + z * z / n)))
        assert exact["high"] == pytest.approx(min(1.0, (centre + spread) / (1 + z * z / n)))
    total = sum(c["all"]["requests"] for c in report["models"]["noisy"]["agreement"].values())
    shares = [c["all"]["exact"]["share"] for c in report["models"]["noisy"]["agreement"].values()]
    assert total == 6 and min(shares) < 1
    math_cell = report["models"]["noisy"]["agreement"]["math"]["all"]
    assert math_cell["outcome"]["kind"] == "final_number" and math_cell["outcome"]["requests"] == 3


def test_a_too_long_request_is_skipped_and_counted(replayed):
    report, out = replayed
    assert report["traffic"]["requests"] == 7 and report["traffic"]["replayed"] == 6
    assert report["traffic"]["skipped"] == {"too_long": 1}
    rows = [json.loads(line) for line in (out / "shadow" / "answers.jsonl").read_text("utf-8").splitlines()]
    assert "long" not in {r["id"] for r in rows} and len(rows) == 3 * 6  # fp16, same and noisy


def test_a_model_that_fails_to_load_or_crashes_is_recorded_and_the_others_replay(replayed):
    report, out = replayed
    assert report["models"]["broken"]["status"] == "failed" and "broken" in report["models"]["broken"]["error"]
    crashed = report["models"]["crashes"]
    assert crashed["status"] == "failed" and "index" in crashed["error"].lower() and "agreement" not in crashed
    assert report["models"]["noisy"]["status"] == "ok" and report["models"]["same"]["status"] == "ok"
    metrics = json.loads((out / "metrics.json").read_text("utf-8"))
    assert metrics["models"]["broken"]["status"] == "failed" and metrics["models"]["crashes"]["status"] == "failed"
    memory = metrics["models"]["noisy"]["memory"]  # growth is across the whole replay, the peak per batch
    assert memory["peak_bytes"] >= memory["start_bytes"] > 0 and "batch_peak_growth_bytes" in memory
    if memory["growth_bytes"] is not None:
        assert memory["growth_pct"] == pytest.approx(100 * memory["growth_bytes"] / memory["start_bytes"])
    assert metrics["models"]["noisy"]["latency"]["ttft_ms"]["p50"] > 0
    assert set(metrics["memory_saving"]) == {"same", "noisy"}
    assert (out / "plots" / "shadow_agreement.png").is_file() and (out / "plots" / "shadow_latency.png").is_file()


def test_masked_answers_carry_no_email_from_the_requests(replayed, tmp_path):
    _, out = replayed
    assert EMAIL not in (out / "shadow" / "answers.jsonl").read_text("utf-8")
    request = traffic.Request(id="c1", text="x", where="log:1", type="chat", ids=[1, 2], bucket=64)
    shadow._answers(tmp_path / "a.jsonl", [request], [0], {"fp16": [f"Sure, I wrote to {EMAIL} again."]}, "masked")
    written = (tmp_path / "a.jsonl").read_text("utf-8")
    assert EMAIL not in written and "[EMAIL]" in written


def test_store_hashes_writes_no_answer_text_and_no_raw_id(tmp_path, variants):
    from pipelines.core.io import sha256_text

    ids = ["customer-alice-0042", EMAIL]
    log = _log(tmp_path / "traffic.jsonl", [{**r, "id": i} for r, i in zip(REQUESTS[:2], ids)])
    shadow.run(_params(log, store="hashes"), _passed(), variants, "cpu", tmp_path / "s.json", tmp_path / "m.json",
               tmp_path / "shadow", tmp_path / "plots")
    written = (tmp_path / "shadow" / "answers.jsonl").read_text("utf-8")
    rows = [json.loads(line) for line in written.splitlines()]
    assert len(rows) == 2 and all("answer" not in r and len(r["sha256"]) == 64 and "length" in r for r in rows)
    assert all(i not in written for i in ids) and [r["id"] for r in rows] == [sha256_text(i) for i in ids]


def test_masked_answers_mask_a_personal_id(tmp_path):
    request = traffic.Request(id=EMAIL, text="x", where="log:1", type="chat", ids=[1, 2], bucket=64)
    shadow._answers(tmp_path / "a.jsonl", [request], [0], {"fp16": ["fine"]}, "masked")
    assert json.loads((tmp_path / "a.jsonl").read_text("utf-8"))["id"] == "[EMAIL]"


def test_a_log_of_types_no_passing_variant_serves_warns(caplog):
    with caplog.at_level("WARNING", logger="pipelines.shadow"):
        shadow._warn_if_too_few(["unknown"] * 30 + ["math"] * 3, _passed("int8"), 20)
    assert "no request type a passing variant could serve" in caplog.text and "math 3" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipelines.shadow"):
        shadow._warn_if_too_few(["math"] * 20, _passed("int8"), 20)
    assert caplog.text == ""


def test_parquet_and_csv_logs_keep_their_strings(tmp_path):
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    stamps = [dt.datetime(2026, 1, 1, 12, 0, 0), dt.datetime(2026, 1, 1, 12, 0, 30)]
    pq.write_table(pa.table({"id": ["007", "12"], "text": ["12", "What is 007?"], "label": ["math", "chat"],
                             "at": pa.array(stamps, pa.timestamp("us"))}), tmp_path / "t.parquet")
    read = traffic.read_traffic(tmp_path / "t.parquet", "auto", "text", "id", "label", None, "at")
    assert [(r.id, r.text, r.label) for r in read] == [("007", "12", "math"), ("12", "What is 007?", "chat")]
    assert read[1].timestamp - read[0].timestamp == 30.0 and read[1].where == f"{tmp_path / 't.parquet'}:row 2"
    (tmp_path / "t.csv").write_text('id,text,label,at\n007,12,math,100\n12,"What is 007?",chat,130.5\n',
                                    encoding="utf-8")
    read = traffic.read_traffic(tmp_path / "t.csv", "auto", "text", "id", "label", None, "at")
    assert [(r.id, r.text, r.label, r.timestamp) for r in read] == [("007", "12", "math", 100.0),
                                                                    ("12", "What is 007?", "chat", 130.5)]
    (tmp_path / "gap.csv").write_text("id,text\n1,hi\n2,\n", encoding="utf-8")
    with pytest.raises(QuantgateError, match=rf"{tmp_path / 'gap.csv'}:3: no text in field 'text'"):
        traffic.read_traffic(tmp_path / "gap.csv", "auto", "text", "id", "label", None, None)
    pq.write_table(pa.table({"id": ["1"], "prompt": ["hi"]}), tmp_path / "gap.parquet")
    with pytest.raises(QuantgateError, match=rf"{tmp_path / 'gap.parquet'}:row 1: no text in field 'text'"):
        traffic.read_traffic(tmp_path / "gap.parquet", "auto", "text", "id", "label", None, None)


def test_an_empty_parquet_or_header_only_csv_has_no_requests(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}),
                   tmp_path / "e.parquet")
    (tmp_path / "e.csv").write_text("id,text,label\n", encoding="utf-8")
    (tmp_path / "zero.parquet").write_bytes(b"")
    for name in ("e.parquet", "e.csv", "zero.parquet"):
        with pytest.raises(QuantgateError, match=rf"{tmp_path / name}: no requests"):
            traffic.read_traffic(tmp_path / name, "auto", "text", "id", "label", None, None)


def test_a_row_without_text_names_its_file_and_line(tmp_path):
    log = _log(tmp_path / "t.jsonl", [REQUESTS[0], REQUESTS[1], {"id": "x", "prompt": "hi"}])
    with pytest.raises(QuantgateError, match=rf"{tmp_path / 't.jsonl'}:3: no text in field 'text'"):
        traffic.read_traffic(log, "auto", "text", "id", "label", None, None)


def test_an_empty_or_missing_log_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(QuantgateError, match="empty: nothing to replay"):
        traffic.read_traffic(tmp_path / "empty.jsonl", "auto", "text", "id", "label", None, None)
    with pytest.raises(QuantgateError, match="traffic log not found"):
        traffic.read_traffic(tmp_path / "nowhere.jsonl", "auto", "text", "id", "label", None, None)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(QuantgateError, match="cannot read the traffic log"):
        traffic.read_traffic(tmp_path / "bad.jsonl", "auto", "text", "id", "label", None, None)


def test_agreement_numbers_by_hand():
    assert agreement.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert agreement.first_difference([1, 2], [1, 2, 3]) == 2
    assert agreement.first_difference([5], [5]) is None
    assert agreement.similarity([1, 2, 3, 4], [1, 2, 9, 4]) == pytest.approx(0.75)  # 2 * 3 matches / 8 tokens
    assert agreement.final_number("so 3 + 4 = 7.50") == "7.5" and agreement.final_number("none") is None
    cell = agreement.summarise([[1, 2], [3], [4, 5]], [[1, 2], [3, 6], [4, 6]], ["2", "3", "4 5"], ["2", "3 6", "4 6"],
                               [None] * 3, "final_number")
    assert cell["exact"]["share"] == pytest.approx(1 / 3)
    assert cell["first_difference"] == {"median": 1.0, "mean": 1.0}
    assert cell["similarity"]["mean"] == pytest.approx((1 + 2 / 3 + 0.5) / 3)
    assert cell["outcome"]["share"] == pytest.approx(1 / 3)  # final numbers 2=2, 3!=6, 5!=6
    ref = agreement.outcome("reference", ["it is 85", "no idea"], ["85", "it is 85"], ["85", "85"])
    assert ref["share"] == 0.5 and ref["fp16_correct"] == 0.5 and ref["variant_correct"] == 1.0


@pytest.mark.parametrize("key, value", [("max_new_tokens", 0), ("max_new_tokens", 513), ("max_batch", 0),
                                        ("max_batch", 257), ("time_compression", 0), ("store", "plain"),
                                        ("kind", "xml"), ("min_requests", 0)])
def test_shadow_params_out_of_range_are_refused(tmp_path, key, value):
    from pipelines.core.params import load_params

    (tmp_path / "p.yaml").write_text(f"shadow:\n  {key}: {value}\n", encoding="utf-8")
    with pytest.raises(QuantgateError, match=rf"p.yaml:2: key 'shadow.{key}'"):
        load_params(tmp_path / "p.yaml")


def test_time_compression_without_timestamp_field_is_refused(tmp_path):
    from pipelines.core.params import load_params

    (tmp_path / "p.yaml").write_text("shadow:\n  time_compression: 2\n", encoding="utf-8")
    with pytest.raises(QuantgateError, match=r"p.yaml:1: key 'shadow': .*time_compression needs shadow.timestamp_field"):
        load_params(tmp_path / "p.yaml")


def test_shadow_params_edges_load(tmp_path):
    from pipelines.core.params import load_params

    (tmp_path / "p.yaml").write_text("shadow:\n  max_new_tokens: 512\n  max_batch: 256\n  time_compression: 0.001\n"
                                     "  timestamp_field: at\n  store: hashes\n", encoding="utf-8")
    p = load_params(tmp_path / "p.yaml").shadow
    assert (p.max_new_tokens, p.max_batch, p.store, p.traffic) == (512, 256, "hashes", None)


def test_a_types_outcome_is_its_own_reference_or_else_math_s_final_number():
    """Reference answers in one type's rows do not take the final-number outcome from math's."""
    from pipelines.replay.agreement import agreement

    types, buckets = ["math", "math", "chat"], [64, 64, 64]
    ids = [[1, 2], [3, 4], [5, 6]]
    cells = agreement(types, buckets, ids, ids, ["x = 4", "y = 7", "Paris"], ["4", "8", "Lyon"], [None, None, "Paris"])
    assert cells["math"]["all"]["outcome"]["kind"] == "final_number"
    assert cells["math"]["all"]["outcome"]["share"] == 0.5  # 4 = 4, 7 != 8
    assert cells["chat"]["all"]["outcome"]["kind"] == "reference"
    assert (cells["chat"]["all"]["outcome"]["fp16_correct"], cells["chat"]["all"]["outcome"]["variant_correct"]) == (1.0, 0.0)


def test_the_replays_charts_draw_agreement_and_latency_and_an_empty_replay(tmp_path, monkeypatch):
    report = {"models": {"int8": {"agreement": {"math": {"all": {"exact": {"share": 0.9}}}}}, "fp16": {}}}
    timings = {"fp16": {"ttft_ms": [3.0, 1.0, 2.0], "tpot_ms": [0.5]}, "int8": {"ttft_ms": [], "tpot_ms": [0.7]}}
    drawn = [replay_plots.agreement_chart(tmp_path / "a.png", report),
             replay_plots.agreement_chart(tmp_path / "none.png", {"models": {}}),  # nothing replayed: a chart saying so
             replay_plots.latency_chart(tmp_path / "l.png", timings)]
    assert [p.name for p in drawn] == ["a.png", "none.png", "l.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 1000 for p in drawn)
    # a model replayed through its endpoint adds a third panel: its requests' latency seen from the client
    panels = []
    saving = replay_plots.save
    monkeypatch.setattr(replay_plots, "save", lambda fig, path: panels.append(
        [(ax.get_title(), [line.get_label() for line in ax.get_lines()]) for ax in fig.axes]) or saving(fig, path))
    replay_plots.latency_chart(tmp_path / "served.png", {**timings, "vendor": {"client_ms": [120.0, 95.5]}})
    replay_plots.latency_chart(tmp_path / "here.png", timings)
    assert panels[0] == [("time to first token", ["fp16"]), ("time per output token", ["fp16", "int8"]),
                         ("request seen from the client (endpoints)", ["vendor"])]
    assert [title for title, _ in panels[1]] == ["time to first token", "time per output token"]


def test_the_engine_answers_greedily_the_same_for_a_copy_and_otherwise_for_a_noisy_one(variants):
    """engine.replay in this process (the stage runs it in a child): greedy, so the same weights answer the same."""
    from pipelines.replay import engine

    batches = [[[1, 5, 9, 13]], [[1, 7, 7, 2], [1, 8, 3, 4]]]
    fp16 = engine.replay(str(variants / "fp16"), batches, 6, "cpu", 1)
    assert len(fp16["answers"]) == 3 and all(0 < len(a) <= 6 for a in fp16["answers"])
    assert engine.replay(str(variants / "same"), batches, 6, "cpu", 1)["answers"] == fp16["answers"]
    assert engine.replay(str(variants / "noisy"), batches, 6, "cpu", 1)["answers"] != fp16["answers"]
