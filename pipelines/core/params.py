"""params.yaml as typed settings: a misspelled key or a wrong type stops with file, line and key.

Every stage reads its settings through `load_params()`, so the same checks guard `dvc repro`,
`dvc exp run -S ...` and the CLI. The sections' models are in params_sections and params_requests; this module
holds the whole (`Params`: each request type declared once, handed to the sections that need it, and the checks
across sections) and the loader that turns a validation error into file, line and key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pipelines.core.errors import QuantgateError
from pipelines.core.params_requests import (DEFAULT_POLICY, REQUEST_NAME, RESERVED_REQUEST_NAMES, RequestParams,
                                            Section, shipped_requests)
from pipelines.core.params_candidates import BaselineParams, CandidateParams
from pipelines.core.params_gpus import GpusParams
from pipelines.core.params_sections import (DEFAULT_VARIANTS, CalibrationParams, CompareParams,
                                            CoverageParams, EvaluateParams, FanoutParams, MemoryParams, MlflowParams,
                                            QuantizeParams, ReferenceParams, RouteParams, VariantParams)
from pipelines.core.paths import PARAMS_FILE, PROFILE_MARKER

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
VARIANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,40}$")


# The sections' per-request-type parts that Params fills from `requests` (each type is declared there only)
DERIVED_FROM_REQUESTS = {"calibration": {"sources"}, "coverage": {"classify"}, "evaluate": {"probes", "tasks"}}


class AuditParams(Section):
    """`quantgate audit` (and `gate --audit`): how much recorded evidence is re-measured, and how far a re-measured
    number may sit from its record (docs/record-gate.md, "Audit": the tolerances are set above measured noise)."""

    items: int = Field(8, ge=4)  # per variant x request type: recorded items re-generated and re-scored
    texts: int = Field(2, gt=0)  # per variant x request type: fidelity texts re-measured
    logprob_tolerance: float = Field(0.25, gt=0, le=0.5)  # nats: a log-likelihood or a per-token log-prob
    kl_tolerance: float = Field(0.025, gt=0, le=0.1)  # nats: a per-token KL (a tenth of the shipped max_kl at most)
    # re-scored items of one variant x request type that may disagree (a near tie decoded the other way in a batch of
    # other neighbours); more is refused. 0 refuses any. Measured: docs/record-gate.md, "Audit"
    max_mismatched_items: int = Field(1, ge=0, le=2)

    @model_validator(mode="after")
    def _can_refuse(self):
        if 2 * self.max_mismatched_items >= self.items:
            raise ValueError(f"audit.max_mismatched_items ({self.max_mismatched_items}) must be under half of "
                             f"audit.items ({self.items}): otherwise the item check can never refuse")
        return self


class ShadowParams(Section):
    """`quantgate shadow`: replay a traffic log through fp16 and every passing variant (docs/params.md, `shadow`).
    Here rather than in params_sections, which is at the 400-line limit."""

    traffic: str | None = None  # None: coverage.traffic, the production sample the classifier is checked on
    kind: Literal["auto", "jsonl", "parquet", "csv"] = "auto"  # auto: from the file's suffix
    text_field: str = "text"
    id_field: str = "id"  # a row without it is named by its line
    timestamp_field: str | None = None  # seconds (a number) or ISO 8601; only time_compression reads it
    label_field: str = "label"
    reference_field: str | None = None  # a reference answer: outcome = "the answer contains it"
    max_new_tokens: int = Field(16, ge=1, le=512)
    max_batch: int = Field(8, ge=1, le=256)
    time_compression: float | None = Field(None, gt=0)  # None: back to back; F: wait (t_i - t_0) / F between arrivals
    store: Literal["masked", "hashes"] = "masked"  # answers.jsonl: PII-masked text, or only sha256 and length
    timeout_s: float = Field(600, gt=0)  # per model's replay process
    threads: int = Field(1, gt=0)  # torch threads per replay process: 1, see docs/params.md
    min_requests: int = Field(20, ge=1)  # per type (and bucket) for the routing table to listen to its agreement

    @model_validator(mode="after")
    def _compression_needs_timestamps(self):
        if self.time_compression is not None and not self.timestamp_field:
            raise ValueError("time_compression needs shadow.timestamp_field (the field that holds each request's "
                             "arrival time); without it the replay would run back to back and ignore time_compression")
        return self


class Params(Section):
    """The whole of params.yaml.

    `requests` comes first: the sections that need a request type's declaration (calibration sources, classifier
    rules, probes, tasks, policy) receive it from there, so each type is declared in one place only."""

    requests: dict[str, RequestParams] = Field(default_factory=shipped_requests)
    model: str = "reference"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: GpusParams = GpusParams()
    reference: ReferenceParams = ReferenceParams()
    calibration: CalibrationParams = Field(default_factory=CalibrationParams, validate_default=True)
    coverage: CoverageParams = Field(default_factory=CoverageParams, validate_default=True)
    variants: dict[str, VariantParams] = Field(default_factory=lambda: dict(DEFAULT_VARIANTS))
    candidates: dict[str, CandidateParams] = {}
    baseline: BaselineParams = BaselineParams()  # fp16's answers: evaluated here, or a sample log from elsewhere
    quantize: QuantizeParams = QuantizeParams()
    memory: MemoryParams = MemoryParams()
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams, validate_default=True)
    compare: CompareParams = Field(default_factory=CompareParams, validate_default=True)
    route: RouteParams = RouteParams()
    mlflow: MlflowParams = MlflowParams()
    fanout: FanoutParams = FanoutParams()
    audit: AuditParams = AuditParams()
    shadow: ShadowParams = ShadowParams()

    @field_validator("requests")
    @classmethod
    def _request_names(cls, value: dict):
        for name in value:
            if not REQUEST_NAME.match(name) or name in RESERVED_REQUEST_NAMES:
                raise ValueError(f"request type name {name!r}: lowercase letters, digits and '_', starting with a "
                                 f"letter, and not {', '.join(RESERVED_REQUEST_NAMES)}")
        if not value:
            raise ValueError("declare at least one request type")
        return value

    @field_validator("calibration", "coverage", "evaluate", "compare", mode="before")
    @classmethod
    def _from_requests(cls, value, info: ValidationInfo):
        """Fill a section's per-type part from `requests`; params.yaml may not declare it anywhere else."""
        requests = info.data.get("requests")
        if requests is None:  # `requests` itself is invalid: its error is reported
            return value
        raw = value.model_dump() if isinstance(value, BaseModel) else dict(value or {})
        given = isinstance(value, dict)
        section = info.field_name
        if section == "calibration":
            if given and "sources" in raw:
                raise ValueError("calibration.sources: declare a request type's sources under "
                                 "requests.<name>.calibration")
            raw["sources"] = [{**src.model_dump(), "domain": name} for name, r in requests.items()
                              for src in r.calibration]
        elif section == "coverage":
            if given and "classify" in raw:
                raise ValueError("coverage.classify: declare the classifier's rules under requests.<name>.classify")
            raw["classify"] = {name: r.classify.model_dump() for name, r in requests.items()}
        elif section == "evaluate":
            for key in ("probes", "tasks"):
                if given and key in raw:
                    raise ValueError(f"evaluate.{key}: declare them under requests.<name>.{key}")
            raw["probes"] = {name: r.probes.model_dump() for name, r in requests.items()}
            if not given or "domains" not in raw:
                raw["domains"] = list(requests)
            raw["tasks"] = {name: [t.model_dump() for t in r.tasks] for name, r in requests.items() if r.tasks}
        else:
            policy = dict(raw.get("policy") or {"default": DEFAULT_POLICY.model_dump()})
            if given and set(policy) - {"default"}:
                raise ValueError(f"compare.policy.{sorted(set(policy) - {'default'})[0]}: declare a request type's "
                                 "limits under requests.<name>.policy (compare.policy holds only default)")
            policy.update({name: r.policy.model_dump() for name, r in requests.items() if r.policy is not None})
            raw["policy"] = policy
        return raw

    @model_validator(mode="after")
    def _names(self):
        names = list(self.variants) + list(self.candidates)
        for name in names:
            if not VARIANT_NAME.match(name):
                raise ValueError(f"variant/candidate name {name!r}: use lowercase letters, digits, '-' and '_'")
        if "fp16" not in self.variants or self.variants["fp16"].method != "none":
            raise ValueError("variants.fp16 with method 'none' is required: it is the baseline every variant is judged against")
        unknown = sorted(set(self.fanout.per_variant) - set(names))
        if unknown:
            raise ValueError(f"fanout.per_variant: {unknown[0]!r} is no variant or candidate")
        clash = set(self.variants) & set(self.candidates)
        if clash:
            raise ValueError(f"{sorted(clash)[0]!r} is both a variant and a candidate; names must be unique")
        return self

    def registered_model_name(self) -> str:
        """The registry name for this base model's quantized versions (one per model, never mixed)."""
        return self.mlflow.registered_model or "quantgate-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", self.model).strip("-")

    def judged_elsewhere(self) -> dict[str, list[str]]:
        """Per candidate judged from its lm-eval sample log: the checks its team declared measured elsewhere."""
        return {name: list(c.judged_elsewhere) for name, c in self.candidates.items() if c.judged_elsewhere}

    def model_under_test(self, name: str) -> VariantParams | CandidateParams:
        if name in self.variants:
            return self.variants[name]
        if name in self.candidates:
            return self.candidates[name]
        raise QuantgateError(f"params.yaml: no variant or candidate named {name!r} "
                             f"(variants: {', '.join(self.variants)}; candidates: {', '.join(self.candidates) or 'none'})")


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
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f", got {got!r}"  # a whole section says nothing
    msg = err["msg"][:1].lower() + err["msg"][1:]  # keep the rest's case: names and expressions are quoted as written
    return f"{where}: key '{key}': {msg}{shown}"


def profile_hint(root: Path = Path(".")) -> str:
    """After an error about a setting: in a profile's workspace, where params.yaml is written from the checkout's
    profiles/NAME.yaml (`quantgate profile`), the file to edit instead; elsewhere nothing."""
    try:
        marker = json.loads((root / PROFILE_MARKER).read_text(encoding="utf-8"))
        name, checkout = marker["profile"], marker["store_root"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return (f" (this workspace's params.yaml is written from {checkout}/params.yaml with profiles/{name}.yaml merged "
            f"over it: edit those, then `bash scripts/run.sh --model {name}` there)")


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
        raise QuantgateError(_describe(first, path, root) + more + profile_hint(path.parent)) from None
