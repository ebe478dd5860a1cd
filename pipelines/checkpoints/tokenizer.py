"""The tokenizer: evaluation and serving tokenize with the candidate's own, so it must fit the embedding table
and behave exactly like the base model's (vocabulary, special tokens, chat template, probe strings)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from pipelines.checkpoints.context import Candidate
from pipelines.checkpoints.files import MAX_SMALL_BYTES, TOKENIZER_NAMES, open_member

# Probe strings whose ids must equal the base tokenizer's: English, Chinese, code, math, whitespace, specials.
TOKENIZER_PROBES = ("The quick brown fox jumps over the lazy dog.", "量化模型的验证流程：检查每一个文件。",
                    "def f(x):\n    return x ** 2  # square\n", "∫₀¹ x² dx = 1/3, 12+30=42, e^{iπ} + 1 = 0",
                    "  Mixed 中文 and English\t\ttabs\n\nnew lines  ", "<s> </s> <pad> <unk>")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
TOKENIZER_SIDE = ("padding_side", "truncation_side")


def tokenizer_size(docs: dict) -> tuple[tuple[int, str] | None, list[str]]:
    """((largest token id + 1, file it comes from), reasons) from the shipped tokenizer files, without loading them."""
    best, reasons = None, []
    tok = docs.get("tokenizer.json")
    if tok is not None:
        model = tok.get("model") if isinstance(tok, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        extra = tok.get("added_tokens") if isinstance(tok, dict) else None
        if not isinstance(tok, dict):
            reasons.append(f"tokenizer.json: a {type(tok).__name__}, not a JSON object")
        elif not isinstance(model, dict):
            reasons.append(f"tokenizer.json: model is a {type(model).__name__}, not a JSON object")
        elif not isinstance(vocab, (dict, list, type(None))):  # token -> id (BPE, WordPiece), [piece, score] (Unigram)
            reasons.append(f"tokenizer.json: model.vocab is a {type(vocab).__name__}, not an object or a list")
        elif not isinstance(extra, (list, type(None))) or not all(
                isinstance(t, dict) and type(t.get("id")) is int for t in extra or []):
            reasons.append("tokenizer.json: added_tokens is not a list of {id: integer, ...} objects")
        else:
            ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or [])))
            bad = [k for k, v in (vocab.items() if isinstance(vocab, dict) else ()) if type(v) is not int]
            if bad:
                reasons.append(f"tokenizer.json: model.vocab token {bad[0]!r} has id {vocab[bad[0]]!r}, not an integer")
            ids = [i for i in ids if type(i) is int] + [t["id"] for t in extra or []]
            if ids:
                best = (max(ids) + 1, "tokenizer.json")
    added = docs.get("added_tokens.json")
    if added is not None:
        bad = [k for k, v in added.items() if type(v) is not int] if isinstance(added, dict) else None
        if bad is None:
            reasons.append(f"added_tokens.json: a {type(added).__name__}, not a JSON object")
        elif bad:
            reasons.append(f"added_tokens.json: token {bad[0]!r} has id {added[bad[0]]!r}, not an integer")
        elif added and (best is None or max(added.values()) + 1 > best[0]):
            best = (max(added.values()) + 1, "added_tokens.json")
    return best, reasons


def tokenizer_fits(config: dict, docs: dict) -> list[str]:
    """A token id past vocab_size has no embedding row: the model would index out of range."""
    size, reasons = tokenizer_size(docs)
    vocab = config.get("vocab_size")
    if size and isinstance(vocab, int) and size[0] > vocab:
        reasons.append(f"{size[1]}: token ids reach {size[0] - 1}, past config.json vocab_size {vocab} "
                       "(those tokens have no embedding row)")
    return reasons


def tokenizer_files(files: dict[str, str]) -> str:
    names = [rel for rel in files if rel in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                             "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt")
             or rel in TOKENIZER_NAMES]
    return ", ".join(names) or "the tokenizer files"


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    from pipelines.core import logs

    with logs.library_output("admit"):
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def tokenizer_behaviour(tok) -> dict:
    """What evaluation depends on: vocabulary, special tokens and ids, chat template, probe ids and their decoding."""
    special = {name: (str(getattr(tok, name, None)) if getattr(tok, name, None) is not None else None,
                      getattr(tok, f"{name}_id", None)) for name in SPECIAL_TOKENS}
    extra = getattr(tok, "additional_special_tokens", None) or []
    probes = {text: tok(text, add_special_tokens=True)["input_ids"] for text in TOKENIZER_PROBES}
    return {"vocab": tok.get_vocab(), "special": special, "additional_special_tokens": [str(t) for t in extra],
            "chat_template": getattr(tok, "chat_template", None), "probes": probes,
            "decoded": {text: tok.decode(ids) for text, ids in probes.items()},
            "side": {name: getattr(tok, name, None) for name in TOKENIZER_SIDE}}


_BASE_TOKENIZERS: dict = {}


def base_tokenizer_behaviour(base_dir: str) -> dict:
    """The base tokenizer's behaviour, cached per folder and file state (admission runs once per candidate)."""
    base = Path(base_dir)
    key = (str(base.resolve()), tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                                             for p in base.iterdir() if p.is_file() and p.suffix != ".safetensors")))
    if key not in _BASE_TOKENIZERS:
        _BASE_TOKENIZERS.clear()
        _BASE_TOKENIZERS[key] = tokenizer_behaviour(load_tokenizer(base))
    return _BASE_TOKENIZERS[key]


def tokenizer_matches_base(folder: Path, files: dict[str, str], base_dir: str) -> list[str]:
    """Evaluation tokenizes with the candidate's own tokenizer: it must behave exactly like the base model's."""
    where = tokenizer_files(files)
    if where == "the tokenizer files":
        return ["no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): evaluation and serving "
                "tokenize with the checkpoint's own tokenizer; ship the base model's beside the weights"]
    try:
        mine = tokenizer_behaviour(load_tokenizer(folder))
    except Exception as err:  # noqa: BLE001 - whatever the files do, the candidate is refused
        return [f"{where}: transformers cannot load the tokenizer ({type(err).__name__}: {err})"]
    theirs = base_tokenizer_behaviour(base_dir)
    reasons = []
    if mine["vocab"] != theirs["vocab"]:
        moved = sorted(t for t in set(mine["vocab"]) & set(theirs["vocab"]) if mine["vocab"][t] != theirs["vocab"][t])
        added, gone = sorted(set(mine["vocab"]) - set(theirs["vocab"])), sorted(set(theirs["vocab"]) - set(mine["vocab"]))
        detail = "; ".join(part for part in (
            f"{len(moved)} tokens map to other ids (e.g. {moved[0]!r}: {mine['vocab'][moved[0]]}, the base "
            f"{theirs['vocab'][moved[0]]})" if moved else "",
            f"{len(added)} tokens not in the base (e.g. {added[0]!r})" if added else "",
            f"{len(gone)} base tokens missing (e.g. {gone[0]!r})" if gone else "") if part)
        reasons.append(f"{where}: the vocabulary differs from the base model's ({detail})")
    for name, (token, tid) in mine["special"].items():
        if (token, tid) != theirs["special"][name]:
            reasons.append(f"{where}: {name} is {token!r} (id {tid}), the base model's is "
                           f"{theirs['special'][name][0]!r} (id {theirs['special'][name][1]})")
    if mine["additional_special_tokens"] != theirs["additional_special_tokens"]:
        reasons.append(f"{where}: additional special tokens {mine['additional_special_tokens']}, the base model has "
                       f"{theirs['additional_special_tokens']}")
    if mine["chat_template"] != theirs["chat_template"]:
        template_files = [rel for rel in files if rel.endswith(".jinja")] or ["tokenizer_config.json"]
        reasons.append(f"{', '.join(template_files)}: the chat template differs from the base model's")
    for name, value in mine["side"].items():
        if value != theirs["side"][name]:
            reasons.append(f"{where}: {name} is {value!r}, the base model's is {theirs['side'][name]!r}")
    for text, ids in mine["probes"].items():
        if ids != theirs["probes"][text]:
            reasons.append(f"{where}: {text!r} encodes to {ids}, the base tokenizer gives {theirs['probes'][text]}")
        elif mine["decoded"][text] != theirs["decoded"][text]:
            reasons.append(f"{where}: the ids of {text!r} decode to {mine['decoded'][text]!r}, the base tokenizer "
                           f"gives {theirs['decoded'][text]!r}")
    return reasons


def tokenizer_length(c: Candidate) -> list[str]:
    """Check: no token id past config.json's vocab_size (read from the files, nothing loaded)."""
    return tokenizer_fits(c.config, c.docs)


def checked_copy(folder: Path, files: dict[str, str], checked: dict[str, str], dest: Path) -> list[str]:
    """Every non-weights file copied to `dest` (read as files.open_member reads it), or why not: a file whose
    bytes differ from the sha256 phase 1 checked changed in between (a rewrite, a link re-pointed)."""
    for rel, kind in files.items():
        if kind == "weights":
            continue
        with open_member(folder, rel) as fh:
            raw = fh.read(MAX_SMALL_BYTES + 1)
        if hashlib.sha256(raw).hexdigest() != checked.get(rel):
            return [f"{rel}: changed while being read (its bytes differ from those checked)"]
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(raw)
    return []


def tokenizer_against_base(c: Candidate) -> list[str]:
    """Check: the tokenizer behaves like the base model's. It loads the files through transformers, so it runs
    only on a folder whose files passed every check before it (no reasons yet), and on a private copy of the
    bytes phase 1 hashed: transformers never follows a link itself, and judges the bytes that are copied."""
    if c.reasons:
        return []
    with tempfile.TemporaryDirectory(prefix="quantgate-tokenizer-") as tmp:
        return checked_copy(c.folder, c.files, c.checked, Path(tmp)) or tokenizer_matches_base(Path(tmp), c.files,
                                                                                             c.base_dir)
