"""params.yaml as typed settings: a misspelled key or a wrong type stops with file, line and key.

Every stage reads its settings through `load_params()`, so the same checks guard `dvc repro`,
`dvc exp run -S ...` and the CLI.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.errors import QuantgateError

PARAMS_FILE = Path("params.yaml")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Section(BaseModel):
    """A params.yaml section: unknown keys are errors, so a typo never silently means 'default'."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ReferenceParams(Section):
    """The embedded reference model: its size, its training and its skill check."""

    seed: int = 0
    vocab_size: int = Field(2048, ge=300)
    hidden_size: int = Field(128, gt=0, multiple_of=64)
    intermediate_size: int = Field(512, gt=0, multiple_of=64)
    layers: int = Field(2, gt=0)
    heads: int = Field(4, gt=0)
    kv_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(256, ge=64)
    seq_len: int = Field(64, ge=16)
    batch_size: int = Field(16, gt=0)
    steps: int = Field(4000, gt=0)
    learning_rate: float = Field(3e-3, gt=0)
    threads: int = Field(2, gt=0)
    held_out_additions: int = Field(500, gt=0)
    addition_repeats: int = Field(3, ge=1)
    math_lines: int = Field(3000, ge=0)
    dialogues: int = Field(600, ge=24)
    code_repeats: int = Field(2, ge=0)
    eval_items: int = Field(200, gt=0)


class MlflowParams(Section):
    experiment: str = "quantgate"


class Params(Section):
    """The whole of params.yaml."""

    model: str = "reference"
    reference: ReferenceParams = ReferenceParams()
    mlflow: MlflowParams = MlflowParams()


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at `loc` (or of its deepest existing parent)."""
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if match is None:
                break
            line = match[0].start_mark.line + 1
            node = match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _describe(err: dict, path: Path, root: yaml.Node | None) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(k) for k in loc) or "(top level)"
    line = _line_of(root, loc)
    where = f"{path}:{line}" if line else str(path)
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key '{key}' (misspelled? see docs/params.md)"
    return f"{where}: key '{key}': {err['msg'].lower()}, got {err.get('input')!r}"


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Parse and check params.yaml; raise QuantgateError naming the file, line and key on bad input."""
    path = Path(path)
    if not path.is_file():
        raise QuantgateError(f"{path}: params file not found (run from the repository root)")
    text = path.read_text(encoding="utf-8")
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise QuantgateError(f"{path}{line}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise QuantgateError(f"{path}: expected a mapping of settings at the top level")
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise QuantgateError(_describe(first, path, root) + more) from None
