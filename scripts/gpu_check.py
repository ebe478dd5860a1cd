"""The Python half of scripts/gpu_memory_check.sh: what it brings to an air-gapped GPU machine and how it sets up there.

The GPU machine this project checks on reaches no package index. It has Python 3.12 with torch (CUDA), transformers,
accelerate, safetensors, tokenizers, psutil, nvidia-ml-py, pyyaml, numpy, scipy, pandas and pyarrow, and nothing
else this project installs (no pydantic, bitsandbytes, matplotlib, dvc, mlflow, lm-eval, gptqmodel, autoawq). What the
check's code path imports beyond that travels as wheels in `.gpu_wheels/`, at most 64 MiB with the working tree.

    python3 scripts/gpu_check.py prepare [--dest .gpu_wheels]     # on a machine that reaches PyPI
    python3 scripts/gpu_check.py install --wheels DIR --target DIR  # on the GPU machine: offline, into DIR only
    python3 scripts/gpu_check.py setup --device cuda --size full    # in the check's work folder: model + params.yaml
    python3 scripts/gpu_check.py memory-report                       # the memory-report stage (charts if matplotlib is there)

`prepare` and `install` use the standard library only (plus pip: scripts/gpu_wheels.py); the others import the
project (`pipelines`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_wheels.py beside it, also when loaded by path (tests)
import gpu_wheels as wheels  # noqa: E402
from gpu_wheels import NOT_BROUGHT, ROOT, SetupError  # noqa: E402

# The variants beyond fp16 and int8: tried only where every module they need imports (calibrate needs datasets and
# matplotlib, the quantizer its library).
OPTIONAL_VARIANTS = {
    "awq4": (("awq", "datasets", "matplotlib"), "autoawq"),
    "gptq3": (("gptqmodel", "datasets", "matplotlib"), "gptqmodel"),
}

# The modules of the check's code path, imported before anything runs so that a missing package is named at once.
CHECK_MODULES = ("pipelines.cli", "pipelines.core.params", "pipelines.models.loading", "pipelines.quantize", "pipelines.memory",
                 "pipelines.measure.verdict", "pipelines.core.isolation")


# --------------------------------------------------------------------------------------------
# setup: in the check's work folder (a copy of pipelines/ and params.yaml)
# --------------------------------------------------------------------------------------------

SIZES = {
    # ~0.5B parameters: 131M in the embeddings and the (untied) output layer, 45M per decoder layer
    "full": {"model": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096),
             # expected a few minutes on one H100/H200; the timeouts bound a hang to about 10 minutes in all
             "memory": dict(max_tokens=4096, warmup_rounds=2, rounds=10, max_rounds=24, tail_rounds=8,
                            timeout_seconds=180),
             "quantize_timeout": 120},
    # the same flow in seconds on a CPU (tests/test_gpu_memory_check.py)
    "tiny": {"model": dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
             "memory": dict(max_tokens=64, seq_fractions=[0.5, 1.0], sweep_batch=2, decode_tokens=4, warmup_rounds=1,
                            rounds=10, max_rounds=10, tail_rounds=4, burst_size=2, alternations=2, timeout_seconds=120),
             "quantize_timeout": 120},
}


def importable(modules: tuple[str, ...]) -> str | None:
    """None when every module imports (each in a fresh process: GPU libraries print and initialise), else why not."""
    for module in modules:
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1]
            return f"`import {module}` fails here ({last[:200]})"
    return None


def preflight() -> None:
    """Import every module of the check's code path now: a missing package is named before any work is done."""
    for module in CHECK_MODULES:
        try:
            __import__(module)
        except ModuleNotFoundError as err:
            raise SetupError(f"{module} needs the package {err.name!r}, which this Python ({sys.executable}) does not "
                             "have: run `bash scripts/gpu_memory_check.sh --prepare` on a machine that reaches PyPI "
                             "and bring .gpu_wheels/ along") from None


def setup(device: str, size: str, reference: Path) -> list[str]:
    """Random Llama (fp16) with the reference model's tokenizer in models/random-llama, params.yaml pointed at it,
    and the variants to run (fp16, int8, and awq4/gptq3 where their libraries import); skipped.json says why not."""
    preflight()
    import torch
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    if device == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}); this check "
                         "measures the CUDA path. To try its setup on a CPU: QUANTGATE_GPU_CHECK_DEVICE=cpu "
                         "QUANTGATE_GPU_CHECK_SIZE=tiny bash scripts/gpu_memory_check.sh")
    preset = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(**preset["model"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float16)
    out = Path("models/random-llama")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # shipped in git (reference_model/): no DVC output needed
        shutil.copy(reference / name, out / name)
    n_params = model.num_parameters()
    del model

    skipped = {}
    variants = ["fp16", "int8"]
    for name, (modules, library) in OPTIONAL_VARIANTS.items():
        why = importable(modules)
        if why:
            skipped[name] = f"skipped: {why}; not brought: {NOT_BROUGHT[library]}"
        else:
            variants.append(name)
    params = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
    params.update(model=str(out), device=device)
    params["variants"] = {k: v for k, v in params["variants"].items() if k in variants}
    params["candidates"] = {}
    params["calibration"].update(samples=128)
    params["memory"].update(preset["memory"])
    params.setdefault("quantize", {})["timeout_seconds"] = preset["quantize_timeout"]
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    Path("skipped.json").write_text(json.dumps(skipped, indent=2) + "\n", encoding="utf-8")
    print(f"random Llama: {n_params / 1e6:.0f}M parameters (fp16), tokenizer from {reference.name}/ -> {out}")
    for name, why in skipped.items():
        print(f"{name}: {why}")
    return variants


# --------------------------------------------------------------------------------------------
# memory-report: the project's stage (without matplotlib it writes the summary and skips the charts)
# --------------------------------------------------------------------------------------------


def memory_report() -> int:
    """`quantgate memory-report`: the GPU machine has no room for matplotlib in its wheels, and the stage then writes
    its summary without the charts."""
    from pipelines import cli

    return cli.main(["memory-report"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download the wheels the GPU machine lacks (needs PyPI)")
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu_wheels")
    p.add_argument("--python-version", default=wheels.BOX_PYTHON)
    p.add_argument("--find-links", type=Path, help="take the wheels from this folder, not the package index")
    p = sub.add_parser("install", help="install them offline into --target")
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--target", type=Path, required=True)
    p = sub.add_parser("setup", help="random Llama + params.yaml in the current folder; prints the variants to run")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", choices=tuple(SIZES), default="full")
    p.add_argument("--reference", type=Path, default=ROOT / "reference_model")
    p.add_argument("--variants-file", type=Path, default=Path("variants.txt"))
    sub.add_parser("memory-report", help="the memory-report stage (its charts only where matplotlib is installed)")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            wheels.prepare(args.dest, args.python_version, args.find_links)
        elif args.command == "install":
            report = wheels.install(args.wheels.resolve(), args.target.resolve())
            for dist, version in report["machine"].items():
                print(f"  {dist} {version}: this machine's own")
            for dist, version in report["installed"].items():
                print(f"  {dist} {version}: installed offline from {args.wheels} into {args.target}")
        elif args.command == "setup":
            variants = setup(args.device, args.size, args.reference.resolve())
            args.variants_file.write_text("\n".join(variants) + "\n", encoding="utf-8")
        else:
            return memory_report()
    except SetupError as err:
        print(f"gpu_memory_check: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
