"""Candidates behind an OpenAI-compatible endpoint (vLLM, SGLang, TGI, llama.cpp's server): evaluated where they are
really served, with the same statistics, looks, rules, routing, record and gate as a variant evaluated here.

A team declares `candidates.<name>: {source: endpoint, path: <what it serves>, endpoint: {base_url, model,
api_key_env}}`. admit checks the server (`check`: reachable, the model listed, prompt logprobs returned) and records
what it lists; evaluate runs lm-eval's own `local-completions` backend against it on the items the look plan can ask
(concurrency, retries and per-request timeout are lm-eval's; the whole run is bounded by evaluate.timeout_seconds) and
judges the sample log it writes exactly as a team's log (pipelines/evaluation/sample_logs.py); the shadow replay sends
its production sample through /v1/completions (`replay`, client-side latency). A server that does not answer is that
candidate's recorded failure, never a hang. The key is read from the environment variable `api_key_env` names and
passed to lm-eval as OPENAI_API_KEY; params, manifests, logs and MLflow never hold it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelines.core.errors import ENVIRONMENT, QuantgateError
from pipelines.evaluation import sample_logs
from pipelines.evaluation.plans import lm_eval_samples
from pipelines.models.loading import ENDPOINT_SOURCE

SOURCE = ENDPOINT_SOURCE
BACKEND = "local-completions"  # lm-eval's OpenAI-compatible /v1/completions backend
LOGPROB_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")  # need the prompt's logprobs (echo)


def key_of(endpoint: dict) -> str | None:
    name = endpoint.get("api_key_env")
    if name and not os.environ.get(name):
        raise QuantgateError(f"{endpoint['base_url']}: environment variable {name} is not set (the key that "
                             "endpoint.api_key_env names)")
    return os.environ.get(name) if name else None


def call(endpoint: dict, method: str, route: str, body: dict | None = None) -> dict:
    """One request to the server; any failure a QuantgateError naming the URL and what came back."""
    import requests

    url = f"{endpoint['base_url']}/{route}"
    key = key_of(endpoint)
    try:
        answer = requests.request(method, url, json=body, timeout=endpoint.get("timeout_s", 30),
                                  headers={"Authorization": f"Bearer {key}"} if key else {})
    except requests.RequestException as err:
        raise QuantgateError(f"{url}: unreachable ({type(err).__name__}: {str(err)[:300]})") from None
    if answer.status_code != 200:
        raise QuantgateError(f"{url}: HTTP {answer.status_code}: {answer.text[:300]}")
    try:
        return answer.json()
    except ValueError:
        raise QuantgateError(f"{url}: the answer is not JSON: {answer.text[:200]!r}") from None


PROBES = ("1 + 1 = 2", "The cat sat on the", "def add(a, b):")  # prompts for the prompt-logprob check
LOGPROB_TOLERANCE = 1e-3  # nats: the same distribution read twice (a server's own float noise is far below)


def _prompt_logprobs(endpoint: dict, tokenizer_dir: Path | None) -> tuple[bool, str | None]:
    """Whether the server's prompt logprobs (echo) are what lm-eval reads them as: one per prompt token and one per
    generated token (lm-eval drops the last as the generated one), and the logprob a generated token has as the next
    token equal to the one echo gives it once it ends the prompt. Servers that return none (llama.cpp's own server),
    leave the generated token out or shift them by a token (llama-cpp-python's, abetlen/llama-cpp-python#1983) would
    score every multiple-choice item on numbers that are not the model's; (usable, why not)."""
    why = "no probe prompt re-tokenized as itself plus the generated token"
    count = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731 - as lm-eval counts
    for prompt in PROBES:
        body = {"model": endpoint["model"], "max_tokens": 1, "temperature": 0, "logprobs": 1}  # lm-eval's own payload
        first = call(endpoint, "POST", "completions", {**body, "prompt": prompt})
        if count and first["usage"]["prompt_tokens"] != count(prompt):
            return False, (f"the server counts {first['usage']['prompt_tokens']} tokens in {prompt!r}, the model's "
                           f"tokenizer {count(prompt)} (a BOS or template it adds?): lm-eval's continuation slices would "
                           "be off by that much")
        token = first["choices"][0]["text"]
        next_logprob = first["choices"][0]["logprobs"]["token_logprobs"][0]
        echoed = call(endpoint, "POST", "completions", {**body, "prompt": prompt + token, "echo": True})
        n, made = echoed["usage"]["prompt_tokens"], echoed["usage"]["completion_tokens"]
        values = echoed["choices"][0]["logprobs"]["token_logprobs"] or []
        if len(values) != n + made:
            return False, (f"echo returned {len(values)} logprobs for {n} prompt and {made} generated tokens, where "
                           "lm-eval reads one per token of both and drops the last as the generated one: each "
                           "continuation would be scored without its last token")
        if n != first["usage"]["prompt_tokens"] + 1:  # the token merged with the prompt's end: try another prompt
            continue
        if values[n - 1] is None:
            return False, f"echo returned no logprob for the prompt's last token ({token!r})"
        if abs(values[n - 1] - next_logprob) > LOGPROB_TOLERANCE:
            return False, (f"the prompt logprobs are not the model's: {token!r} after {prompt!r} has logprob "
                           f"{next_logprob:.4f} as the next token and {values[n - 1]:.4f} once echoed in the prompt "
                           "(llama-cpp-python's server shifts them by a token: abetlen/llama-cpp-python#1983)")
        return True, None
    return False, why


def check(endpoint: dict, tokenizer_dir: Path | None = None) -> dict:
    """What admit and the doctor ask of a server: reachable, `model` listed under /models, and prompt logprobs that are
    the model's (lm-eval's log-likelihood tasks send the prompt with echo and logprobs). `problem` says what failed,
    None when usable; `logprobs_problem` why the log-likelihood rows cannot be judged through it. With `tokenizer_dir`
    (the model under test's), the server must count a prompt's tokens as that tokenizer does: a server that adds a BOS
    lm-eval does not count would shift every continuation by a token."""
    out = {"reachable": False, "listed": False, "logprobs": False, "models": [], "problem": None}
    try:
        listing = call(endpoint, "GET", "models")
    except QuantgateError as err:
        return {**out, "problem": str(err)}
    data = listing.get("data") if isinstance(listing, dict) else None
    out.update(reachable=True, models=sorted(str(m.get("id")) for m in data or [] if isinstance(m, dict)))
    if endpoint["model"] not in out["models"]:
        return {**out, "problem": f"{endpoint['base_url']}/models lists {out['models']}, not {endpoint['model']!r} "
                                  "(endpoint.model)"}
    out["listed"] = True
    try:
        out["logprobs"], out["logprobs_problem"] = _prompt_logprobs(endpoint, tokenizer_dir)
    except (QuantgateError, KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        out["logprobs_problem"] = f"no usable logprobs: {type(err).__name__}: {str(err)[:300]}"
    return out


def checked(endpoint: dict, tokenizer_dir: Path | None) -> dict:
    """`check`, plus the served model's fingerprint when the server is usable: what the gate asks again, since another
    model behind this address later makes the evaluation stale (pipelines/evaluation/redeploy.py)."""
    from pipelines.evaluation.redeploy import fingerprint

    state = {**check(endpoint, tokenizer_dir), "fingerprint": None}
    if not state["problem"]:
        try:
            state["fingerprint"] = fingerprint(endpoint)
        except QuantgateError as err:
            state["problem"] = f"no fingerprint of the served model: {err}"
    return state


def admit(name: str, path: str, endpoint: dict, out_root: Path, tokenizer_dir: Path | None = None) -> dict:
    """Stage admit of an endpoint candidate: the server checked and what it lists recorded in the manifest (never the
    key); one that does not answer or does not list the model is refused, and the stage goes on."""
    from pipelines.core.io import atomic_dir, write_json
    from pipelines.core.paths import MANIFEST

    manifest = {"variant": name, "candidate": True, "source": SOURCE, "source_path": str(path), "method": SOURCE,
                "dtype": None, "endpoint": endpoint}
    state = checked(endpoint, tokenizer_dir)
    if state["problem"]:
        why = f"{state['problem']} (once the server is up: dvc repro -f admit@{name})"
        manifest.update({"status": "failed", "reasons": [why], "error": f"endpoint refused: {why}",
                         "validation": {"admitted": False, "reasons": [why]}})
    else:
        manifest.update({"status": "ok", "validation": {"admitted": True, "reasons": []},
                         "evidence": {"backend": BACKEND, "base_url": endpoint["base_url"], "model": endpoint["model"],
                                      "listed": state["models"], "logprobs": state["logprobs"],
                                      "logprobs_problem": state["logprobs_problem"],
                                      "fingerprint": state["fingerprint"]}})
    with atomic_dir(out_root / name) as tmp:
        write_json(tmp / MANIFEST, manifest)
    return manifest


def _output_types(eval_dir: Path) -> dict[str, str]:
    """task -> output_type of the probe tasks under eval/ (standard tasks are lm-eval's and not listed)."""
    from pipelines.evaluation.plans import task_yaml

    found = {}
    for path in sorted(Path(eval_dir).glob("*/*.yaml")):
        spec = task_yaml(path)
        if spec.get("task"):
            found[str(spec["task"])] = str(spec.get("output_type") or "generate_until")
    return found


def scrubbed(text: str, endpoint: dict) -> str:
    """Output that may quote the request (lm-eval logs aiohttp's errors with their headers) without the key in it."""
    key = os.environ.get(endpoint.get("api_key_env") or "") or None
    text = re.sub(r"(?i)(bearer\s+)\S+", r"\1<redacted>", text)
    return text.replace(key, "<redacted>") if key else text


def run_lm_eval(endpoint: dict, tasks: dict[str, list[int]], tokenizer_dir: Path, eval_dir: Path, out: Path,
                timeout_s: int, allow_unisolated_code: bool = False, files: dict[str, str] | None = None) -> None:
    """`lm_eval run --model local-completions` against the endpoint, as a team would run it, writing its sample log
    under `out`; the prompt is sent as text, so the server tokenizes it with its own tokenizer (`tokenizer_dir`, the
    model under test's, only counts the continuation's tokens). `files`: the standard tasks' configs
    (standard_tasks.config_files), given to `--tasks` by path. Raises QuantgateError with lm-eval's last words (the
    key scrubbed); past `timeout_s` its whole process group is killed."""
    import signal

    args = (f"base_url={endpoint['base_url']}/completions,model={endpoint['model']},tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},tokenized_requests=False,num_concurrent={endpoint.get('concurrency', 1)},"
            f"max_retries={endpoint.get('max_retries', 3)},timeout={endpoint.get('timeout_s', 30)}")
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "run", "--model", BACKEND, "--model_args", args,
           "--tasks", ",".join((files or {}).get(t, t) for t in tasks), "--include_path", str(eval_dir),
           "--batch_size", "1", "--seed", "0",
           "--log_samples", "--output_path", str(out), "--samples", json.dumps(tasks), "--confirm_run_unsafe_code"]
    if endpoint.get("request_fields"):  # an engine's own knobs (endpoint.request_fields), on every generation request
        cmd += ["--gen_kwargs", json.dumps(endpoint["request_fields"])]  # JSON: a value may hold a comma or an "="
    env = {**os.environ, "OPENAI_API_KEY": key_of(endpoint) or "EMPTY", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           # code answers scored as fp16's were: in the sandbox, or unisolated where evaluate.allow_unisolated_code says
           "QUANTGATE_ALLOW_UNISOLATED_CODE": "1" if allow_unisolated_code else "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: a timeout kills the sandboxes it started too
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise QuantgateError(f"lm-eval against {endpoint['base_url']} ran past {timeout_s} s (evaluate.timeout_seconds)"
                             ) from None
    if proc.returncode != 0:
        raise QuantgateError(f"lm-eval against {endpoint['base_url']} failed (exit {proc.returncode}): "
                             f"{scrubbed((stderr or stdout)[-1500:], endpoint)}")


def _needs_logprobs(plan: dict, types: dict[str, str], configs: dict[str, dict], row: str) -> bool:
    """Whether a row is scored by log-likelihood: its probe task's or (a standard task) its config's output_type."""
    if "spec" not in plan:
        return types.get(plan["probe"]["task"], "generate_until") in LOGPROB_TYPES
    return configs[row].get("output_type", "generate_until") in LOGPROB_TYPES


def still_served(label: str, endpoint: dict, recorded: dict | None, remedy: str) -> None:
    """Raises QuantgateError unless the server still answers as when `recorded` was taken (before its evaluation): a
    redeploy during the run would mix two models' answers in one log (pipelines/evaluation/redeploy.py)."""
    from pipelines.evaluation.redeploy import redeployed

    changed = redeployed(label, endpoint, recorded, remedy)
    if changed:
        raise QuantgateError(f"the server changed while it was evaluated: {changed}")


def run_servable(endpoint: dict, plans: dict[str, dict], evidence: dict, tokenizer_dir: Path, eval_dir: Path,
                 timeout_s: int, allow_unisolated_code: bool, tmp: Path) -> tuple[dict[str, str], Path | None]:
    """lm-eval against the endpoint on every row it can be judged on, its log written under `tmp`: ({row: why not},
    the log's folder, or None when no row can run). Standard tasks go with the configs fp16 runs here
    (standard_tasks.config_files)."""
    from pipelines.evaluation import standard_tasks
    from pipelines.evaluation.harness import task_configs

    skipped = unservable_rows(plans, endpoint, evidence, eval_dir, allow_unisolated_code)
    files, unwritable = standard_tasks.config_files(task_configs({r: p for r, p in plans.items() if r not in skipped}),
                                                    tmp)
    skipped.update(unwritable)
    wanted = lm_eval_samples({r: p for r, p in plans.items() if r not in skipped}, eval_dir)
    tasks = {task: positions for task, positions in wanted.items() if positions}
    if not tasks:
        return skipped, None
    run_lm_eval(endpoint, tasks, tokenizer_dir, eval_dir, tmp / "log", timeout_s, allow_unisolated_code, files)
    return skipped, tmp / "log"


SANDBOX_REFUSAL = "runs model-written code, and the sandbox cannot isolate here"


def unservable_rows(plans: dict[str, dict], endpoint: dict, evidence: dict, eval_dir: Path,
                    allow_unisolated_code: bool) -> dict[str, str]:
    """{row: why} for the rows this endpoint cannot be judged on: log-likelihood rows (probes or standard tasks) where
    the server's prompt logprobs are not usable (`evidence`: what `check` found), and rows that run model-written code
    where the sandbox cannot isolate (as harness.run_probes refuses them here)."""
    from pipelines.core import sandbox
    from pipelines.evaluation import standard_tasks
    from pipelines.evaluation.harness import task_configs

    types, configs = _output_types(eval_dir), task_configs(plans)
    unisolated = not allow_unisolated_code and not sandbox.isolation_available()
    skipped = {}
    for row, plan in plans.items():
        runs_code = standard_tasks.sandboxed(configs[row]) if "spec" in plan else plan["probe"].get("runs_code")
        if runs_code and unisolated:
            skipped[row] = f"{SANDBOX_REFUSAL} ({sandbox.isolation_level()[1] or 'no bwrap'})"
        elif _needs_logprobs(plan, types, configs, row) and not evidence.get("logprobs"):
            skipped[row] = (f"scored by log-likelihood, and {endpoint['base_url']} gives no usable prompt logprobs "
                            f"({evidence.get('logprobs_problem')}): judge it through a server that does (vLLM, "
                            "SGLang), or from a sample log")
    return skipped


def refused_row(plan: dict, why: str) -> dict:
    """A row's summary when its model cannot be judged on it: refused, with the reason; one this machine's sandbox
    refused is, as in-process (harness.run_probes), could-not-measure (its rows inconclusive), with the remedy."""
    row = {"task": plan["task"] if "spec" in plan else plan["probe"]["task"], "status": "refused", "score": None,
           "stderr": None, "items": 0, "reason": why}
    if SANDBOX_REFUSAL in why:
        row.update(cause=ENVIRONMENT, remedy="make the sandbox work here (`quantgate doctor` names what is missing) or "
                                             "set evaluate.allow_unisolated_code: true, then evaluate again")
    return row


def evaluate(name: str, variant_dir: Path, plans: dict[str, dict], base_items: list[dict], base_eval: dict, compare,
             allow_unisolated_code: bool, log_dir: Path, tokenizer_dir: Path, eval_dir: Path,
             timeout_s: int) -> tuple[dict, list[dict]]:
    """Stage evaluate of an endpoint candidate: lm-eval against it, its log kept in `log_dir` and judged as a team's
    log. A server that fails (or that admit refused) is the candidate's recorded failure, never a stop; a row it cannot
    be judged on here is that row's refusal, the other rows still judged: a log-likelihood row on a server whose prompt
    logprobs are not usable, or one that runs code where the sandbox cannot isolate (`unservable_rows`)."""
    import shutil

    from pipelines.core.io import read_json
    from pipelines.core.paths import MANIFEST

    result: dict = {"variant": name, "device": None, "batch_size": 1, "fidelity": None,
                    "not_measured": {"fidelity": "the endpoint returns sampled tokens and at most top logprobs, not the "
                                                 "full distributions KL needs"}}
    started = time.perf_counter()
    endpoint: dict = {}
    os.environ["QUANTGATE_ALLOW_UNISOLATED_CODE"] = "1" if allow_unisolated_code else "0"  # score_again here, too
    try:
        manifest = read_json(variant_dir / MANIFEST)
        endpoint, evidence = manifest["endpoint"], manifest.get("evidence") or {}
        result["evidence"] = {**evidence, "source": SOURCE}
        if manifest.get("status") != "ok":
            raise QuantgateError(f"admit refused it: {(manifest.get('reasons') or ['no reason recorded'])[0]}")
        shutil.rmtree(log_dir, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="lm-eval-endpoint-") as tmp:
            skipped, logged = run_servable(endpoint, plans, evidence, tokenizer_dir, eval_dir, timeout_s,
                                           allow_unisolated_code, Path(tmp))
            if logged:
                sample_logs.copy_log(sample_logs.read_log(logged, endpoint.get("request_fields")), log_dir)
        if logged:
            still_served(name, endpoint, evidence.get("fingerprint"), f"dvc repro -f -s admit@{name}, then dvc repro")
            log = sample_logs.read_log(log_dir, endpoint.get("request_fields"))
            result["probes"], items = sample_logs.records(log, {r: p for r, p in plans.items() if r not in skipped},
                                                          base_items, base_eval, compare.policy_for, compare)
        else:
            result["probes"], items = {}, []
    except QuantgateError as err:
        return {**result, "status": "failed", "error": scrubbed(str(err), endpoint)}, []
    except Exception as err:  # noqa: BLE001 - whatever the server or its log holds, it is this candidate's failure
        return {**result, "status": "failed", "error": f"evaluation through the endpoint broke: {type(err).__name__}: "
                                                       f"{str(err)[:1500]}"}, []
    result["probes"].update({row: refused_row(plans[row], why) for row, why in skipped.items()})
    result.update(status="ok", wall_s=round(time.perf_counter() - started, 1))
    return result, items


def replay(endpoint: dict, prompts: list[str], max_new_tokens: int) -> dict:
    """The shadow replay through the endpoint: each prompt greedy, `max_new_tokens` at most, one request at a time so
    latency is the server's own, seen from the client. {"texts", "latency_s"}; raises QuantgateError on a failure."""
    texts, latency = [], []
    for prompt in prompts:
        body = {**endpoint.get("request_fields", {}), "model": endpoint["model"], "prompt": prompt, "temperature": 0,
                "max_tokens": max_new_tokens, "seed": 0}
        for attempt in range(max(1, endpoint.get("max_retries", 3))):  # lm-eval's count: attempts, not retries
            started = time.perf_counter()
            try:
                answer = call(endpoint, "POST", "completions", body)
                break
            except QuantgateError:
                if attempt + 1 >= max(1, endpoint.get("max_retries", 3)):
                    raise
                time.sleep(min(2 ** attempt, 10))
        latency.append(time.perf_counter() - started)
        try:
            texts.append(str(answer["choices"][0]["text"]))
        except (KeyError, IndexError, TypeError):
            raise QuantgateError(f"{endpoint['base_url']}/completions: no choices[0].text in {str(answer)[:200]}") \
                from None
    return {"texts": texts, "latency_s": latency}
