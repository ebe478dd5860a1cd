"""The doctor's model and disk rows: the model params.yaml names, found and described from its config.json, and free
disk against the checkpoints the run writes. No weights are loaded: sizes come from config.json or the safetensors
headers."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.paths import MODELS_DIR, REFERENCE_DIR, SHIPPED_REFERENCE_DIR
from pipelines.diagnose.check import FAIL, OK, WARN, Check, existing, size

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _hub_cached(repo: str, filename: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, filename)
    except Exception:  # noqa: BLE001
        return None
    return Path(found) if isinstance(found, str) else None


def model_check(params) -> Check:
    """The model params.yaml names: the shipped reference, a checkpoint folder with config.json, or a hub id the run
    can reach. Its config.json is read; its weights are not."""
    from pipelines.models.loading import resolve_model

    try:
        source = resolve_model(params.model)
    except QuantgateError as err:
        return Check("model", FAIL, str(err), "model: in params.yaml: reference, a checkpoint folder with config.json, "
                                              "a .gguf file (or pkg:DIST==VERSION/FILE.gguf), or a hub id org/name")
    if source.kind == "gguf":
        return _gguf_check(source.origin)
    if source.is_reference:
        shipped = SHIPPED_REFERENCE_DIR
        meta = shipped / "recipe.json"
        if not (shipped / "config.json").is_file() or not meta.is_file():
            return Check("model", WARN, "reference: reference_model/ is not complete here; the reference stage "
                                        "trains the model (about 4 min on 2 cores)", "git checkout -- reference_model")
        recorded = json.loads(meta.read_text(encoding="utf-8")).get("recipe", {}).get("reference", {})
        differ = sorted(k for k, v in params.reference.model_dump(mode="json").items() if recorded.get(k) != v)
        if differ:
            return Check("model", OK, f"reference: reference.{', reference.'.join(differ)} differ from the shipped "
                                      "recipe: the reference stage trains it here (about 4 min on 2 cores)")
        return Check("model", OK, f"reference: the shipped model (reference_model/, {_describe_config(shipped / 'config.json')})")
    if source.kind == "local":
        return Check("model", OK, f"{source.location}: {_describe_config(Path(source.location) / 'config.json')}")
    cached = _hub_cached(source.location, "config.json")
    if _offline():
        if cached is None:
            return Check("model", FAIL, f"model: {source.location} is a hub id, but HF_HUB_OFFLINE is set and it is not in "
                                        "the hub cache", f"hf download {source.location} --local-dir DIR, then model: DIR "
                                                         "in params.yaml (or unset HF_HUB_OFFLINE where a hub is reached)")
        return Check("model", OK, f"{source.location}: hub id, in the hub cache ({_describe_config(cached)})")
    return Check("model", OK, f"{source.location}: hub id, downloaded on first use"
                              + (f" ({_describe_config(cached)})" if cached else " (reaching the hub is not checked here)"))


def _gguf_check(spec: str) -> Check:
    """A GGUF model: the file's header (magic, tensor table within the file, an architecture transformers loads) and,
    for a packaged file, its bytes against the package's RECORD; what the reference stage will make of it."""
    from pipelines.models import gguf

    try:
        g = gguf.find(spec)
        info = gguf.check(g)
    except QuantgateError as err:
        return Check("model", FAIL, str(err), "point model: at a complete GGUF file of an architecture transformers "
                                              "loads (bash scripts/setup.sh --profile smollm2 installs the shipped one)")
    types = ", ".join(f"{n} {k}" for k, n in info["tensor_types"].items())
    return Check("model", OK, f"{g.path}: GGUF {info['architecture']} ({info['name']}"
                              f"{', ' + g.package if g.package else ''}), {info['parameters']:,} parameters ({types}); "
                              f"the reference stage dequantizes it to {gguf.STORED_DTYPE} in {REFERENCE_DIR} (the "
                              "baseline keeps the file's quantization grid)")


def _describe_config(path: Path) -> str:
    config = json.loads(path.read_text(encoding="utf-8"))
    arch = ", ".join(config.get("architectures") or []) or config.get("model_type", "?")
    params = _parameter_count(path.parent, config)
    return f"{arch}, {params[0] + params[1]:,} parameters" if params else arch


def _safetensors_shapes(folder: Path) -> list[tuple[str, list[int]]] | None:
    """(name, shape) of every tensor in the folder's safetensors files, from their headers alone."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes = []
    for f in files:
        with f.open("rb") as fh:
            (header_size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_size))
        shapes += [(name, info["shape"]) for name, info in header.items() if name != "__metadata__"]
    return shapes


def _parameter_count(folder: Path | None, config: dict) -> tuple[int, int] | None:
    """(parameters in the decoder's linear layers, the rest): exact from the safetensors headers in `folder` when the
    weights are there, else a Llama-shaped estimate from config.json; None when neither says."""
    shapes = _safetensors_shapes(folder) if folder is not None and folder.is_dir() else None
    if shapes:
        linear = rest = 0
        for name, shape in shapes:
            n = 1
            for d in shape:
                n *= d
            if len(shape) == 2 and ".layers." in f".{name}" and "embed" not in name:
                linear += n
            else:
                rest += n
        return linear, rest
    try:
        h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        inter = config.get("intermediate_size", 4 * h)
        heads = config.get("num_attention_heads", 1)
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or h // heads
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    per_layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter
    return layers * per_layer, vocab * h * (1 if config.get("tie_word_embeddings") else 2) + (2 * layers + 1) * h


def variant_bytes(settings, linear: int, rest: int) -> int:
    """Approximate checkpoint bytes of one variant: quantized decoder linears (bits/8 plus each group's fp16 scale
    and packed zero; int8: 1 byte and a scale per row, taken as 1 byte) and everything else in `dtype`."""
    keep = DTYPE_BYTES[settings.dtype]
    if settings.method == "none":
        return (linear + rest) * keep
    if settings.method == "bnb-int8":
        return linear + rest * keep
    bits = settings.bits or 4
    per_weight = bits / 8 + (2 + bits / 8) / settings.group_size
    return int(linear * per_weight) + rest * keep


def _dvc_cache_dir() -> Path:
    config = Path(".dvc/config")
    if config.is_file():
        import configparser

        parser = configparser.ConfigParser()
        try:
            parser.read(config)
            folder = parser.get("cache", "dir", fallback=None)
        except configparser.Error:
            folder = None
        if folder:
            return (Path(".dvc") / folder).resolve()
    return Path(".dvc/cache").resolve()


def _model_counts(params, source) -> tuple[int, int] | None:
    """(linear, rest) parameters of the model the run quantizes: the reference in the shape params.yaml gives when
    that differs from the shipped recipe (the reference stage then trains it here)."""
    if source.kind == "gguf":  # from the file's tensor table; models/reference may not be built yet
        from pipelines.models import gguf

        try:
            info = gguf.inspect(gguf.find(source.origin).path)
        except QuantgateError:
            return None
        return info["linear_parameters"], info["parameters"] - info["linear_parameters"]
    folder = SHIPPED_REFERENCE_DIR if source.is_reference else Path(source.location)
    config_path = folder / "config.json" if source.kind != "hub" else _hub_cached(source.location, "config.json")
    counts = None
    if config_path is not None and Path(config_path).is_file():
        counts = _parameter_count(folder if source.kind != "hub" else Path(config_path).parent,
                                  json.loads(Path(config_path).read_text(encoding="utf-8")))
    if source.is_reference and counts is not None:
        shipped = json.loads((folder / "recipe.json").read_text(encoding="utf-8")).get("recipe", {}).get("reference", {}) \
            if (folder / "recipe.json").is_file() else {}
        if shipped != params.reference.model_dump(mode="json"):  # trained here in the shape params.yaml gives
            r = params.reference
            counts = _parameter_count(None, {
                "hidden_size": r.hidden_size, "num_hidden_layers": r.layers, "vocab_size": r.vocab_size,
                "intermediate_size": r.intermediate_size, "num_attention_heads": r.heads, "num_key_value_heads": r.kv_heads})
    return counts


def disk_check(params) -> Check:
    """Free disk where models/ and DVC's cache are against the checkpoints this run writes (an estimate, stated)."""
    from pipelines.models.loading import resolve_model

    try:
        source = resolve_model(params.model)
    except QuantgateError:
        return Check("disk", WARN, "no estimate: the model is not found (see model)")
    counts = _model_counts(params, source)
    models_free = shutil.disk_usage(existing(MODELS_DIR)).free
    if counts is None:
        return Check("disk", WARN, f"{size(models_free)} free at models/; no estimate (the model's "
                                   "config.json is not on this machine)")
    linear, rest = counts
    parts = {name: variant_bytes(v, linear, rest) for name, v in params.variants.items()}
    if source.kind == "gguf":  # dequantized to float16 by the reference stage
        parts[str(REFERENCE_DIR)] = (linear + rest) * 2
    if source.is_reference:  # the shipped files copied, or a model of the same float16 shape trained
        folder = SHIPPED_REFERENCE_DIR
        shipped = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0
        parts[str(REFERENCE_DIR)] = max(shipped, (linear + rest) * 2)
    for name, cand in params.candidates.items():
        path = Path(cand.path)
        parts[name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
    checkpoints = int(sum(parts.values()) * 1.1)
    cache = _dvc_cache_dir()
    same_disk = os.stat(existing(MODELS_DIR)).st_dev == os.stat(existing(cache)).st_dev
    needed = checkpoints * 2 if same_disk else checkpoints
    estimate = (f"{linear + rest:,} parameters -> {size(checkpoints)} of checkpoints "
                f"({', '.join(f'{k} {size(v)}' for k, v in parts.items())}, +10%)"
                + (", x2 for DVC's cache copy on the same disk" if same_disk else ""))
    if not same_disk:
        cache_free = shutil.disk_usage(existing(cache)).free
        if cache_free < checkpoints:
            return Check("disk", FAIL, f"{size(cache_free)} free at DVC's cache {cache}, needs about "
                                       f"{size(checkpoints)}: {estimate}", "free space there, or move the cache "
                                                                          "(dvc cache dir PATH)")
    if models_free < needed:
        return Check("disk", FAIL, f"{size(models_free)} free at models/, needs about {size(needed)}: {estimate}",
                     "free space on that disk, or fewer variants")
    return Check("disk", OK, f"{size(models_free)} free at models/, needs about {size(needed)} (estimate: {estimate})")
