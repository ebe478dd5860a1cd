"""Which model is under test, where its weights come from, and the one loader every stage uses.

`model:` in params.yaml is `reference` (the embedded model this project trains), a local Hugging
Face checkpoint directory, or a hub id (`org/name`) for users with hub access.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipelines.errors import QuantgateError
from pipelines.params import HUB_ID

REFERENCE_DIR = Path("models/reference")
VARIANTS_DIR = Path("models/variants")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "reference", "local" or "hub"
    location: str  # what from_pretrained() takes

    @property
    def is_reference(self) -> bool:
        return self.kind == "reference"


def resolve_model(spec: str) -> ModelSource:
    """Turn the `model:` setting into a source; anything else stops with a one-line reason."""
    if spec == "reference":
        return ModelSource("reference", str(REFERENCE_DIR))
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantgateError(f"params.yaml: model: {spec} is a file; expected a checkpoint directory")
        if not (path / "config.json").is_file():
            raise QuantgateError(f"params.yaml: model: {path} has no config.json; expected a Hugging Face checkpoint")
        return ModelSource("local", str(path))
    if HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return ModelSource("hub", spec)
    raise QuantgateError(
        f"params.yaml: model: {spec!r} is not 'reference', an existing checkpoint directory, "
        "or a hub id of the form org/name"
    )


def load_tokenizer(source: ModelSource):
    """The model's own tokenizer: token counts everywhere are measured with it."""
    from transformers import AutoTokenizer

    if source.is_reference and not (Path(source.location) / "tokenizer.json").is_file():
        raise QuantgateError(f"{source.location}: no tokenizer; run `dvc repro reference` (or quantgate reference) first")
    try:
        return AutoTokenizer.from_pretrained(source.location)
    except (OSError, ValueError) as err:
        raise QuantgateError(f"model {source.location}: cannot load its tokenizer ({str(err).splitlines()[0]})") from None


class VariantFailed(QuantgateError):
    """The variant has no usable checkpoint (quantization or validation failed); the error says why."""


def dtype_of(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def resolve_device(setting: str) -> str:
    """`auto` picks CUDA when a GPU is visible, else the CPU; `cuda` without a GPU is an error."""
    import torch

    if setting == "cuda" and not torch.cuda.is_available():
        raise QuantgateError("params.yaml: device: cuda, but torch sees no CUDA device (CPU build or no GPU)")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def variant_manifest(variant_dir: str | Path) -> dict:
    """The variant's quantgate.json; a missing one means the variant was never built."""
    from pipelines.io import read_json

    path = Path(variant_dir) / "quantgate.json"
    if not path.is_file():
        raise VariantFailed(f"{variant_dir}: no quantgate.json; run its quantize/admit stage first")
    return read_json(path)


def load_variant(variant_dir: str | Path, device: str = "cpu"):
    """(model, tokenizer) for any variant or admitted candidate, in eval mode, on `device`.

    Raises VariantFailed when the variant's quantization or validation failed, with the recorded error.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.logs import library_output

    manifest = variant_manifest(variant_dir)
    if manifest.get("status") != "ok":
        reasons = manifest.get("error") or "; ".join(manifest.get("reasons", [])) or "unknown"
        raise VariantFailed(f"variant {manifest.get('variant', variant_dir)} is not usable: {reasons}")
    method = manifest["method"]
    location = str(variant_dir)
    with library_output(method):
        if method == "gptq":  # transformers needs optimum for GPTQ; GPTQModel loads its own format
            from gptqmodel import GPTQModel

            model = GPTQModel.load(location, device=device, dtype=dtype_of(manifest["dtype"])).model
        elif method == "none":
            model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype_of(manifest["dtype"]), device_map=device)
        else:  # bnb-int8 and awq: transformers reads quantization_config (AWQ runs on GPTQModel's kernels)
            model = AutoModelForCausalLM.from_pretrained(location, device_map=device)
        tokenizer = AutoTokenizer.from_pretrained(location)
    model.eval()
    return model, tokenizer
