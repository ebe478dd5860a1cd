"""params.yaml's `candidates`: a third-party checkpoint, an lm-eval sample log of a model evaluated elsewhere, or a model
behind an OpenAI-compatible endpoint (docs/params.md, `candidates`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipelines.core.params_requests import Section, listed_once

TASK_OWNED = {"model", "prompt", "messages", "max_tokens", "max_gen_toks", "max_completion_tokens", "min_tokens",
              "temperature", "top_p", "top_k", "min_p", "do_sample", "until", "stop", "stop_token_ids", "ignore_eos",
              "seed", "n", "best_of", "logprobs", "top_logprobs", "echo", "stream", "logit_bias", "presence_penalty",
              "frequency_penalty", "suffix"}


class EndpointParams(Section):
    """An OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, TGI) serving a candidate: lm-eval evaluates it
    there through /v1/completions and the shadow replay sends traffic to it (pipelines/evaluation/endpoints.py). Its
    key comes from the environment variable `api_key_env` names, never from params.yaml."""

    base_url: str  # up to /v1: http://host:8000/v1
    model: str  # the name the server lists under /v1/models
    api_key_env: str | None = None  # the environment variable holding its bearer token
    timeout_s: int = Field(30, gt=0)  # one request; the whole evaluation is bounded by evaluate.timeout_seconds
    max_retries: int = Field(3, ge=0)
    concurrency: int = Field(1, gt=0)  # requests in flight at once (lm-eval's num_concurrent; the replay's too)
    # fields every generation request carries, for an engine whose defaults are not greedy decoding: llama-cpp-python's
    # server penalizes repeats (repeat_penalty 1.1) even at temperature 0 unless a request says repeat_penalty: 1.0
    request_fields: dict[str, float | int | bool | str] = {}

    @field_validator("request_fields")
    @classmethod
    def _not_the_tasks_settings(cls, value: dict) -> dict:
        owned = sorted(k for k in value if k.lower() in TASK_OWNED)
        if owned:
            raise ValueError(f"{owned}: set by the tasks' own generation settings or by lm-eval (the answers must pair "
                             "with fp16's): only an engine's own knobs, such as repeat_penalty, belong here")
        return value

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not re.fullmatch(r"https?://[^\s/@?#]+(/[^\s?#]*)?", value):
            raise ValueError(f"{value!r} is not an http(s) URL without credentials or a query (e.g. "
                             "http://127.0.0.1:8000/v1; the key goes in the variable api_key_env names)")
        return value.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _a_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{value!r} is not an environment variable's name: the key itself never goes in "
                             "params.yaml")
        return value


class CandidateParams(Section):
    """A third-party quantized checkpoint, the lm-eval sample log of a model evaluated elsewhere, or a model behind an
    OpenAI-compatible endpoint: validated before anything reads it, then judged like a variant (docs/params.md,
    `candidates`)."""

    # the checkpoint folder; the log's --output_path folder (source: samples); for an endpoint, a file or folder that
    # says what it serves (its deployment spec or its weights): DVC hashes it, so a redeploy that edits it re-evaluates
    path: str
    source: Literal["checkpoint", "samples", "endpoint"] = "checkpoint"  # samples: `lm_eval --log_samples` output
    endpoint: EndpointParams | None = None  # source: endpoint
    # what this machine cannot measure for the candidate and the team measured elsewhere; undeclared, a check that
    # was not measured leaves the candidate's rows inconclusive (never a pass on what nobody looked at)
    judged_elsewhere: list[Literal["memory", "fidelity"]] = []
    _elsewhere_once = field_validator("judged_elsewhere")(listed_once)

    @model_validator(mode="after")
    def _elsewhere_needs_a_log(self):
        if self.judged_elsewhere and self.source == "checkpoint":
            raise ValueError("judged_elsewhere: a checkpoint is measured here (memory and fidelity); only a candidate "
                             "evaluated elsewhere (source: samples or endpoint) can have them judged elsewhere")
        if (self.source == "endpoint") != (self.endpoint is not None):
            raise ValueError("endpoint: source endpoint needs endpoint {base_url, model}, and only it takes one")
        return self


BASELINE_HERE = "models/variants/fp16"  # the baseline stage's input when fp16 is evaluated here


class BaselineParams(Section):
    """Where fp16's answers come from: evaluated here (the default), from the lm-eval sample log of fp16 evaluated where
    it really runs, or through the OpenAI-compatible endpoint it is served at, for a team whose fp16 only fits its GPU
    fleet (pipelines/evaluation/baseline_log.py). `path` is the baseline stage's DVC dependency, so an edited log or
    deployment spec is a stale input like any other."""

    source: Literal["here", "samples", "endpoint"] = "here"
    # source samples: the `lm_eval ... --log_samples --output_path` folder of fp16's one run; source endpoint: a file
    # or folder that says what the endpoint serves (its deployment spec), which DVC hashes: a redeploy that edits it
    # evaluates fp16 again
    path: str = BASELINE_HERE
    endpoint: EndpointParams | None = None  # source endpoint: where fp16 is served ({base_url, model, api_key_env})

    @model_validator(mode="after")
    def _path_goes_with_source(self):
        path = self.path.strip().rstrip("/")
        if self.source == "here" and path != BASELINE_HERE:
            raise ValueError(f"path: fp16 evaluated here reads {BASELINE_HERE}; set source: samples for a log, "
                             "endpoint for a server")
        what = {"samples": "the folder of fp16's lm-eval sample log", "endpoint": "fp16's deployment spec"}
        if self.source != "here" and (path in ("", ".", "..") or path.split("/")[0] in ("models", "results")):
            raise ValueError(f"path {self.path!r}: source {self.source} needs {what[self.source]}, outside models/ "
                             "and results/ (what the pipeline writes)")
        if (self.source == "endpoint") != (self.endpoint is not None):
            raise ValueError("endpoint: source endpoint needs endpoint {base_url, model}, and only it takes one")
        return self
