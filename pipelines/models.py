"""Which model is under test, and where its weights come from.

`model:` in params.yaml is `reference` (the embedded model this project trains), a local Hugging
Face checkpoint directory, or a hub id (`org/name`) for users with hub access.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipelines.errors import QuantgateError
from pipelines.params import HUB_ID

REFERENCE_DIR = Path("models/reference")


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
