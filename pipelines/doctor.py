"""`quantgate doctor`: what the run params.yaml configures needs on this machine, checked in seconds, before any
model work (the convention of `flutter doctor` / `brew doctor`). scripts/run.sh runs it before `dvc repro`.

`run_checks()` returns one `Check` per thing the run needs: params.yaml, the code probes' sandbox, torch and the
device, each quantization backend the variants name and its kernel on this device, the MLflow tracking store, the
model, disk for the checkpoints, dvc. A `fail` is something that would keep the run from giving a verdict (or
would make it give one for the wrong reason, as a sandbox that refuses the code probes does); `warn` is worth
knowing but does not stop it. Nothing here loads model weights: shapes come from config.json or safetensors
headers. torch is imported once; bitsandbytes is imported for its real int8 check only when a variant uses it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import socket
import sqlite3
import struct
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pipelines.core.errors import QuantgateError

OK, WARN, FAIL = "ok", "warn", "fail"
SYSCTL = Path("/proc/sys")  # where the kernel's user-namespace switches are read (a test points it elsewhere)
INSTALL_BUBBLEWRAP = "apt-get install bubblewrap"
OTHER_SYSTEMS = "Fedora: dnf install bubblewrap; Arch: pacman -S bubblewrap"
UNISOLATED = "or set evaluate.allow_unisolated_code: true in params.yaml (code then runs with weaker isolation)"
SANDBOXED_TASKS = ("humaneval", "mbpp")  # standard_tasks.SANDBOXED (not imported: it is a stage module)
MLFLOW_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    remedy: str = ""


def run_checks(params_path: str | Path = "params.yaml") -> list[Check]:
    """Every check, in the order the run needs them. Never raises: a check that breaks is a `fail` row saying how."""
    from pipelines.core.params import load_params

    checks: list[Check] = []
    params = None
    try:
        params = load_params(params_path)
        checks.append(Check("params", OK, f"{params_path}: model {params.model}, device {params.device}, "
                                          f"variants {', '.join(params.variants)}"
                                          + (f", candidates {', '.join(params.candidates)}" if params.candidates else "")))
    except QuantgateError as err:
        checks.append(Check("params", FAIL, str(err), "fix that key (docs/params.md); the checks below that need "
                                                      "params.yaml are skipped"))
    checks.append(_guarded("sandbox", sandbox_check, params))
    device, torch_checks = _torch_checks(params)
    checks += torch_checks
    if params is not None:
        checks += _backend_checks(params, device)
        checks.append(_guarded("model", model_check, params))
        checks.append(_guarded("disk", disk_check, params))
    checks.append(_guarded("mlflow", mlflow_check))
    checks.append(_guarded("dvc", dvc_check))
    return checks


def exit_code(checks: list[Check]) -> int:
    """0 when every check is ok or warn; 1 when anything would keep the run from giving a verdict."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def _guarded(name: str, check, *args) -> Check:
    try:
        return check(*args)
    except Exception as err:  # noqa: BLE001 - the doctor reports, it does not crash
        return Check(name, FAIL, f"the check itself failed: {type(err).__name__}: {err}")


# --------------------------------------------------------------------------------------------
# The code probes' sandbox
# --------------------------------------------------------------------------------------------


def code_rows(params) -> list[str]:
    """The rows of the evaluation that run model-written code: request types whose probes declare runs_code, and
    the sandboxed standard tasks (humaneval, mbpp) under an evaluated request type (evaluate.run_probes' rule)."""
    ev = params.evaluate
    rows = [d for d in ev.domains if ev.probes[d].runs_code]
    rows += [f"{d}:{t.name}" for d in ev.domains for t in ev.tasks.get(d, []) if t.name in SANDBOXED_TASKS]
    return rows


def userns_restrictions(sysctl: Path | None = None) -> list[str]:
    """Kernel switches that keep unprivileged user namespaces (bubblewrap's) from being made, as `key=value`:
    Ubuntu's AppArmor restriction (23.10+), Debian's older unprivileged_userns_clone, max_user_namespaces 0."""
    sysctl = SYSCTL if sysctl is None else sysctl
    found = []
    for key, bad in (("kernel.apparmor_restrict_unprivileged_userns", "1"), ("kernel.unprivileged_userns_clone", "0"),
                     ("user.max_user_namespaces", "0")):
        try:
            value = (sysctl / key.replace(".", "/")).read_text().strip()
        except OSError:
            continue
        if value == bad:
            found.append(f"{key}={value}")
    return found


def sandbox_remedy(why: str) -> str:
    """What makes the full sandbox work, from isolation_level()'s reason."""
    if not sys.platform.startswith("linux"):
        return f"code probes need Linux (bubblewrap and namespaces are Linux-only); {UNISOLATED}"
    if "bwrap not found" in why:
        return f"{INSTALL_BUBBLEWRAP} (as root; {OTHER_SYSTEMS}), {UNISOLATED}"
    if why.startswith("not root"):
        return f"run as root (the sandbox's namespaces and its switch to uid 65534 need it), {UNISOLATED}"
    if "util-linux" in why:
        return f"apt-get install util-linux, {UNISOLATED}"
    if "python3" in why and "bwrap" not in why:
        return f"apt-get install python3 (a /usr/bin/python3 that uid 65534 can run), {UNISOLATED}"
    if "Unknown option" in why:
        return f"bubblewrap 0.8 or newer (Debian 12, Ubuntu 24.04): upgrade it ({INSTALL_BUBBLEWRAP}), {UNISOLATED}"
    restricted = userns_restrictions()
    if restricted:
        fixes = {"kernel.apparmor_restrict_unprivileged_userns=1": "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0",
                 "kernel.unprivileged_userns_clone=0": "sysctl -w kernel.unprivileged_userns_clone=1",
                 "user.max_user_namespaces=0": "sysctl -w user.max_user_namespaces=15000"}
        return (f"the kernel restricts user namespaces ({', '.join(restricted)}): "
                f"{'; '.join(fixes[r] for r in restricted)} as root (keep it with a file in /etc/sysctl.d/), "
                f"{UNISOLATED}")
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return ("this container forbids new namespaces: start it with --privileged (or --cap-add SYS_ADMIN "
                f"--security-opt seccomp=unconfined --security-opt apparmor=unconfined), {UNISOLATED}")
    return f"see the reason; `bwrap --ro-bind / / true` as root shows bubblewrap's own error; {UNISOLATED}"


def sandbox_check(params) -> Check:
    """The sandbox's real probe (sandbox.isolation_level) against what the run does with it."""
    from pipelines.core import sandbox

    level, why = sandbox.isolation_level()
    label = {sandbox.FULL: "full", sandbox.NAMESPACES: "namespaces only", sandbox.WEAK: "weak"}.get(level, level)
    if level == sandbox.FULL:
        rows = code_rows(params) if params is not None else []
        return Check("sandbox", OK, f"full isolation ({level})"
                     + (f": the code probes ({', '.join(rows)}) run in it" if rows else ""))
    why_text = why or "not FULL"
    if params is None:
        return Check("sandbox", WARN, f"{label} ({level}): {why_text}", sandbox_remedy(why_text))
    rows = code_rows(params)
    if not rows:
        return Check("sandbox", OK, f"{label}: {why_text}; not needed: no request type params.yaml evaluates runs code")
    if params.evaluate.allow_unisolated_code:
        return Check("sandbox", WARN, f"{label} ({level}): {why_text}; {', '.join(rows)} run anyway because "
                                      "evaluate.allow_unisolated_code is true", sandbox_remedy(why_text))
    return Check("sandbox", FAIL, f"{label}: {why_text}; the code probes ({', '.join(rows)}) would be refused and "
                                  "their rows could not be decided (gate exit 2)", sandbox_remedy(why_text))


# --------------------------------------------------------------------------------------------
# torch, the device, the quantization backends
# --------------------------------------------------------------------------------------------


def _torch_checks(params) -> tuple[str | None, list[Check]]:
    """(the device the run uses, or None when it cannot run, [torch row, device row])."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        return None, [Check("torch", FAIL, f"cannot import torch: {type(err).__name__}: {err}",
                            "bash scripts/setup.sh (docs/install.md)")]
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else \
        f"ROCm {torch.version.hip} build" if getattr(torch.version, "hip", None) else "CPU build"
    checks = [Check("torch", OK, f"torch {torch.__version__} ({build})")]
    setting = params.device if params is not None else "auto"
    try:
        from pipelines.models.loading import resolve_device

        device = resolve_device(setting)
    except QuantgateError as err:
        checks.append(Check("device", FAIL, str(err), "device: auto or cpu in params.yaml, or torch's CUDA build on a "
                                                      "machine with a GPU (docs/install.md, GPU)"))
        return None, checks
    if device != "cuda":
        why = "" if setting == "cpu" else " (torch sees no CUDA device)" if torch.version.cuda else " (a CPU build of torch)"
        checks.append(Check("device", OK, f"device: {setting} -> cpu{why}"))
        return device, checks
    from pipelines.models.loading import gpu_budget

    totals, gpus = [], []
    for i in range(torch.cuda.device_count()):
        prop = torch.cuda.get_device_properties(i)
        totals.append(prop.total_memory)
        gpus.append(f"cuda:{i} {prop.name} {prop.total_memory / 2**30:.0f} GiB sm_{prop.major}{prop.minor}")
    detail = f"device: {setting} -> cuda: {'; '.join(gpus)}"
    try:
        budget = gpu_budget(params.gpus.shares(), totals) if params is not None else None
    except QuantgateError as err:
        checks.append(Check("device", FAIL, f"{detail}; {err}", "gpus.max_memory in params.yaml: GPUs torch sees"))
        return None, checks
    if budget:
        detail += "; gpus.max_memory: " + ", ".join(f"cuda:{i} {b / 2**30:.1f} GiB" for i, b in sorted(budget.items()))
    checks.append(Check("device", OK, detail))
    return device, checks


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _libraries(pairs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """([dist version, ...], [missing dist, ...]) for (distribution, module) pairs; nothing is imported."""
    have, missing = [], []
    for dist, module in pairs:
        version = _version(dist)
        if version is None or importlib.util.find_spec(module) is None:
            missing.append(dist)
        else:
            have.append(f"{dist} {version}")
    return have, missing


def bnb_native_library(device: str) -> Path | None:
    """The native library bitsandbytes loads for `device` (bitsandbytes.cextension's naming), found without
    importing bitsandbytes; None when the package is not installed."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    if device != "cuda":
        return folder / "libbitsandbytes_cpu.so"
    import torch

    cuda = os.environ.get("BNB_CUDA_VERSION") or (torch.version.cuda or "").replace(".", "")
    return folder / f"libbitsandbytes_cuda{cuda}.so"


def bnb_int8_works(device: str) -> str:
    """A real LLM.int8 layer on `device`: a 64 -> 32 bitsandbytes Linear8bitLt, quantized by moving it there,
    against the fp32 layer on a 4 x 64 input. Returns what was measured; raises when the kernel does not work."""
    import torch

    from pipelines.core.logs import library_output

    with library_output("bitsandbytes"):
        import bitsandbytes as bnb

        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(32, 64, generator=generator) / 8
        x = torch.randn(4, 64, generator=generator)
        layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False, threshold=6.0)
        layer.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
        layer = layer.to(device)
        dtype = torch.float16 if device == "cuda" else torch.float32
        with torch.no_grad():
            got = layer(x.to(device, dtype)).float().cpu()
    if layer.weight.dtype != torch.int8:
        raise RuntimeError(f"the weight stayed {layer.weight.dtype}: nothing was quantized")
    want = x @ weight.T
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err < 0.05:
        raise RuntimeError(f"int8 output differs from fp32 by {err:.1%} of its largest value")
    return f"int8 Linear on {device} matches fp32 within {err:.2%}"


def _backend_checks(params, device: str | None) -> list[Check]:
    """One row per quantization method the variants name: its libraries, and whether its kernel runs on `device`."""
    rows = []
    by_method: dict[str, list[str]] = {}
    for name, v in params.variants.items():
        by_method.setdefault(v.method, []).append(name)
    for method, names in by_method.items():
        settings = [params.variants[n] for n in names]
        label = f"{method} ({', '.join(names)})"
        rows.append(_guarded(label, _backend_check, label, method, settings, device))
    return rows


def _backend_check(label: str, method: str, settings: list, device: str | None) -> Check:
    on = device or "?"
    if method == "none":
        have, missing = _libraries([("transformers", "transformers")])
        if missing:
            return Check(label, FAIL, "transformers is not installed", "bash scripts/setup.sh")
        return Check(label, OK, f"{have[0]}: the baseline in {', '.join(sorted({s.dtype for s in settings}))} on {on}")
    if method == "bnb-int8":
        have, missing = _libraries([("bitsandbytes", "bitsandbytes")])
        if missing:
            return Check(label, FAIL, "bitsandbytes is not installed: these variants could not be measured (inconclusive)",
                         "bash scripts/setup.sh (pyproject.toml pins bitsandbytes)")
        if device is None:
            return Check(label, WARN, f"{have[0]}; kernel not checked: no usable device (see device)")
        library = bnb_native_library(device)
        if library is None or not library.is_file():
            return Check(label, FAIL, f"{have[0]} has no native library for {device} ({library.name if library else '?'})",
                         "a bitsandbytes build for this torch (docs/install.md, GPU)")
        try:
            ctypes.CDLL(str(library))
            measured = bnb_int8_works(device)
        except Exception as err:  # noqa: BLE001
            return Check(label, FAIL, f"{have[0]}: LLM.int8 does not run on {device}: {type(err).__name__}: {err}",
                         "a bitsandbytes build for this torch and device (docs/install.md), or drop the int8 variant")
        return Check(label, OK, f"{have[0]} ({library.name}); {measured}")
    if method in ("awq", "gptq") and device is None:
        return Check(label, WARN, "kernel not checked: no usable device (see device)")
    if method == "awq":
        backends = {s.backend for s in settings}
        if "gptqmodel" in backends and device != "cuda":
            return Check(label, FAIL, f"backend gptqmodel on {on}: GPTQModel 7.6's AWQ needs CUDA",
                         "backend: autoawq (or auto) for these variants in params.yaml, or device cuda")
        need = [("gptqmodel", "gptqmodel")] + ([("autoawq", "awq")] if backends - {"gptqmodel"} else [])
        have, missing = _libraries(need)
        if missing:
            return Check(label, FAIL, f"{' and '.join(missing)} not installed: these variants could not be measured (inconclusive)",
                         "bash scripts/setup.sh (pyproject.toml pins autoawq and gptqmodel)")
        how = "autoawq quantizes" if backends - {"gptqmodel"} else "GPTQModel quantizes"
        kernel = ("GPTQModel's TorchAtenAwqLinear (torch, any device) runs it on the CPU, as docs/quantize.md measured"
                  if device != "cuda" else "GPTQModel picks its CUDA AWQ kernel when loading")
        return Check(label, OK, f"{', '.join(have)}: {how}, {kernel} (not imported here: that takes ~20 s)")
    if method == "gptq":
        have, missing = _libraries([("gptqmodel", "gptqmodel")])
        if missing:
            return Check(label, FAIL, "gptqmodel not installed: these variants could not be measured (inconclusive)",
                         "bash scripts/setup.sh (pyproject.toml pins gptqmodel)")
        bits = sorted({s.bits for s in settings})
        if device == "cuda":
            kernel = ("GPTQModel picks Marlin/ExLlamaV2 for 4- and 8-bit where they fit, else its torch kernel "
                      f"(all bits, any device); bits here: {', '.join(map(str, bits))}")
        else:
            kernel = f"{', '.join(map(str, bits))}-bit on GPTQModel's torch kernel (2-8 bit, any device), as on this CPU in docs/quantize.md"
        return Check(label, OK, f"{have[0]}: {kernel} (not imported here: that takes ~20 s)")
    return Check(label, WARN, f"method {method}: nothing known to check")


# --------------------------------------------------------------------------------------------
# The model and disk
# --------------------------------------------------------------------------------------------


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
                                              "or a hub id org/name")
    if source.is_reference:
        shipped = Path("reference_model")
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
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
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


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


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


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def disk_check(params) -> Check:
    """Free disk where models/ and DVC's cache are against the checkpoints this run writes (an estimate, stated)."""
    from pipelines.models.loading import resolve_model

    try:
        source = resolve_model(params.model)
    except QuantgateError:
        return Check("disk", WARN, "no estimate: the model is not found (see model)")
    folder = Path("reference_model") if source.is_reference else Path(source.location)
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
    models_free = shutil.disk_usage(_existing(Path("models"))).free
    if counts is None:
        return Check("disk", WARN, f"{size(models_free)} free at models/; no estimate (the model's "
                                   "config.json is not on this machine)")
    linear, rest = counts
    parts = {name: variant_bytes(v, linear, rest) for name, v in params.variants.items()}
    if source.is_reference:  # the shipped files copied, or a model of the same float16 shape trained
        shipped = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0
        parts["models/reference"] = max(shipped, (linear + rest) * 2)
    for name, cand in params.candidates.items():
        path = Path(cand.path)
        parts[name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
    checkpoints = int(sum(parts.values()) * 1.1)
    cache = _dvc_cache_dir()
    same_disk = os.stat(_existing(Path("models"))).st_dev == os.stat(_existing(cache)).st_dev
    needed = checkpoints * 2 if same_disk else checkpoints
    estimate = (f"{linear + rest:,} parameters -> {size(checkpoints)} of checkpoints "
                f"({', '.join(f'{k} {size(v)}' for k, v in parts.items())}, +10%)"
                + (", x2 for DVC's cache copy on the same disk" if same_disk else ""))
    if not same_disk:
        cache_free = shutil.disk_usage(_existing(cache)).free
        if cache_free < checkpoints:
            return Check("disk", FAIL, f"{size(cache_free)} free at DVC's cache {cache}, needs about "
                                       f"{size(checkpoints)}: {estimate}", "free space there, or move the cache "
                                                                          "(dvc cache dir PATH)")
    if models_free < needed:
        return Check("disk", FAIL, f"{size(models_free)} free at models/, needs about {size(needed)}: {estimate}",
                     "free space on that disk, or fewer variants")
    return Check("disk", OK, f"{size(models_free)} free at models/, needs about {size(needed)} (estimate: {estimate})")


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------
# MLflow and dvc
# --------------------------------------------------------------------------------------------


def mlflow_check(uri: str | None = None) -> Check:
    """The tracking store the record stage writes to (store.tracking.tracking_uri: MLFLOW_TRACKING_URI, else mlflow.db at the
    repository root): a SQLite file's folder writable, a server answering /health, a database's port open."""
    if uri is None:
        from pipelines.store.tracking import tracking_uri

        uri = tracking_uri()
    version = _version("mlflow")
    if version is None:
        return Check("mlflow", FAIL, "mlflow is not installed", "bash scripts/setup.sh")
    scheme = uri.split(":", 1)[0].lower() if "://" in uri or uri.startswith("sqlite:") else "file"
    where = f"MLFLOW_TRACKING_URI={uri}" if os.environ.get("MLFLOW_TRACKING_URI") else uri
    fix = "set MLFLOW_TRACKING_URI to a reachable store, or unset it for the local mlflow.db (README, MLflow)"
    if scheme == "sqlite":
        path = Path(uri[len("sqlite:///"):])  # sqlite:////abs/mlflow.db or sqlite:///relative.db
        if not path.parent.is_dir():
            return Check("mlflow", FAIL, f"{where}: folder {path.parent} does not exist", fix)
        if path.exists():
            if not os.access(path, os.W_OK):
                return Check("mlflow", FAIL, f"{where}: {path} is not writable", fix)
            try:
                with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=MLFLOW_TIMEOUT_S) as db:
                    db.execute("select count(*) from sqlite_master").fetchone()
            except sqlite3.Error as err:
                return Check("mlflow", FAIL, f"{where}: {path} is not a readable SQLite database ({err})", fix)
            return Check("mlflow", OK, f"{where} (mlflow {version}): exists, writable")
        if not os.access(path.parent, os.W_OK):
            return Check("mlflow", FAIL, f"{where}: folder {path.parent} is not writable", fix)
        return Check("mlflow", OK, f"{where} (mlflow {version}): created by the record stage")
    if scheme in ("http", "https"):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=MLFLOW_TIMEOUT_S) as reply:
                if reply.status == 200:
                    return Check("mlflow", OK, f"{where} (mlflow {version}): server answers {health}")
                said = f"HTTP {reply.status}"
        except urllib.error.HTTPError as err:
            said = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError, ValueError) as err:
            said = str(getattr(err, "reason", err))
        return Check("mlflow", FAIL, f"{where}: no MLflow server answers {health} within {MLFLOW_TIMEOUT_S:.0f} s "
                                     f"({said})", f"start it (python scripts/mlflow_server.py start --dir DIR), or {fix}")
    if scheme in ("postgresql", "mysql", "mssql") or scheme.startswith(("postgresql+", "mysql+", "mssql+")):
        parsed = urllib.parse.urlparse(uri)
        port = parsed.port or {"postgresql": 5432, "mysql": 3306, "mssql": 1433}[scheme.split("+")[0]]
        try:
            socket.create_connection((parsed.hostname or "localhost", port), timeout=MLFLOW_TIMEOUT_S).close()
        except OSError as err:
            return Check("mlflow", FAIL, f"{where}: {parsed.hostname}:{port} does not accept connections ({err})", fix)
        return Check("mlflow", OK, f"{where} (mlflow {version}): port open (credentials not checked)")
    if scheme == "file":
        path = Path(urllib.parse.urlparse(uri).path if uri.startswith("file:") else uri)
        folder = _existing(path)
        if not os.access(folder, os.W_OK):
            return Check("mlflow", FAIL, f"{where}: {folder} is not writable", fix)
        return Check("mlflow", OK, f"{where} (mlflow {version}): folder store, writable")
    return Check("mlflow", WARN, f"{where}: a {scheme} store, not checked here")


def dvc_check() -> Check:
    found = shutil.which("dvc")
    version = _version("dvc")
    if found:
        return Check("dvc", OK, f"{found} (dvc {version})")
    beside = Path(sys.executable).with_name("dvc")
    if beside.is_file():
        return Check("dvc", WARN, f"not on PATH; {beside} (dvc {version})", f"export PATH={beside.parent}:$PATH "
                                                                            "(scripts/run.sh does)")
    return Check("dvc", FAIL, "dvc is not installed", "bash scripts/setup.sh")


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def summary(checks: list[Check], seconds: float) -> str:
    fails = [c.name for c in checks if c.status == FAIL]
    warns = [c.name for c in checks if c.status == WARN]
    if fails:
        return (f"quantgate doctor: {len(fails)} of {len(checks)} checks fail ({', '.join(fails)}): the run could not "
                f"give a verdict; fix them first (exit 1; checks took {seconds:.1f} s)")
    return (f"quantgate doctor: {len(checks) - len(warns)} of {len(checks)} checks ok"
            + (f", {len(warns)} warning(s) ({', '.join(warns)})" if warns else "")
            + f": the run can give a verdict (checks took {seconds:.1f} s)")


def plain_table(checks: list[Check]) -> str:
    """Aligned columns, a remedy on its own line under the row it belongs to."""
    name_w = max(len("check"), *(len(c.name) for c in checks))
    lines = [f"{'check':<{name_w}}  status  detail"]
    for c in checks:
        lines.append(f"{c.name:<{name_w}}  {c.status.upper() if c.status == FAIL else c.status:<6}  {c.detail}")
        if c.remedy and c.status != OK:
            lines.append(f"{'':<{name_w}}  {'':<6}  -> {c.remedy}")
    return "\n".join(lines)


def print_table(checks: list[Check], seconds: float, file=None) -> None:
    """A rich table on a terminal when rich is installed; plain aligned columns otherwise (pipes, logs, tests)."""
    file = file or sys.stdout
    if file.isatty() and importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title="quantgate doctor", title_justify="left")
        for column in ("check", "status", "detail", "remedy"):
            table.add_column(column, overflow="fold")
        style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
        for c in checks:  # Text, not markup: details quote paths, errors and lists in brackets
            table.add_row(Text(c.name), Text(c.status, style=style[c.status]), Text(c.detail),
                          Text(c.remedy if c.status != OK else ""))
        console = Console(file=file, highlight=False)
        console.print(table)
        console.print(Text(summary(checks, seconds), style="bold red" if exit_code(checks) else ""))
        return
    print(plain_table(checks), file=file)
    print(summary(checks, seconds), file=file, flush=True)


def main(params: str = "params.yaml") -> int:
    """`quantgate doctor`: what the configured run needs on this machine, as a table; exit 1 when the run could not
    give a verdict."""
    import time

    started = time.perf_counter()
    checks = run_checks(params)
    print_table(checks, time.perf_counter() - started)
    return exit_code(checks)
