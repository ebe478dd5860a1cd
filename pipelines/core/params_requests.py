"""params.yaml's request types: how each is recognised, calibrated, probed and judged (`requests.<name>`), with the
shipped four. `Section`, the strict base of every params model, lives here because this is the lowest of the
params modules: params_sections builds the per-stage sections on these models, params.Params ties them together.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """A params.yaml section: unknown keys are errors, so a typo never silently means 'default'; NaN and infinity are
    refused everywhere (a NaN limit compares false both ways, an infinite one switches its check off)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def bounded(low: float | None, high: float | None, why: str, *, low_open: bool = False,
            high_open: bool = False) -> AfterValidator:
    """A limit's allowed range, refused with the range and the reason for it: a limit outside it switches its check
    off (or makes it vacuous), so it is an error, never a setting. None (a key left to its default) passes."""
    interval = (("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}") + ", "
                + ("inf" if high is None else f"{high:g}") + (")" if high_open else "]"))

    def check(value):
        if value is None:
            return value
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            raise ValueError(f"must be in {interval}: {why}")
        return value

    return AfterValidator(check)


def listed_once(value: list[str]) -> list[str]:
    """A list of request types named at most once each (a duplicate would be sampled or judged twice)."""
    twice = sorted({d for d in value if value.count(d) > 1})
    if twice:
        raise ValueError(f"{twice[0]!r} is listed twice: name each request type once")
    return value


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
    """A request type's probes: the lm-eval task in eval/<name>/ over its pool eval/<name>/<items> (items.jsonl unless a
    model needs another probe set: the real-model profile's math), the per-item metric that says correct, the fields
    every item needs, and the item as plain text (a Jinja template) for fidelity."""

    task: str
    items: str = "items.jsonl"  # the pool's file in eval/<name>/ (the task YAML's data_files.test must name it)
    metric: str = "exact_match"
    fields: list[str] = ["id", "prompt", "answer"]
    text: str = "{{prompt}} {{answer}}"
    runs_code: bool = False  # its metric runs model-written code: only in the sandbox

    @model_validator(mode="after")
    def _check(self):
        if "id" not in self.fields:
            raise ValueError("fields must include 'id' (items are paired across variants by it)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.jsonl", self.items):
            raise ValueError(f"items {self.items!r}: a .jsonl file name in the request type's eval/<name>/ folder")
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


# The shipped request types' probes and classifier rules (their whole declaration: shipped_requests())
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
        "ask": r"(?i)\b(solve|compute|calculate|simplify|evaluate|equation|fraction|square root)\b|计算|求解|等于多少",
        "stamp": r'\d{4}-\d\d-\d\d|\d\d?:\d\d|\d+(\.\d+){2,}|[;|$"`]|[a-z]{2,}=\S|\n\s*\n'},  # dates, versions, syntax
        when="(symbol + arithmetic >= 2 or (symbol + arithmetic >= 1 and (ask >= 1 or chars < 40))) and stamp == 0",
        priority=10),
    "code": ClassifyParams(when="code_lines >= 2", priority=20),
    # conversational text, and nothing else: what no type claims is `unknown`, served by fp16
    "chat": ClassifyParams(patterns={
        "talk": r"(?i)\b(i|i'm|i'd|i've|my|me|we|our|us|you|your|please|thanks?|hi|hello|hey|can|could|would|will|is|"
                r"are|do|does|did|how|where|when|why|what|which|who|help|need|want)\b|[?!]|[我你您请吗呢吧帮怎哪了]|"
                r"[\u4e00-\u9fff][。？！]",
        "payload": r"[{}<>|=$`\\\t]|;\S|(?m:;[ \t]*$)|\[(?!(EMAIL|ID|CARD|PHONE)\])|://|\w\(|\w,\w|\d{4}-\d\d-\d\d|"
                   r"\d\d:\d\d|(^|\s)--?[a-zA-Z]|(?m:^[ \t-]*(?!(Customer|Agent|User|Assistant):)[A-Za-z][\w.-]*:(\s|$))|"
                   r"\):(\s|$)|\n\s*\n|\w(Error|Exception)\b|\bERR!|\b(ERROR|FATAL|WARN|WARNING)\b",
        "task": r"(?i)\b(translat\w*|summar\w*|paraphras\w*|rephrase|rewrite|proofread|extract|classify|sentiment|"
                r"keywords)\b|翻译|总结|摘要|改写|提取|[\u4e00-\u9fff]：",
        "query": r"(?i)\bselect\b.+\bfrom\b|\binsert\s+into\b|\bupdate\s+\w+\s+set\b|\bdelete\s+from\b|"
                 r"\bcreate\s+(table|index|view)\b",
        "newline": r"\n"},
        when="talk >= 1 and payload + task + query + code_lines + comment_lines == 0 and newline <= 8", priority=0),
    "code_comment": ClassifyParams(patterns={
        "ask": r"(?i)\b(comment|comments|commented|docstring|docstrings|document (this|the) (code|function)|"
               r"annotate)\b|注释|文档字符串"},
        when="(comment_lines >= 1 and (code_lines >= 1 or ask >= 1)) or (code_lines >= 1 and ask >= 1)",
        priority=30),
}


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


KL_PERCENTILES = ("mean", "median", "p90", "p95", "p99", "p99_9", "max")


class PolicyParams(Section):
    """Gate limits for one domain; a key left out comes from `compare.policy.default`."""

    # Bounds (docs/params.md, "Allowed ranges"): the same for compare.policy.default and requests.<name>.policy
    # non-inferiority margin, judged on the CI's low end
    max_accuracy_drop: Annotated[float | None, bounded(
        0, 0.5, "0 is no margin at all; from 0.5 on, a variant that answers nothing right passes every probe fp16 "
                "scores at most 50 % on", low_open=True, high_open=True)] = None
    # (correct->wrong + wrong->correct) / items
    max_flip_rate: Annotated[float | None, bounded(0, 1, "a flip rate is a share of items; 0 fails a variant on a "
                                                         "single flip, 1 never fails one", low_open=True,
                                                   high_open=True)] = None
    kl_percentile: Literal["mean", "median", "p90", "p95", "p99", "p99_9", "max"] | None = None
    # nats, at kl_percentile
    max_kl: Annotated[float | None, bounded(
        0, 5, "0 fails on float noise; at most 5 nats (ln 148), so on any vocabulary over 148 tokens a variant whose "
              "next-token distribution is uniform (says nothing) still fails where fp16 is sure", low_open=True)] = None
    # soak growth beyond fp16's, % of fp16's footprint; also at most min_memory_saving_pct (CompareParams)
    max_growth_excess_pct: Annotated[float | None, bounded(
        0, 100, "a variant saves less than 100 % of fp16's footprint, so an allowance of 100 % or more lets its growth "
                "cancel any saving", high_open=True)] = None
    # below this saving a passing variant is not worth routing to
    min_memory_saving_pct: Annotated[float | None, bounded(
        0, 100, "a negative saving routes variants that cost more memory than fp16; 100 % is no memory at all",
        high_open=True)] = None
    # exact-agreement share with fp16 a variant needs on a type's replayed traffic to serve it (stage shadow, route);
    min_agreement: Annotated[float | None, bounded(
        0, 1, "a share of replayed requests; 0 lets any replay that ran serve (only its request count counts), 1 "
              "needs every answer token for token fp16's")] = None


DEFAULT_POLICY = PolicyParams(max_accuracy_drop=0.05, max_flip_rate=0.15, kl_percentile="p99", max_kl=1.0,
                              max_growth_excess_pct=1.0, min_memory_saving_pct=10.0, min_agreement=0.5)


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


def shipped_requests() -> dict[str, RequestParams]:
    """math, code, chat, code_comment: the embedded default's request types (params.yaml spells them out)."""
    sources: dict[str, list[SourceParams]] = {}
    for src in DEFAULT_SOURCES:
        sources.setdefault(src.domain, []).append(src.model_copy(update={"domain": ""}))
    return {name: RequestParams(classify=DEFAULT_CLASSIFY[name], calibration=sources[name], probes=probe)
            for name, probe in DEFAULT_PROBES.items()}
