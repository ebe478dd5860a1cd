"""`quantgate audit` and `gate --audit`: recorded evidence re-measured through the checkpoints.

The record checks run on hand-made records (fast); the re-measuring runs in copies of the finished end-to-end
pipeline (tests/conftest.py `pipeline_run`), never in the shared run itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines.core.io import read_jsonl, write_json, write_jsonl
from pipelines.evaluation import fidelity
from pipelines.evaluation.remeasure import draw, loglikelihood, summary_problems
from tests.pipeline_e2e_helpers import dvc


def test_a_multiple_choice_response_is_a_log_likelihood_and_a_generated_one_is_text():
    assert loglikelihood("(-6.9453125, False)") == (-6.9453125, False)
    assert loglikelihood(" x + 12") is None and loglikelihood("171") is None and loglikelihood("(1, 2)") is None


def test_one_seed_draws_one_sample_whatever_the_record_order_and_another_seed_another():
    records = {"int8": {"math": [f"m{i}" for i in range(50)], "chat": [f"c{i}" for i in range(5)]},
               "awq4": {"math": [f"m{i}" for i in range(50)]}}
    shuffled = {"awq4": {"math": records["awq4"]["math"][::-1]},
                "int8": {"chat": records["int8"]["chat"][::-1], "math": records["int8"]["math"][::-1]}}
    texts = {"int8": {"math": 16}}
    first = draw(records, texts, 8, 2, seed=7)
    assert first == draw(shuffled, texts, 8, 2, seed=7)  # the models' order too
    assert len(first["int8"]["items"]["math"]) == 8 and len(first["int8"]["items"]["chat"]) == 5  # all of a small row
    assert len(first["int8"]["texts"]["math"]) == 2
    assert draw(records, texts, 8, 2, seed=8)["int8"]["items"]["math"] != first["int8"]["items"]["math"]


def _records():
    """A one-domain evaluation whose summaries are what its records give: 2 items, 2 texts (2 and 3 tokens)."""
    base = {"math.lengths": torch.tensor([3, 4], dtype=torch.int32),
            "math.correct_logprob": torch.tensor([-0.5, -1.0, -0.2, -0.3, -2.0])}
    texts = [{"domain": "math", "text": 0, "tokens": 2, "kl": [0.01, 0.02], "logprob": [-0.6, -1.1], "same_top1": [1, 0]},
             {"domain": "math", "text": 1, "tokens": 3, "kl": [0.0, 0.3, 0.05], "logprob": [-0.2, -0.4, -2.5],
              "same_top1": [1, 1, 1]}]
    items = [{"domain": "math", "task": "quantgate_math", "item_id": "m1", "correct": True},
             {"domain": "math", "task": "quantgate_math", "item_id": "m2", "correct": False}]
    result = {"status": "ok", "probes": {"math": {"status": "ok", "items": 2, "score": 0.5,
                                                   "blocks": [{"items": 2, "score": 0.5}]}},
              "fidelity": {"math": fidelity.summary(texts, base, "math")}}
    return result, items, texts, base


def test_records_that_agree_with_their_summaries_pass_the_record_checks():
    assert summary_problems("int8", *_records()) == []


def test_one_per_text_kl_edited_is_found_by_its_summary():
    result, items, texts, base = _records()
    texts[1]["kl"][1] = 0.03  # the largest token's KL made small, the summary left as it was
    (problem,) = summary_problems("int8", result, items, texts, base)
    assert problem["variant"] == "int8" and problem["row"] == "math" and "kl" in problem["what"]


def test_an_lm_eval_score_that_is_not_its_records_mean_is_found():
    result, items, texts, base = _records()
    result["probes"]["math"]["score"] = 0.9
    (problem,) = summary_problems("int8", result, items, texts, base)
    assert problem["row"] == "math" and "0.9" in problem["what"]
    result, items, texts, base = _records()
    (problem,) = summary_problems("int8", result, items[:1], texts, base)  # a record dropped
    assert "1 per-item records" in problem["what"]
    result, items, texts, base = _records()
    assert summary_problems("int8", result, items, texts[:1], base)[0]["what"].startswith("fidelity per-text rows")


# ---- in copies of the finished end-to-end run


def _env() -> dict:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _copy(pipeline_run, tmp_path) -> Path:
    finished, _, _ = pipeline_run
    repo = tmp_path / "repo"
    shutil.copytree(finished, repo, symlinks=True)
    return repo


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["quantgate", *args], cwd=repo, env=_env(), capture_output=True, text=True, timeout=1800)


def _commit(repo: Path, *variants: str) -> None:
    """What the issue did: `dvc commit -f` the edited stages, then `dvc repro` (compare onwards re-run on them)."""
    for args in (["commit", "-f", *(f"evaluate@{v}" for v in variants)], ["repro"]):
        done = dvc(args, repo)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.e2e
def test_untouched_records_pass_the_audit_with_a_printed_seed_that_repeats(pipeline_run, tmp_path):
    repo = _copy(pipeline_run, tmp_path)
    done = _run(repo, "audit")
    assert done.returncode == 0, done.stdout + done.stderr
    audit = json.loads((repo / "results/audit.json").read_text())
    assert audit["verdict"] == "ok" and f"seed {audit['seed']}" in done.stdout
    assert audit["largest_difference"]["items"] > 0 and audit["largest_difference"]["texts"] > 0
    # the seed repeats the sample: asked of awq4 alone (fp16 comes along), the draw takes the same first two models in
    # the same sorted order, so their samples are the full audit's (that one seed gives one sample whatever order the
    # records and models are in: test_one_seed_draws_one_sample_whatever_the_record_order_and_another_seed_another)
    again = _run(repo, "audit", "--variant", "awq4", "--seed", str(audit["seed"]))
    repeated = json.loads((repo / "results/audit.json").read_text())["sample"]
    assert again.returncode == 0 and sorted(repeated) == ["awq4", "fp16"]
    assert repeated == {name: audit["sample"][name] for name in ("awq4", "fp16")}


@pytest.fixture(scope="module")
def tampered(pipeline_run, tmp_path_factory):
    """One copy of the finished run with both of the tampers below, committed and re-run once (a `dvc repro` from
    compare onwards is most of each test's time): a passing variant's evidence edited consistently, and another
    variant's largest per-text KL made small with its summary left alone. The gate and the audit are asked per
    variant (`--variant` re-measures that variant and fp16 only), so each edit is judged on its own."""
    repo = _copy(pipeline_run, tmp_path_factory.mktemp("tampered"))
    # a variant the gate passes on the fixture's policy: int8 (nearly lossless), unless its memory grows on this CPU
    # (docs/memory.md), then the next
    name = next((n for n in ("int8", "awq4", "gptq3") if _run(repo, "gate", "--variant", n).returncode == 0), None)
    assert name, "no variant passes the fixture's gate"
    edited = _edit_consistently(repo, name)
    other = next(n for n in ("int8", "awq4", "gptq3") if n != name)
    path = repo / f"results/eval/{other}/fidelity.jsonl"
    texts = read_jsonl(path)
    worst = max(range(len(texts)), key=lambda j: max(texts[j]["kl"]))
    texts[worst]["kl"] = [v / 10 for v in texts[worst]["kl"]]  # the largest KL made small; the summary left alone
    write_jsonl(path, texts)
    _commit(repo, name, other)
    return repo, name, edited, other, texts[worst]["domain"]


def _edit_consistently(repo: Path, name: str) -> list[str]:
    """The issue's tamper: the variant's multiple-choice log-likelihoods and wrong answers rewritten, its per-token KL
    halved and its KL summary recomputed to match, lm-eval's score left consistent. Returns the edited items' ids."""
    records = repo / f"results/eval/{name}/items.jsonl"
    edited = []
    rows = read_jsonl(records)
    for row in rows:
        ll = loglikelihood(row["response"])
        if ll:  # a chat item: its first choice's log-likelihood made more likely
            row["response"] = str((ll[0] + 1.0, ll[1]))
        elif not row["correct"]:  # a wrong answer replaced by another wrong one
            row["response"] = row["response"] + " (edited)"
        else:
            continue
        edited.append(row["item_id"])
    assert edited
    write_jsonl(records, rows)
    texts = read_jsonl(repo / f"results/eval/{name}/fidelity.jsonl")
    for t in texts:
        t["kl"] = [v / 2 for v in t["kl"]]
    write_jsonl(repo / f"results/eval/{name}/fidelity.jsonl", texts)
    result = json.loads((repo / f"results/eval/{name}.json").read_text())
    base = fidelity.load_base(repo / "results/baseline/fidelity.safetensors")
    for domain in result["fidelity"]:
        result["fidelity"][domain] = fidelity.summary([t for t in texts if t["domain"] == domain], base, domain)
    write_json(repo / f"results/eval/{name}.json", result)
    return edited


@pytest.mark.e2e
def test_consistently_edited_evidence_passes_the_gate_but_not_the_audit(tampered):
    """Everything downstream re-derives from the consistent edit (plain gate: exit 0); the audit re-measures and
    refuses, naming edited items. (int8's per-token KLs may all sit below audit.kl_tolerance, so halving them is not
    asserted found.)"""
    repo, name, edited, _, _ = tampered
    plain = _run(repo, "gate", "--variant", name)
    assert plain.returncode == 0, plain.stdout + plain.stderr  # the gate alone trusts the edited evidence
    audited = _run(repo, "gate", "--variant", name, "--audit")
    assert audited.returncode == 2, audited.stdout + audited.stderr
    gate = json.loads((repo / "results/gate.json").read_text())
    audit = json.loads((repo / "results/audit.json").read_text())
    named = [p for p in audit["problems"] if p["variant"] == name]
    assert named and all(p["variant"] == name for p in audit["problems"])  # fp16's records were not touched
    flagged = {i for p in named for i in p["items"] if not str(i).startswith("text ")}
    assert flagged & set(edited)  # edited items are named
    # beside them, at most the one natural mismatch per row the tolerance allows (a near tie decoded otherwise)
    assert len(flagged - set(edited)) <= audit["tolerance"]["max_mismatched_items"], flagged - set(edited)
    assert gate["verdict"] == "undecided" and any(sorted(flagged)[0] in r for r in gate["reasons"])
    assert str(audit["seed"]) in audited.stdout


@pytest.mark.e2e
def test_one_edited_per_text_kl_is_refused(tampered):
    repo, _, _, other, domain = tampered
    done = _run(repo, "audit", "--variant", other)
    assert done.returncode == 2, done.stdout + done.stderr
    audit = json.loads((repo / "results/audit.json").read_text())
    assert any(p["variant"] == other and p["row"] == domain and "per-text rows" in p["what"]
               for p in audit["problems"]), audit["problems"]
