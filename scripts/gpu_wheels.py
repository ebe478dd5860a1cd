"""The wheels scripts/gpu_memory_check.sh brings to an air-gapped GPU machine: which, downloading them, installing them.

`prepare` runs on a machine that reaches PyPI, `install` on the GPU machine, offline, into a folder of its own.
Standard library only (plus pip): this runs before anything the project needs is installed. scripts/gpu_check.py
is the command line.
"""

from __future__ import annotations

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
