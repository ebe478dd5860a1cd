"""params.yaml as typed settings: a misspelled key or a wrong type stops with file, line and key.

Every stage reads its settings through `load_params()`, so the same checks guard `dvc repro`,
`dvc exp run -S ...` and the CLI.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pipelines.core.errors import QuantgateError
from pipelines.core.paths import PARAMS_FILE

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Section(BaseModel):
    """A params.yaml section: unknown keys are errors, so a typo never silently means 'default'."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ReferenceParams(Section):
    """The embedded reference model: its size, its training and its skill check."""

    seed: int = 0
    vocab_size: int = Field(2048, ge=300)
    hidden_size: int = Field(128, gt=0, multiple_of=32)
    intermediate_size: int = Field(512, gt=0, multiple_of=32)
    comment_channels: int = Field(16, ge=0)  # hidden channels only the comment-only tokens use (docs/reference-model.md)
    weight_noise: float = Field(0.05, ge=0, lt=1)  # training noise on linear weights, x each row's max |w|
    layers: int = Field(2, gt=0)
    heads: int = Field(4, gt=0)
    kv_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(256, ge=64)
    seq_len: int = Field(64, ge=16)
    batch_size: int = Field(16, gt=0)
    steps: int = Field(4000, gt=0)
    learning_rate: float = Field(3e-3, gt=0)
    threads: int = Field(2, gt=0)
    held_out_additions: int = Field(1000, gt=0)
    addition_repeats: int = Field(3, ge=1)
    math_lines: int = Field(3000, ge=0)
    dialogues: int = Field(600, ge=24)
    code_repeats: int = Field(2, ge=0)
    function_repeats: int = Field(3, ge=0)  # small functions (the code probes' kind), held-out ones excluded
    commented_functions: int = Field(3000, ge=0)  # the same functions with Chinese comments and neutral names
    commented_repeats: int = Field(2, ge=0)

    @model_validator(mode="after")
    def _channels(self):
        if self.comment_channels >= self.hidden_size:
            raise ValueError(f"comment_channels ({self.comment_channels}) must be below hidden_size ({self.hidden_size})")
        return self
    eval_items: int = Field(200, gt=0)


REQUEST_NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
RESERVED_REQUEST_NAMES = ("default", "unknown", "ambiguous")  # compare.policy.default; the classifier's undecided
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SOURCE_KINDS = ("python_code", "python_comments", "math", "jsonl", "parquet", "csv", "hf")


class ClassifyParams(Section):
    """How the classifier recognises a request type (docs/request-types.md): named regular expressions, whose
    match counts a `when` expression combines with the built-in counts `code_lines`, `comment_lines` and `chars`.
    Of the types whose `when` holds, the highest `priority` wins; a tie there is ambiguous (served by fp16)."""

    patterns: dict[str, str] = {}
    when: str = "false"
    priority: int = 0

    @model_validator(mode="after")
    def _compiles(self):
        from pipelines.text.classify import Rule  # the classifier owns the expression language

        Rule.compile("", self.model_dump())  # raises ValueError naming the bad pattern or expression
        return self


class ProbeParams(Section):
    """A request type's probes: the lm-eval task in eval/<name>/ over eval/<name>/items.jsonl, the per-item metric
    that says correct, the fields every item needs, and the item as plain text (a Jinja template) for fidelity."""

    task: str
    metric: str = "exact_match"
    fields: list[str] = ["id", "prompt", "answer"]
    text: str = "{{prompt}} {{answer}}"
    runs_code: bool = False  # its metric runs model-written code: only in the sandbox

    @model_validator(mode="after")
    def _check(self):
        if "id" not in self.fields:
            raise ValueError("fields must include 'id' (items are paired across variants by it)")
        if not self.task.startswith("quantgate_") or not TASK_NAME.match(self.task):
            raise ValueError(f"probe task {self.task!r}: name it quantgate_<something> (its YAML in eval/<type>/); "
                             "lm-eval's own tasks go under `tasks`")
        return self


class SourceParams(Section):
    """Where one request type's calibration text comes from (`domain`: filled from `requests.<name>`).

    `python_code` / `python_comments`: a folder of .py files (code alone / comment + code);
    `math`: the seeded math generator (`count` samples); `jsonl`, `parquet`, `csv`: a local file with a
    `text_field`; `hf`: a Hugging Face `datasets` source (`name`, `config`, `split`, `text_field`).
    """

    domain: str = ""
    kind: Literal["python_code", "python_comments", "math", "jsonl", "parquet", "csv", "hf"]
    path: str | None = None
    text_field: str = "text"
    count: int = Field(2000, gt=0)
    name: str | None = None
    config: str | None = None
    split: str = "train"

    @model_validator(mode="after")
    def _needs_location(self):
        if self.kind == "hf" and not self.name:
            raise ValueError("kind 'hf' needs 'name' (a datasets name)")
        if self.kind not in ("hf", "math") and not self.path:
            raise ValueError(f"kind '{self.kind}' needs 'path'")
        return self


DEFAULT_SOURCES = (
    SourceParams(domain="code", kind="python_code", path="calibration_sets/sources/code"),
    SourceParams(domain="code_comment", kind="python_comments", path="calibration_sets/sources/code"),
    SourceParams(domain="code_comment", kind="jsonl", path="calibration_sets/sources/code_comment/zh_functions.jsonl"),
    SourceParams(domain="math", kind="math", count=2000),
    SourceParams(domain="chat", kind="jsonl", path="calibration_sets/sources/chat/dialogues.jsonl"),
)


# The shipped request types' probes and classifier rules (their whole declaration: DEFAULT_REQUESTS)
DEFAULT_PROBES = {
    "math": ProbeParams(task="quantgate_math", fields=["id", "question", "answer"], text="{{question}}{{answer}}"),
    "code": ProbeParams(task="quantgate_code", metric="pass@1", fields=["id", "prompt", "canonical", "tests"],
                        text="{{prompt}}{{canonical}}", runs_code=True),
    "chat": ProbeParams(task="quantgate_chat", metric="acc", fields=["id", "context", "choices", "gold"],
                        text="{{context}}{{choices[gold]}}"),
    "code_comment": ProbeParams(task="quantgate_code_comment"),
}
DEFAULT_CLASSIFY = {
    "math": ClassifyParams(patterns={
        "symbol": r"[√×÷±≤≥≠π∑∫²³]|\\(frac|sqrt|times|div|cdot|sum|int|pi|le|ge)\b|\^\d",
        "arithmetic": r"\d\s*[-+*/×÷^=]\s*[\d(√\\]|\(\s*\d",
        "ask": r"(?i)\b(solve|compute|calculate|simplify|evaluate|equation|fraction|square root)\b|计算|求解|等于多少"},
        when="symbol + arithmetic >= 2 or (symbol + arithmetic >= 1 and (ask >= 1 or chars < 40))", priority=10),
    "code": ClassifyParams(when="code_lines >= 2", priority=20),
    "chat": ClassifyParams(when="true", priority=0),
    "code_comment": ClassifyParams(patterns={
        "ask": r"(?i)\b(comment|comments|commented|docstring|docstrings|document (this|the) (code|function)|"
               r"annotate)\b|注释|文档字符串"},
        when="(comment_lines >= 1 and (code_lines >= 1 or ask >= 1)) or (code_lines >= 1 and ask >= 1)",
        priority=30),
}


class CalibrationParams(Section):
    """The calibration recipe: how many samples of which domain, how long, how deduplicated."""

    seed: int = 0
    samples: int = Field(512, gt=0)
    weights: dict[str, float] = {}  # a declared request type left out weighs 1.0
    min_tokens: int = Field(16, gt=0)
    max_tokens: int = Field(192, gt=0)
    near_duplicate_jaccard: float = Field(0.8, gt=0, le=1)
    exclude: list[str] = []
    # from requests.<name>.calibration (Params fills it; params.yaml declares sources only there)
    sources: list[SourceParams] = Field(default_factory=lambda: list(DEFAULT_SOURCES))

    @model_validator(mode="after")
    def _check(self):
        types = sorted({s.domain for s in self.sources})
        unknown = [d for d in [*self.exclude, *self.weights] if d not in types]
        if unknown:
            raise ValueError(f"unknown request type {unknown[0]!r} in calibration.exclude or weights; declared: "
                             f"{', '.join(types)}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}")
        if any(w < 0 for w in self.weights.values()):
            raise ValueError("weights must be >= 0")
        if not self.domains:
            raise ValueError("every request type is excluded or has weight 0")
        return self

    @property
    def domains(self) -> list[str]:
        """Request types this recipe samples, in name order (the set does not depend on declaration order)."""
        return [d for d in sorted({s.domain for s in self.sources})
                if d not in self.exclude and self.weights.get(d, 1.0) > 0]

    def weight(self, domain: str) -> float:
        return self.weights.get(domain, 1.0)


class CoverageParams(Section):
    """How the calibration set is checked against a sample of production traffic."""

    traffic: str = "calibration_sets/traffic/production_sample.jsonl"
    text_field: str = "text"
    min_share_ratio: float = Field(0.5, ge=0)
    ngram: int = Field(3, gt=0)
    on_gap: Literal["warn", "fail"] = "warn"
    min_classifier_accuracy: float = Field(0.8, ge=0, le=1)  # flag a request type the classifier recognises less often
    label_field: str = "label"  # the traffic sample's field that holds each request's true type (if labelled)
    # from requests.<name>.classify (Params fills it): the classifier's rules, one entry per request type
    classify: dict[str, ClassifyParams] = Field(default_factory=lambda: dict(DEFAULT_CLASSIFY))


METHODS = ("none", "bnb-int8", "awq", "gptq")
CALIBRATED_METHODS = ("awq", "gptq")  # the methods that read a calibration set


class VariantParams(Section):
    """One quantized variant the pipeline makes: a method and its settings."""

    method: Literal["none", "bnb-int8", "awq", "gptq"]
    bits: int | None = None
    group_size: int = Field(128, gt=0)
    sym: bool = True  # gptq: symmetric quantization
    zero_point: bool = True  # awq: asymmetric (zero point) quantization
    desc_act: bool = False  # gptq: activation-order column permutation
    damp_percent: float | None = Field(None, gt=0, lt=1)  # gptq: Hessian damping, share of its mean diagonal (None: GPTQModel's 0.05)
    duo_scaling: bool | None = None  # awq (autoawq): scales from activations and weights (None: autoawq's True)
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"  # weights left unquantized
    backend: Literal["auto", "autoawq", "gptqmodel"] = "auto"

    @model_validator(mode="after")
    def _check(self):
        allowed = {"none": {None}, "bnb-int8": {None, 8}, "awq": {4}, "gptq": {2, 3, 4, 8}}[self.method]
        if self.bits not in allowed:
            want = " or ".join(str(b) for b in sorted(b for b in allowed if b)) or "no bits"
            raise ValueError(f"method '{self.method}' takes bits {want}, got {self.bits}")
        if self.backend == "gptqmodel" and self.method not in ("awq", "gptq"):
            raise ValueError(f"backend 'gptqmodel' applies to awq and gptq, not {self.method}")
        if self.backend == "autoawq" and self.method != "awq":
            raise ValueError(f"backend 'autoawq' applies to awq, not {self.method}")
        if self.duo_scaling is not None and self.method != "awq":
            raise ValueError(f"duo_scaling applies to awq, not {self.method}")
        if self.duo_scaling is False and self.backend == "gptqmodel":
            raise ValueError("duo_scaling: false needs backend autoawq (or auto): GPTQModel 7.6's AWQ always scales by "
                             "activations and weights")
        return self


class QuantizeParams(Section):
    """Settings of every quantize stage (a variant's own settings are under `variants`)."""

    timeout_seconds: int = Field(43200, gt=0)  # the quantizing process is killed (the variant fails) after this


class CandidateParams(Section):
    """A third-party quantized checkpoint: validated before anything loads it, then judged like a variant."""

    path: str


DEFAULT_VARIANTS = {
    "fp16": VariantParams(method="none", dtype="float16"),
    "int8": VariantParams(method="bnb-int8"),
    "awq4": VariantParams(method="awq", bits=4, group_size=32, duo_scaling=False, backend="autoawq"),
    "gptq3": VariantParams(method="gptq", bits=3, group_size=32, sym=False, desc_act=True, backend="gptqmodel"),
}
VARIANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,40}$")


class MemoryParams(Section):
    """Workload of the memory stage, scaled to the model's context limit (max_position_embeddings)."""

    max_tokens: int = Field(4096, gt=1)  # cap on the context used, for models with huge limits
    seq_fractions: list[float] = [0.125, 0.25, 0.5, 1.0]
    decode_tokens: int = Field(8, gt=0)
    warmup_rounds: int = Field(2, ge=0)  # unmeasured rounds first
    rounds: int = Field(12, ge=10)  # measured rounds at least; also the horizon growth is projected over
    max_rounds: int = Field(48, ge=10)  # while memory has not settled, measure more rounds, up to this
    tail_rounds: int = Field(8, ge=4)  # settled = no rise above the noise floor for at least this many rounds
    burst_size: int = Field(4, gt=0)  # long requests batched together per round
    alternations: int = Field(4, ge=2)  # short/long requests alternating per round
    long_fraction: float = Field(0.9, gt=0, le=1)
    short_fraction: float = Field(0.1, gt=0, le=1)
    leak_tolerance_pct: float = Field(1.0, gt=0)  # unsettled growth over `rounds` rounds, % of the load footprint
    noise_floor_bytes: int = Field(8192, ge=0)  # rises above a settled level up to this are noise (docs/memory.md)
    timeout_seconds: int = Field(1800, gt=0)  # the measuring process is killed after this
    sweep_batch: int = Field(8, gt=0)
    threads: int = Field(2, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if not self.seq_fractions or any(not 0 < f <= 1 for f in self.seq_fractions):
            raise ValueError("seq_fractions must be fractions in (0, 1]")
        if not self.tail_rounds <= self.rounds <= self.max_rounds:
            raise ValueError(f"need tail_rounds <= rounds <= max_rounds, got {self.tail_rounds}, {self.rounds}, "
                             f"{self.max_rounds}")
        return self




SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$")
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_gpu_share(value: Any) -> int | float:
    """One GPU's share: bytes (an int, or a string like '70GiB' / '80GB'), or a fraction (0, 1] of its memory.

    Returns int bytes or a float fraction; anything else raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{value} bytes: a GPU's share must be positive")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"{value}: a fraction of a GPU's memory must be in (0, 1]")
        return value
    if isinstance(value, str):
        m = SIZE.match(value)
        if m:
            n = int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
            if n > 0:
                return n
        raise ValueError(f"{value!r}: write a size like '70GiB', '80GB' or '512MiB' (or bytes, or a fraction 0-1)")
    raise ValueError(f"{value!r} is not a size (bytes, '70GiB', or a fraction of the GPU's memory)")


class GpusParams(Section):
    """How much of each visible GPU the fp16 and int8 variants may use when they load across GPUs.

    `max_memory`: null (every visible GPU, accelerate's own free-memory figure), one share for every visible GPU
    ('70GiB', 0.9, bytes), or a mapping GPU index -> share ({0: 70GiB, 1: 70GiB}; GPUs left out get nothing).
    Setting it on a one-GPU machine caps that GPU too. GPTQ and AWQ keep their backends' own placement."""

    max_memory: int | float | str | dict[int, int | float | str] | None = None

    @field_validator("max_memory")
    @classmethod
    def _shares(cls, value):
        if isinstance(value, dict):
            if not value:
                raise ValueError("an empty mapping gives the model no GPU; leave max_memory null for every GPU")
            for index, share in value.items():
                if index < 0:
                    raise ValueError(f"GPU index {index}: indices start at 0")
                try:
                    parse_gpu_share(share)
                except ValueError as err:
                    raise ValueError(f"GPU {index}: {err}") from None
        elif value is not None:
            parse_gpu_share(value)
        return value

    def shares(self) -> dict[int | str, int | float] | None:
        """The setting parsed: {gpu index: bytes or fraction}, {"all": share}, or None."""
        if self.max_memory is None:
            return None
        if isinstance(self.max_memory, dict):
            return {i: parse_gpu_share(v) for i, v in sorted(self.max_memory.items())}
        return {"all": parse_gpu_share(self.max_memory)}


class TaskParams(Section):
    """A standard lm-eval task judged beside a domain's probes (a bare name in params.yaml means just `name`)."""

    name: str
    data_files: dict[str, str] | None = None  # split -> local file (read as JSON lines) instead of the task's hub dataset
    num_fewshot: int | None = Field(None, ge=0)  # None: the task's own
    filter: str | None = None  # the filter whose answer scores an item; None: the task's first
    metric: str | None = None  # the per-item metric that says correct; None: the task's first

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, value):
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self):
        if not TASK_NAME.match(self.name) or self.name.startswith("quantgate_"):
            raise ValueError(f"task name {self.name!r}: an lm-eval task name (letters, digits, '_', '.', '-'), "
                             "not one of quantgate's probe tasks")
        if self.data_files is not None and not self.data_files:
            raise ValueError(f"task {self.name!r}: data_files is empty")
        return self


class EvaluateParams(Section):
    """Probes through lm-eval and token-level fidelity against fp16."""

    # the request types evaluated, in this order; left out of params.yaml: every declared one, in declaration order
    domains: list[str] = Field(default_factory=lambda: list(DEFAULT_PROBES))
    allow_unisolated_code: bool = False  # run code probes even where the sandbox cannot isolate
    batch_size: int = Field(16, gt=0)  # fixed: lm-eval scores can move with batch size
    look_items: int = Field(200, gt=0)  # the first look judges this many items
    max_looks: int = Field(3, ge=1)  # looks up to the cap, evenly spaced; fewer looks, more false-pass budget each
    max_items: int | None = Field(None, gt=0)  # cap on the items a domain is judged on; None = the whole pool
    fidelity_texts: int = Field(50, gt=0)  # held-out texts per domain
    top_k: int = Field(64, gt=0)  # stored base log-probs per token
    # from requests.<name> (Params fills them): each type's probes, and standard lm-eval tasks judged beside them as
    # rows `<domain>:<task>` (docs/evaluate.md)
    probes: dict[str, ProbeParams] = Field(default_factory=lambda: dict(DEFAULT_PROBES))
    tasks: dict[str, list[TaskParams]] = {}

    @model_validator(mode="after")
    def _check_tasks(self):
        unknown = [d for d in [*self.domains, *self.tasks] if d not in self.probes]
        if unknown:
            raise ValueError(f"unknown request type {unknown[0]!r} in evaluate; declared: {', '.join(self.probes)}")
        seen: set[str] = set()
        for domain, specs in self.tasks.items():
            if specs and domain not in self.domains:
                raise ValueError(f"tasks for domain {domain!r}, which evaluate.domains leaves out")
            for spec in specs:
                if spec.name in seen:
                    raise ValueError(f"task {spec.name!r} is listed twice; a task is judged once, under one domain")
                seen.add(spec.name)
        return self
    timeout_seconds: int = Field(21600, gt=0)  # a model's evaluating process is killed after this (baseline: fatal)


KL_PERCENTILES = ("mean", "median", "p90", "p95", "p99", "p99_9", "max")


class PolicyParams(Section):
    """Gate limits for one domain; a key left out comes from `compare.policy.default`."""

    max_accuracy_drop: float | None = Field(None, ge=0, le=1)  # non-inferiority margin, judged on the CI's low end
    max_flip_rate: float | None = Field(None, ge=0, le=1)  # (correct->wrong + wrong->correct) / items
    kl_percentile: Literal["mean", "median", "p90", "p95", "p99", "p99_9", "max"] | None = None
    max_kl: float | None = Field(None, ge=0)  # nats, at kl_percentile
    max_growth_excess_pct: float | None = None  # soak growth beyond fp16's, % of fp16's footprint
    min_memory_saving_pct: float | None = None  # below this saving a passing variant is not worth routing to


DEFAULT_POLICY = PolicyParams(max_accuracy_drop=0.05, max_flip_rate=0.15, kl_percentile="p99", max_kl=1.0,
                              max_growth_excess_pct=1.0, min_memory_saving_pct=10.0)


class CompareParams(Section):
    """Paired A/B of every variant against fp16 and the gate policy that turns it into verdicts."""

    confidence: float = Field(0.95, gt=0.5, lt=1)  # two-sided; (1 - confidence) / 2 is the false-pass rate at the margin
    spending: Literal["pocock", "obrien_fleming"] = "pocock"  # how looks share that rate (Lan-DeMets)
    power: float = Field(0.8, gt=0.5, lt=1)  # planning only: the items that would decide at this power

    @property
    def alpha(self) -> float:
        """One-sided false-pass rate at the margin, over all looks together."""
        return round((1 - self.confidence) / 2, 12)
    policy: dict[str, PolicyParams] = Field(default_factory=lambda: {"default": DEFAULT_POLICY})

    @model_validator(mode="after")
    def _check(self):
        default = self.policy.get("default")
        missing = [k for k, v in DEFAULT_POLICY.model_dump().items() if default is None or getattr(default, k) is None]
        if missing:
            raise ValueError(f"policy.default must set every limit; missing {', '.join(missing)}")
        return self

    def policy_for(self, domain: str) -> PolicyParams:
        """The default limits overlaid with the domain's own."""
        override = self.policy.get(domain)
        merged = self.policy["default"].model_dump()
        if override is not None:
            merged.update({k: v for k, v in override.model_dump().items() if v is not None})
        return PolicyParams(**merged)


class RouteParams(Section):
    """Context-length buckets of the routing table (upper bounds, in tokens)."""

    context_buckets: list[int] = [64, 128, 256]

    @model_validator(mode="after")
    def _check(self):
        if not self.context_buckets or any(b <= 0 for b in self.context_buckets) \
                or self.context_buckets != sorted(set(self.context_buckets)):
            raise ValueError("context_buckets must be positive token counts in increasing order")
        return self


class RequestParams(Section):
    """One request type, declared once: how the classifier recognises it, its calibration sources, its probes,
    standard lm-eval tasks judged beside them, and gate limits that differ from compare.policy.default."""

    classify: ClassifyParams
    calibration: list[SourceParams] = []
    probes: ProbeParams
    tasks: list[TaskParams] = []
    policy: PolicyParams | None = None

    @model_validator(mode="after")
    def _check(self):
        if any(src.domain for src in self.calibration):
            raise ValueError("a calibration source here needs no 'domain': it is this request type's")
        return self


def _shipped_requests() -> dict[str, RequestParams]:
    """math, code, chat, code_comment: the embedded default's request types (params.yaml spells them out)."""
    sources: dict[str, list[SourceParams]] = {}
    for src in DEFAULT_SOURCES:
        sources.setdefault(src.domain, []).append(src.model_copy(update={"domain": ""}))
    return {name: RequestParams(classify=DEFAULT_CLASSIFY[name], calibration=sources[name], probes=probe)
            for name, probe in DEFAULT_PROBES.items()}


class FanoutResources(Section):
    """Ray resources one task of a variant's chain asks for."""

    cpus: float = Field(1, gt=0)
    gpus: float = Field(0, ge=0)


class FanoutParams(Section):
    """`quantgate fanout`: the per-variant chains as Ray tasks (docs/fanout.md)."""

    cpus: float = Field(1, gt=0)  # per task, unless per_variant says otherwise
    gpus: float = Field(0, ge=0)  # e.g. 1 on CUDA; a 70B fp16 baseline: as many as it spans
    per_variant: dict[str, FanoutResources] = {}
    retries: int = Field(1, ge=0)  # Ray re-runs a task whose worker died (node lost, SIGKILL) this often
    timeout_margin_seconds: int = Field(600, gt=0)  # a task is killed after its stage's own timeout plus this


class MlflowParams(Section):
    """Where `record` writes: the experiment, and the registered model that passing variants join."""

    experiment: str = "quantgate"
    registered_model: str | None = None  # None: quantgate-<model>, e.g. quantgate-reference


# The sections' per-request-type parts that Params fills from `requests` (each type is declared there only)
DERIVED_FROM_REQUESTS = {"calibration": {"sources"}, "coverage": {"classify"}, "evaluate": {"probes", "tasks"}}


class Params(Section):
    """The whole of params.yaml.

    `requests` comes first: the sections that need a request type's declaration (calibration sources, classifier
    rules, probes, tasks, policy) receive it from there, so each type is declared in one place only."""

    requests: dict[str, RequestParams] = Field(default_factory=_shipped_requests)
    model: str = "reference"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: GpusParams = GpusParams()
    reference: ReferenceParams = ReferenceParams()
    calibration: CalibrationParams = Field(default_factory=CalibrationParams, validate_default=True)
    coverage: CoverageParams = Field(default_factory=CoverageParams, validate_default=True)
    variants: dict[str, VariantParams] = Field(default_factory=lambda: dict(DEFAULT_VARIANTS))
    candidates: dict[str, CandidateParams] = {}
    quantize: QuantizeParams = QuantizeParams()
    memory: MemoryParams = MemoryParams()
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams, validate_default=True)
    compare: CompareParams = Field(default_factory=CompareParams, validate_default=True)
    route: RouteParams = RouteParams()
    mlflow: MlflowParams = MlflowParams()
    fanout: FanoutParams = FanoutParams()

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
