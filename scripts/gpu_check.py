"""The Python half of scripts/gpu_memory_check.sh: what it brings to an air-gapped GPU machine and how it sets up there.

The GPU machine this project checks on reaches no package index. It has Python 3.12 with torch (CUDA), transformers,
accelerate, safetensors, tokenizers, psutil, nvidia-ml-py, pyyaml, numpy, scipy, pandas and pyarrow, and nothing
else this project installs (no pydantic, bitsandbytes, matplotlib, dvc, mlflow, lm-eval, gptqmodel, autoawq). What the
check's code path imports beyond that travels as wheels in `.gpu_wheels/`, at most 64 MiB with the working tree.

    python3 scripts/gpu_check.py prepare [--dest .gpu_wheels]     # on a machine that reaches PyPI
    python3 scripts/gpu_check.py install --wheels DIR --target DIR  # on the GPU machine: offline, into DIR only
    python3 scripts/gpu_check.py setup --device cuda --size full    # in the check's work folder: model + params.yaml
    python3 scripts/gpu_check.py memory-report                       # the memory-report stage (charts if matplotlib is there)

`prepare` and `install` use the standard library only (plus pip); the others import the project (`pipelines`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
MANIFEST = "wheels.json"
BOX_PYTHON = "3.12"
BUDGET_BYTES = 64 * 2**20  # what may travel to the GPU machine beside the git working tree, the tree included
# pip download --platform takes exactly the tags it is given (no older manylinux ones): bitsandbytes 0.50.2's wheel is
# manylinux_2_24, pydantic-core's manylinux_2_17; the GPU machine's glibc takes every one of these.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")

# What the check's code path imports that the GPU machine lacks: (distribution, import name, who needs it).
# `python3 -m pipelines.cli quantize fp16|int8`, `memory <variant>` and `memory-report` import pipelines.core.params
# (pydantic: every stage validates params.yaml with it) and, for int8, bitsandbytes. Everything else they import at
# module level (torch, transformers, accelerate, numpy, scipy, psutil, pynvml, yaml, tqdm) the machine has; tests/
# test_gpu_memory_check.py imports every module of that path with only the machine's packages plus these.
WHEELS = (
    ("pydantic", "pydantic", "pipelines/core/params.py: every stage validates params.yaml with it"),
    ("pydantic-core", "pydantic_core", "pydantic's compiled core"),
    ("annotated-types", "annotated_types", "required by pydantic"),
    ("typing-inspection", "typing_inspection", "required by pydantic"),
    ("typing_extensions", "typing_extensions", "pydantic needs a newer one than torch may have brought"),
    ("bitsandbytes", "bitsandbytes", "the int8 variant (method bnb-int8)"),
)

# What the check could use but does not bring, and why (printed by `prepare` and by the check where it matters).
NOT_BROUGHT = {
    "matplotlib": "memory-report's two charts: matplotlib and its dependencies (contourpy, cycler, fonttools, "
                  "kiwisolver, pillow, pyparsing) are 24 MB of cp312 wheels, which with bitsandbytes' 43 MB pass the "
                  "64 MiB budget; the memory summary does not need them",
    "autoawq": "autoawq 0.2.9 has no cp312 binary wheel, and awq4's calibration set needs datasets and matplotlib",
    "gptqmodel": "gptqmodel 7.6.0 has no cp312 binary wheel, and gptq3's calibration set needs datasets and "
                 "matplotlib",
}

# The variants beyond fp16 and int8: tried only where every module they need imports (calibrate needs datasets and
# matplotlib, the quantizer its library).
OPTIONAL_VARIANTS = {
    "awq4": (("awq", "datasets", "matplotlib"), "autoawq"),
    "gptq3": (("gptqmodel", "datasets", "matplotlib"), "gptqmodel"),
}

# The modules of the check's code path, imported before anything runs so that a missing package is named at once.
CHECK_MODULES = ("pipelines.cli", "pipelines.core.params", "pipelines.models.loading", "pipelines.quantize", "pipelines.memory",
                 "pipelines.measure.memory_verdict", "pipelines.core.isolation")


class SetupError(Exception):
    """What is missing and the command that fixes it."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{normalized distribution: version} from constraints.txt's `name==version` lines."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[normalize(name)] = version.strip()
    return out


def wheel_specs(constraints: Path = CONSTRAINTS) -> list[str]:
    """`name==version` for every wheel the check brings, pinned as constraints.txt pins it (unpinned if it does not)."""
    pinned = pins(constraints) if constraints.is_file() else {}
    return [f"{dist}=={pinned[normalize(dist)]}" if normalize(dist) in pinned else dist for dist, _, _ in WHEELS]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(normalized distribution, version) from a wheel's file name."""
    parts = filename[:-len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def write_manifest(folder: Path, python: str = BOX_PYTHON) -> dict:
    """wheels.json: each wheel's distribution, version, import name, size and sha256, and the total."""
    by_dist = {normalize(d): (d, module) for d, module, _ in WHEELS}
    rows = []
    for path in sorted(folder.glob("*.whl")):
        dist, version = wheel_name_version(path.name)
        if dist not in by_dist:
            raise SetupError(f"{path}: not a wheel the check needs ({', '.join(d for d, _, _ in WHEELS)})")
        rows.append({"distribution": by_dist[dist][0], "import": by_dist[dist][1], "version": version,
                     "file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)})
    missing = [d for d, _, _ in WHEELS if normalize(d) not in {normalize(r["distribution"]) for r in rows}]
    if missing:
        raise SetupError(f"{folder}: no wheel for {', '.join(missing)}")
    manifest = {"python": python, "platforms": list(PLATFORMS), "wheels": rows,
                "total_bytes": sum(r["bytes"] for r in rows), "budget_bytes": BUDGET_BYTES}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def tree_bytes(root: Path = ROOT) -> int | None:
    """Bytes of the git working tree's tracked files (what travels besides the wheels); None outside git."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((root / f).stat().st_size for f in files.decode().split("\0") if f and (root / f).is_file())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------
# prepare: on a machine that reaches PyPI
# --------------------------------------------------------------------------------------------


def prepare(dest: Path, python: str = BOX_PYTHON, find_links: Path | None = None) -> dict:
    """Download exactly the wheels in WHEELS for CPython `python` on x86-64 Linux into `dest` (replacing it),
    write wheels.json, and check the total against the 64 MiB budget. `find_links`: a local wheel folder to take them
    from instead of the package index."""
    specs = wheel_specs()
    dest = dest.resolve()
    staging = Path(tempfile.mkdtemp(prefix="quantgate-gpu-wheels-"))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(staging),
               *(["--no-index", "--find-links", str(find_links)] if find_links else []), *specs]
        print("+ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            raise SetupError("pip download failed (above); this step needs a machine that reaches PyPI")
        manifest = write_manifest(staging, python)
        tree = tree_bytes()
        in_all = manifest["total_bytes"] + (tree or 0)
        for row in manifest["wheels"]:
            print(f"  {row['file']:<72} {row['bytes']:>11,} B")
        print(f"wheels: {manifest['total_bytes']:,} B ({mib(manifest['total_bytes'])}) in {len(manifest['wheels'])} files"
              + (f"; with the git working tree ({mib(tree)}): {mib(in_all)} of {mib(BUDGET_BYTES)}" if tree else ""))
        if in_all > BUDGET_BYTES:
            raise SetupError(f"{mib(in_all)} is over the {mib(BUDGET_BYTES)} that may travel to the GPU machine")
        for name, why in NOT_BROUGHT.items():
            print(f"not brought: {name} ({why})")
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(staging), str(dest))
        print(f"-> {dest}: bring it along (an ignored folder) and run `bash scripts/gpu_memory_check.sh` there")
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# install: on the GPU machine, offline, into a folder of its own (the machine's site-packages are not touched)
# --------------------------------------------------------------------------------------------


def _version_key(version: str) -> tuple:
    try:
        from packaging.version import Version  # transformers needs packaging: the machine has it

        return (Version(version),)
    except Exception:  # noqa: BLE001 - no packaging, or a version it cannot read: compare the numbers
        return tuple(int(x) for x in re.findall(r"\d+", version))


def have(distribution: str, module: str) -> str | None:
    """The version of `distribution` this interpreter already has (and can import `module` from), else None."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if importlib.util.find_spec(module) is not None else None


def _pip_works() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def install(wheels: Path, target: Path) -> dict:
    """Install into `target`, offline, the wheels of WHEELS this interpreter lacks or has older than the pinned
    version; report what is used from where. A machine that has them all (a project .venv) needs no wheels at all.

    With pip: `pip install --no-index --no-deps --target`; without pip (or where it refuses), the wheels are unpacked
    (all of them are plain purelib/platlib wheels, no scripts or data). Nothing outside `target` is written."""
    manifest_path = wheels / MANIFEST
    fix = ("run `bash scripts/gpu_memory_check.sh --prepare` on a machine that reaches PyPI and bring "
           f"{wheels.name}/ along (it is git-ignored: copy it with the working tree)")
    pinned = pins() if CONSTRAINTS.is_file() else {}
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else None
    brought = {normalize(r["distribution"]): r for r in (manifest or {}).get("wheels", [])}
    todo, report = [], {"installed": {}, "machine": {}}
    for dist, module, why in WHEELS:
        want = (brought.get(normalize(dist)) or {}).get("version") or pinned.get(normalize(dist))
        there = have(dist, module)
        if there is not None and (want is None or _version_key(there) >= _version_key(want)):
            report["machine"][dist] = there
            continue
        lacks = f"this Python lacks {dist}" + (f" (it has {there}, older than {want})" if there else "") + f": {why}"
        if manifest is None:
            raise SetupError(f"{lacks}; {manifest_path}: not found; {fix}")
        row = brought.get(normalize(dist))
        path = wheels / row["file"] if row else None
        if path is None or not path.is_file():
            raise SetupError(f"{lacks}; no wheel for it in {wheels}; {fix}")
        if path.stat().st_size != row["bytes"] or sha256(path) != row["sha256"]:
            raise SetupError(f"{path}: size or sha256 differs from {manifest_path} (a truncated copy?); {fix}")
        todo.append(row)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wrong = [r["file"] for r in todo if not _fits_this_python(r["file"])]
    if wrong:
        raise SetupError(f"{', '.join(wrong)}: built for CPython {manifest['python']}, and this Python "
                         f"({sys.executable}) is {here}: run `python3 scripts/gpu_check.py prepare --python-version "
                         f"{here}` on a machine that reaches PyPI and bring {wheels.name}/ along")
    target.mkdir(parents=True, exist_ok=True)
    if todo:
        done = None
        if _pip_works():
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--find-links", str(wheels), "--target", str(target),
                   *[f"{r['distribution']}=={r['version']}" for r in todo]]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:  # a pip that refuses (PIP_REQUIRE_VIRTUALENV, a constraint file): unpack instead
                print(f"  pip install --target failed ({done.stderr.strip().splitlines()[-1:]}); unpacking the wheels")
        if done is None or done.returncode:
            for row in todo:
                with zipfile.ZipFile(wheels / row["file"]) as whl:
                    whl.extractall(target)
        report["installed"] = {r["distribution"]: r["version"] for r in todo}
    return report


def _fits_this_python(filename: str) -> bool:
    """Whether a wheel's Python tag (`cp312`, `py3`, ...) takes this interpreter (all of them are x86-64 Linux)."""
    tags = filename[:-len(".whl")].split("-")[-3].split(".")
    major, minor = sys.version_info.major, sys.version_info.minor
    return any(t in (f"cp{major}{minor}", f"py{major}", f"py{major}{minor}") for t in tags)


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
# memory-report: the project's stage; without matplotlib, the same summary without the two charts
# --------------------------------------------------------------------------------------------


def memory_report() -> int:
    """`quantgate memory-report` where matplotlib imports. Without it (the GPU machine: no room for it in the wheels)
    the stage's own summary, memory_verdict.summarize over the same results, written where the stage writes it
    (pipelines/core/plots.py imports matplotlib at module level, so the stage itself cannot run there)."""
    from pipelines import cli

    if importlib.util.find_spec("matplotlib") is not None:
        return cli.main(["memory-report"])
    from pipelines.core import logs
    from pipelines.measure import memory_verdict
    from pipelines.core.io import read_json, write_json
    from pipelines.core.params import load_params

    logs.setup()
    print(f"memory-report: charts not drawn: matplotlib is not installed here ({NOT_BROUGHT['matplotlib']})",
          flush=True)
    params = load_params()
    results = {}
    for name in [*params.variants, *params.candidates]:
        path = cli.MEMORY_DIR / f"{name}.json"
        results[name] = read_json(path) if path.is_file() else {"status": "failed", "error": f"{path} missing"}
    summary = memory_verdict.summarize(results, params.memory)
    write_json(memory_verdict.SUMMARY, summary)
    for name, row in summary["variants"].items():
        if row["status"] == "ok":
            excess = row["growth_excess_pct"]
            print(f"memory-report {name:<10} footprint {row['footprint_bytes']:>14,} B  growth excess vs fp16 "
                  f"{'n/a' if excess is None else f'{excess:+.3f} %'}  leak {row['leak']}"
                  + (f"  OUT OF MEMORY: {row['oom']}" if row["oom"] else ""))
        else:
            print(f"memory-report {name:<10} FAILED: {row['error']}")
    print(f"memory-report: {memory_verdict.SUMMARY}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download the wheels the GPU machine lacks (needs PyPI)")
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu_wheels")
    p.add_argument("--python-version", default=BOX_PYTHON)
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
            prepare(args.dest, args.python_version, args.find_links)
        elif args.command == "install":
            report = install(args.wheels.resolve(), args.target.resolve())
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
