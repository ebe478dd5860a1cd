"""params.yaml's per-stage sections: the reference model, calibration and coverage, variants, quantize, memory,
evaluate, compare, route, fanout, mlflow (gpus: params_gpus; candidates: params_candidates). Their per-request-type parts
(sources, classifier rules, probes, tasks, policies) are params_requests' models, filled from `requests` by
params.Params.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params_requests import (DEFAULT_CLASSIFY, DEFAULT_POLICY, DEFAULT_PROBES, DEFAULT_SOURCES,
                                            ClassifyParams, PolicyParams, ProbeParams, Section, SourceParams,
                                            TaskParams, bounded, listed_once)


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
    eval_items: int = Field(200, gt=0)

    @model_validator(mode="after")
    def _channels(self):
        if self.comment_channels >= self.hidden_size:
            raise ValueError(f"comment_channels ({self.comment_channels}) must be below hidden_size ({self.hidden_size})")
        return self


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

    _exclude_once = field_validator("exclude")(listed_once)

    @model_validator(mode="after")
    def _check(self):
        types = sorted({s.domain for s in self.sources})
        for key, names in (("exclude", self.exclude), ("weights", list(self.weights))):
            unknown = [d for d in names if d not in types]
            if unknown:
                raise ValueError(f"unknown request type {unknown[0]!r} in calibration.{key}; declared: "
                                 f"{', '.join(types)}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"calibration.min_tokens {self.min_tokens} is above calibration.max_tokens {self.max_tokens}")
        negative = [d for d, w in self.weights.items() if w < 0]
        if negative:
            raise ValueError(f"calibration.weights.{negative[0]}: must be >= 0 (0 leaves the type out)")
        if not self.domains:
            raise ValueError("every request type is excluded or has weight 0")
        total = sum(self.weight(d) for d in self.domains)
        starved = [d for d in self.domains if self.samples * self.weight(d) / total < 1]  # silently left out
        if starved:
            raise ValueError(f"calibration.samples {self.samples} gives {starved[0]!r} (weight {self.weight(starved[0]):g})"
                             " no sample: raise samples or its weight, or exclude it")
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
    min_share_ratio: Annotated[float, bounded(0, 1, "0 never flags a gap", low_open=True)] = 0.5  # x production share
    ngram: int = Field(3, gt=0)
    on_gap: Literal["warn", "fail"] = "warn"
    min_classifier_accuracy: Annotated[float, bounded(0, 1, "0 never flags a type", low_open=True)] = 0.8  # flag below
    label_field: str = "label"  # the traffic sample's field that holds each request's true type (if labelled)
    # flag when more of the production sample than this is `unknown` (served by fp16, measured by no probe); 1 would
    # never flag, so it is refused (docs/params.md)
    max_unknown_share: float = Field(0.1, ge=0, lt=1)
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
    clip_tokens: int | None = Field(None, ge=0)  # awq (autoawq): tokens its clipping search samples (None: 512; 0: none)

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
        if self.clip_tokens is not None and (self.method != "awq" or self.backend == "gptqmodel"):
            raise ValueError("clip_tokens applies to awq with backend autoawq (or auto)")
        if self.duo_scaling is False and self.backend == "gptqmodel":
            raise ValueError("duo_scaling: false needs backend autoawq (or auto): GPTQModel 7.6's AWQ always scales by "
                             "activations and weights")
        return self


class QuantizeParams(Section):
    """Settings of every quantize stage (a variant's own settings are under `variants`)."""

    timeout_seconds: int = Field(43200, gt=0)  # the quantizing process is killed (the variant fails) after this
    threads: int | None = Field(None, ge=1)  # torch threads of each quantizing process (None: torch's default)


DEFAULT_VARIANTS = {
    "fp16": VariantParams(method="none", dtype="float16"),
    "int8": VariantParams(method="bnb-int8"),
    "awq4": VariantParams(method="awq", bits=4, group_size=32, duo_scaling=False, backend="autoawq"),
    "gptq3": VariantParams(method="gptq", bits=3, group_size=32, sym=False, desc_act=True, backend="gptqmodel"),
}


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
    # unsettled growth over `rounds` rounds, % of the load footprint; rises above a settled level up to the floor are
    # noise (docs/memory.md). Why these bounds: docs/params.md, "Allowed ranges"
    leak_tolerance_pct: Annotated[float, bounded(0, 5, "the incident grew 3-5 %", low_open=True)] = 1.0
    noise_floor_bytes: Annotated[int, bounded(0, 16384, "a floor F hides a leak of F / (tail_rounds - 1) a round")] = 8192
    timeout_seconds: int = Field(1800, gt=0)  # the measuring process is killed after this
    sweep_batch: int = Field(8, gt=0)
    threads: int = Field(2, gt=0)
    # a soak that does not settle runs this many more rounds under a tracer (pipelines/measure/attribution.py)
    trace_rounds: int = Field(24, ge=0)
    # CUDA: the PYTORCH_CUDA_ALLOC_CONF the service runs with (null: the environment's, else PyTorch's default); the
    # stage measures under it, so the routing table's memory cost is the served one
    allocator: str | None = None
    compare_allocators: list[str] = []  # CUDA: also soak under these settings, fragmentation and peak reserved each

    @model_validator(mode="after")
    def _check(self):
        if not self.seq_fractions or any(not 0 < f <= 1 for f in self.seq_fractions):
            raise ValueError("memory.seq_fractions must be fractions in (0, 1]")
        if not self.tail_rounds <= self.rounds <= self.max_rounds:
            raise ValueError(f"need memory.tail_rounds <= memory.rounds <= memory.max_rounds, got {self.tail_rounds}, "
                             f"{self.rounds}, {self.max_rounds}")
        if self.trace_rounds and self.trace_rounds < max(6, self.tail_rounds + 2):
            raise ValueError(f"memory.trace_rounds must be 0 (never trace) or at least max(6, tail_rounds + 2) = "
                             f"{max(6, self.tail_rounds + 2)}: fewer cannot show growth stop; got {self.trace_rounds}")
        if self.short_fraction >= self.long_fraction:  # the soak alternates short and long requests
            raise ValueError(f"memory.short_fraction {self.short_fraction:g} must be below long_fraction {self.long_fraction:g}")
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
    # held-out texts per domain; too few to give KL its 100 tokens leave the row undecided (judging/verdict.py)
    fidelity_texts: int = Field(50, gt=0)
    top_k: int = Field(64, gt=0)  # stored base log-probs per token
    # from requests.<name> (Params fills them): each type's probes, and standard lm-eval tasks judged beside them as
    # rows `<domain>:<task>` (docs/evaluate.md)
    probes: dict[str, ProbeParams] = Field(default_factory=lambda: dict(DEFAULT_PROBES))
    tasks: dict[str, list[TaskParams]] = {}
    timeout_seconds: int = Field(21600, gt=0)  # a model's evaluating process is killed after this (baseline: fatal)
    threads: int | None = Field(None, ge=1)  # torch threads of each evaluating process (None: torch's default)

    @field_validator("domains")
    @classmethod
    def _domains(cls, value: list[str]):
        if not value:
            raise ValueError("empty: evaluating nothing would let the gate decide on nothing (leave the key out: all)")
        return listed_once(value)

    @model_validator(mode="after")
    def _check_tasks(self):
        for key, names in (("domains", self.domains), ("tasks", list(self.tasks))):
            unknown = [d for d in names if d not in self.probes]
            if unknown:
                raise ValueError(f"unknown request type {unknown[0]!r} in evaluate.{key}; declared: {', '.join(self.probes)}")
        seen: set[str] = set()
        for domain, specs in self.tasks.items():
            if specs and domain not in self.domains:
                raise ValueError(f"tasks for domain {domain!r}, which evaluate.domains leaves out")
            for spec in specs:
                if spec.name in seen:
                    raise ValueError(f"task {spec.name!r} is listed twice; a task is judged once, under one domain")
                seen.add(spec.name)
        return self


class PlanningParams(Section):
    """The variant each probe pool is sized for (pipelines/judging/planning.py): `quantgate doctor` and compare.json's
    `planning` say how often the looks would pass it, and how many items would make that `power`."""

    # a variant whose accuracy drop is this share of the row's margin (0.4 x 0.05: 2 points), inside it ...
    drop_of_margin: float = Field(0.4, gt=0, lt=1)
    flip_rate: float = Field(0.07, gt=0, le=1)  # ... that flips this share of the items (at least the drop) ...
    icc: float = Field(0.025, ge=0, lt=1)  # ... with this within-family correlation of flips
    power: float = Field(0.55, gt=0.5, lt=1)  # should pass at least this often


class CompareParams(Section):
    """Paired A/B of every variant against fp16 and the gate policy that turns it into verdicts."""

    # two-sided; (1 - confidence) / 2 is the false-pass rate at the margin
    confidence: Annotated[float, bounded(0.8, 1, "below 0.8 the false-pass rate is over 10 %", high_open=True)] = 0.95
    # how the looks share that rate: pocock, obrien_fleming (Lan-DeMets) or hsd:<gamma> (Hwang-Shih-DeCani)
    spending: str = "pocock"
    power: float = Field(0.8, gt=0.5, lt=1)  # planning only: the items that would decide at this power
    planning: PlanningParams = Field(default_factory=PlanningParams)
    policy: dict[str, PolicyParams] = Field(default_factory=lambda: {"default": DEFAULT_POLICY})

    @property
    def alpha(self) -> float:
        """One-sided false-pass rate at the margin, over all looks together."""
        return round((1 - self.confidence) / 2, 12)

    @field_validator("spending")
    @classmethod
    def _spending(cls, value: str) -> str:
        match = re.fullmatch(r"hsd:(-?\d+(?:\.\d+)?)", value)
        if value not in ("pocock", "obrien_fleming") and not (match and -10 <= float(match.group(1)) <= 10):
            raise ValueError(f"unknown spending function {value!r}: pocock, obrien_fleming or hsd:<gamma> with "
                             "-10 <= gamma <= 10 (Hwang-Shih-DeCani; docs/compare.md)")
        return value

    @model_validator(mode="after")
    def _check(self):
        default = self.policy.get("default")
        later = ("min_agreement",)  # added after teams wrote their policies: the built-in value fills it in
        missing = [k for k, v in DEFAULT_POLICY.model_dump().items()
                   if (default is None or getattr(default, k) is None) and k not in later]
        if missing:
            raise ValueError(f"policy.default must set every limit; missing {', '.join(missing)}")
        for name in self.policy:  # each request type's limits as the verdict merges them
            merged = self.policy_for(name)
            if merged.max_growth_excess_pct > merged.min_memory_saving_pct:
                where = "compare.policy.default" if name == "default" else f"requests.{name}.policy"
                raise ValueError(f"{where}: max_growth_excess_pct {merged.max_growth_excess_pct:g} must be at most "
                                 f"min_memory_saving_pct {merged.min_memory_saving_pct:g}, or a passing variant costs "
                                 "more memory than fp16 by the end of the soak horizon")
        return self

    def policy_for(self, domain: str) -> PolicyParams:
        """The default limits overlaid with the domain's own."""
        override = self.policy.get(domain)
        merged = DEFAULT_POLICY.model_dump() | {k: v for k, v in self.policy["default"].model_dump().items() if v is not None}
        if override is not None:
            merged.update({k: v for k, v in override.model_dump().items() if v is not None})
        return PolicyParams(**merged)


class FleetParams(Section):
    """What a deployment costs the fleet (pipelines/routing/fleet.py): the traffic it holds at peak and the replica
    each deployed variant runs. Bytes come from the memory stage's measurements of each variant."""

    requests_in_flight: int = Field(512, gt=0)    # the fleet's concurrent requests at peak, all types together
    requests_per_replica: int = Field(32, gt=0)   # concurrent requests one replica serves (its batch)
    kv_pool_tokens: int = Field(8192, gt=0)       # the KV pool each replica reserves, in tokens of context
    standby_replicas: float = Field(1.0, ge=0)    # replicas a deployment keeps beyond what its traffic needs


class RouteParams(Section):
    """Context-length buckets of the routing table (upper bounds, in tokens), and the fleet the plan is for."""

    context_buckets: list[int] = [64, 128, 256]
    max_deployments: int | None = Field(None, ge=1)   # fp16 counts as one; None = as many as pay for themselves
    fleet: FleetParams = FleetParams()

    @model_validator(mode="after")
    def _pool_holds_a_request(self):
        if self.fleet.kv_pool_tokens < self.context_buckets[-1]:
            raise ValueError(f"fleet.kv_pool_tokens ({self.fleet.kv_pool_tokens}) must hold a request of the largest "
                             f"context bucket ({self.context_buckets[-1]} tokens): a replica could not serve it")
        return self

    @field_validator("context_buckets")
    @classmethod
    def _buckets(cls, value: list[int]):
        if not value or any(b <= 0 for b in value) or any(a >= b for a, b in zip(value, value[1:])):
            raise ValueError(f"must be positive token counts in strictly increasing order, got {value}")
        return value


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

    experiment: str = Field("quantgate", min_length=1)
    registered_model: str | None = Field(None, min_length=1)  # None: quantgate-<model>, e.g. quantgate-reference
