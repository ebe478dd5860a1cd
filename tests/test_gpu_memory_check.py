"""scripts/gpu_memory_check.sh's setup, on a CPU, in a Python that imitates the air-gapped GPU machine.

That machine (stack.md, "The air-gapped GPU machine") has torch, transformers, accelerate, safetensors, tokenizers,
numpy, scipy, pandas, pyarrow, psutil, nvidia-ml-py and pyyaml, and not pydantic, bitsandbytes, matplotlib, dvc,
mlflow, lm-eval, gptqmodel or autoawq. Here a fresh venv (no system site-packages) gets exactly those packages and
what they require, symlinked from the project's .venv, minus what the machine lacks: `python3` of that venv is
"the machine's". The check then runs as it would there: from a copy of the git working tree, with the wheels that
`--prepare` brings installed offline into a temporary folder, quantgate not installed.

What differs from the machine, and why: this is CPython 3.11 with torch 2.13 (CPU), not 3.12 with torch 2.11 (CUDA);
the wheels are this .venv's own installed copies of the pinned distributions packed as py3 wheels (the cp312 ones do
not import on 3.11, and tests download nothing), taken by `prepare` from a local folder instead of PyPI; the device is
the CPU and the model tiny (QUANTGATE_GPU_CHECK_DEVICE=cpu, QUANTGATE_GPU_CHECK_SIZE=tiny), so the CUDA probe and
NVML are not exercised. What `--prepare` downloads from PyPI, and that those cp312 wheels install offline on a
Python 3.12, was checked by hand (docs/memory.md, "On an air-gapped GPU machine").
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
os.environ.update(OFFLINE)

# What the GPU machine has (each with what it requires) and what it does not (stack.md). pip stands in for the
# machine's own pip. typer 0.29 (huggingface_hub's CLI) requires pydantic here; the machine has no pydantic.
MACHINE_HAS = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "scipy", "pandas",
               "pyarrow", "psutil", "nvidia-ml-py", "pyyaml", "pip")
MACHINE_LACKS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pydantic-settings",
                 "bitsandbytes", "matplotlib", "dvc", "mlflow", "lm-eval", "gptqmodel", "autoawq", "datasets",
                 "quantgate")


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, importlib.metadata.Distribution]:
    """This .venv's own site-packages only: other sys.path entries an earlier test or import added (setuptools puts
    its `_vendor` folder, with its own packaging-*.dist-info, on sys.path) would shadow the venv's copies."""
    purelib = sysconfig.get_paths()["purelib"]
    return {norm(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[purelib])}


def _closure(names, dists) -> set[str]:
    """The distributions `names` require, transitively (no extras), among those installed here."""
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        seen.add(name)
        for text in dists[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    return seen


def _top_level(dist) -> set[str]:
    """The site-packages entries a distribution owns (from its RECORD)."""
    return {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def make_machine_python(where: Path, with_pip: bool = True) -> Path:
    """A venv whose site-packages holds only what the GPU machine has: symlinks into this .venv."""
    dists = _installed()
    lacks = {norm(n) for n in MACHINE_LACKS} | ({"pip"} if not with_pip else set())
    allowed = _closure([n for n in MACHINE_HAS if with_pip or n != "pip"], dists) - lacks
    missing = [n for n in MACHINE_HAS if norm(n) not in dists and (with_pip or n != "pip")]
    assert not missing, f"this .venv lacks {missing}: run scripts/setup.sh"
    entries = {e for name in allowed for e in _top_level(dists[name])} - {"__pycache__"}
    denied = {e for name in lacks if name in dists for e in _top_level(dists[name])}
    assert not entries & denied, f"shared top-level entries would leak packages the machine lacks: {entries & denied}"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python3"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    source = Path(sysconfig.get_paths()["purelib"])
    for entry in sorted(entries):
        if (source / entry).exists() and not entry.endswith(".pth"):
            (site / entry).symlink_to(source / entry)
    return py


def repack_as_wheel(distribution: str, out_dir: Path) -> Path:
    """This .venv's installed copy of `distribution` as a py3-none-any wheel (its files, a fresh RECORD)."""
    dist = importlib.metadata.distribution(distribution)
    name, version = re.sub(r"[-.]+", "_", dist.metadata["Name"]), dist.version
    files = [f for f in dist.files if not str(f).startswith("..") and "__pycache__" not in str(f)]
    info = next(Path(str(f)).parts[0] for f in files if str(f).endswith(".dist-info/METADATA"))
    skip = {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "WHEEL")}
    path = out_dir / f"{name}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as whl:
        contents = [(str(f), f.locate().read_bytes()) for f in files if str(f) not in skip]
        contents.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: quantgate-tests\nRoot-Is-Purelib: false\n"
                                          b"Tag: py3-none-any\n"))
        for arcname, data in contents:
            whl.writestr(arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arcname},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def copy_of_tree(dest: Path) -> Path:
    """The git working tree as it travels: tracked files and new ones not ignored (no .venv, models/, .gpu_wheels/)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """(python3 of the imitated machine, a copy of the working tree, the wheels `--prepare` made)."""
    base = tmp_path_factory.mktemp("airgap")
    python = make_machine_python(base / "machine")
    tree = copy_of_tree(base / "tree")
    local = base / "local-index"
    local.mkdir()
    for dist, _, _ in gpu_check.wheels.WHEELS:
        repack_as_wheel(dist, local)
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "prepare", "--dest", str(tree / ".gpu_wheels"),
                           "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
                           "--find-links", str(local)], cwd=tree, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"wheels: [\d,]+ B \([\d.]+ MiB\) in 6 files", done.stdout), done.stdout
    return python, tree, tree / ".gpu_wheels"


def machine_env(pythonpath: list[Path] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **OFFLINE, **({"PYTHONPATH": os.pathsep.join(map(str, pythonpath))} if pythonpath else {})}


def run_machine(python: Path, code: str, cwd: Path, pythonpath: list[Path] = ()) -> subprocess.CompletedProcess:
    env = machine_env(pythonpath)
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)


def test_the_wheels_are_pinned_as_constraints_txt_pins_them():
    pinned = gpu_check.wheels.pins(ROOT / "constraints.txt")
    specs = gpu_check.wheels.wheel_specs(ROOT / "constraints.txt")
    assert [s.split("==")[0] for s in specs] == [d for d, _, _ in gpu_check.wheels.WHEELS]
    for spec in specs:
        name, version = spec.split("==")
        assert pinned[norm(name)] == version
    assert "bitsandbytes==0.50.2" in specs and not {"matplotlib", "dvc", "mlflow"} & {s.split("==")[0] for s in specs}


def test_prepare_writes_the_manifest_and_checks_the_budget(machine):
    _, _, wheels = machine
    manifest = json.loads((wheels / "wheels.json").read_text())
    assert {r["distribution"] for r in manifest["wheels"]} == {d for d, _, _ in gpu_check.wheels.WHEELS}
    assert sorted(p.name for p in wheels.glob("*.whl")) == sorted(r["file"] for r in manifest["wheels"])
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in wheels.glob("*.whl")) <= manifest["budget_bytes"]


def test_the_machine_python_lacks_what_the_gpu_machine_lacks(machine):
    python, tree, _ = machine
    done = run_machine(python, "import torch, transformers, accelerate, scipy, psutil, pynvml, yaml, tqdm; "
                               "print(torch.__file__)", tree)
    assert done.returncode == 0, done.stderr
    for module in ("pydantic", "bitsandbytes", "matplotlib", "dvc", "mlflow", "pipelines"):
        assert run_machine(python, f"import {module}", ROOT / "docs").returncode != 0, module
    without = run_machine(python, "import pipelines.core.params", tree, [tree])
    assert "No module named 'pydantic'" in without.stderr


def test_the_wheels_are_exactly_what_the_checks_code_path_imports(machine, tmp_path):
    """Installed offline into a folder of their own, the wheels make every module of the check's path import; each
    one is imported there (nothing brought for nothing); matplotlib is not needed."""
    python, tree, wheels = machine
    target = tmp_path / "site"
    done = subprocess.run([python, "scripts/gpu_check.py", "install", "--wheels", str(wheels), "--target", str(target)],
                          cwd=tree, capture_output=True, text=True, env=machine_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "typing_extensions 4.16.0: this machine's own" in done.stdout  # torch brought it
    for dist in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "bitsandbytes"):
        assert re.search(rf"^  {re.escape(dist)} [\d.]+: installed offline", done.stdout, re.M), done.stdout
    code = ("import json, sys\n"
            f"import {', '.join(gpu_check.CHECK_MODULES)}\n"
            "import bitsandbytes\n"
            "print(json.dumps({m: getattr(sys.modules[m], '__file__', None) for m in sys.modules if '.' not in m}))")
    done = run_machine(python, code, tree, [target, tree])
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    for _, module, _ in gpu_check.wheels.WHEELS:
        assert module in loaded, f"{module} is brought but the check's path does not import it"
    from_target = {m for m, f in loaded.items() if f and Path(f).is_relative_to(target)}
    assert from_target == {"pydantic", "pydantic_core", "annotated_types", "typing_inspection", "bitsandbytes"}
    assert "matplotlib" not in loaded and "datasets" not in loaded


def test_install_without_pip_unpacks_the_wheels(machine, tmp_path):
    _, tree, wheels = machine
    python = make_machine_python(tmp_path / "nopip", with_pip=False)
    assert run_machine(python, "import pip", tree).returncode != 0
    target = tmp_path / "site"
    done = subprocess.run([python, "scripts/gpu_check.py", "install", "--wheels", str(wheels), "--target", str(target)],
                          cwd=tree, capture_output=True, text=True, env=machine_env())
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_machine(python, "import pipelines.core.params, bitsandbytes, importlib.metadata as m; "
                               "print(m.version('pydantic'))", tree, [target, tree])
    assert done.returncode == 0 and done.stdout.strip() == "2.14.4", done.stderr


def _check(python: Path, tree: Path, out: Path, **env) -> subprocess.CompletedProcess:
    path = f"{python.parent}{os.pathsep}{os.environ['PATH']}"
    full = {**os.environ, **OFFLINE, "PATH": path, "QUANTGATE_GPU_CHECK_DEVICE": "cpu",
            "QUANTGATE_GPU_CHECK_SIZE": "tiny", **env}
    for key in ("PYTHON", "PYTHONPATH", "VIRTUAL_ENV"):
        full.pop(key, None)
    return subprocess.run(["bash", "scripts/gpu_memory_check.sh", str(out)], cwd=tree, capture_output=True,
                          text=True, env=full, timeout=600)


def test_without_the_wheels_the_check_says_what_to_run(machine, tmp_path):
    python, tree, _ = machine
    done = _check(python, tree, tmp_path / "out", QUANTGATE_GPU_WHEELS=str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert "this Python lacks pydantic" in done.stderr and "bash scripts/gpu_memory_check.sh --prepare" in done.stderr


@pytest.fixture(scope="module")
def end_to_end(machine, tmp_path_factory) -> dict:
    """The whole check on a CPU, as the machine runs it, kept by content (tests/content_cache.py): everything the copied
    tree holds of pipelines/ and scripts/ (the script runs the stages from it), this module, and the packages the
    imitated machine links to (the cache's key holds every installed version)."""
    from pipelines.core.lineage import checkout_files
    from tests.content_cache import cached

    python, tree, _ = machine

    def build(folder: Path) -> dict:
        before = sorted(p for p in tree.rglob("*") if ".gpu_wheels" not in p.parts)
        done = _check(python, tree, folder / "out")
        after = sorted(p for p in tree.rglob("*") if ".gpu_wheels" not in p.parts)
        return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                "tree_unchanged": after == before, "out": folder / "out"}

    shipped = [f for f in checkout_files(ROOT) if f.split("/")[0] in ("pipelines", "scripts") and (ROOT / f).is_file()]
    return cached(tmp_path_factory, "gpu_check_end_to_end", build, helpers=[*shipped, "tests/test_gpu_memory_check.py"])


def test_the_check_runs_end_to_end_on_cpu_as_on_the_machine(end_to_end):
    """fp16 and int8 of a random Llama through quantize, memory and memory-report, with the machine's packages plus
    the wheels: awq4 and gptq3 skipped with the reason, the charts skipped (no matplotlib), the summary printed."""
    done, out = SimpleNamespace(**end_to_end), end_to_end["out"]
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    assert "GPU MEMORY CHECK: OK: fp16, int8 on cpu; awq4, gptq3 skipped" in done.stdout
    assert "installed offline" in done.stdout and "random Llama" in done.stdout
    assert "awq4: skipped: `import awq` fails here" in done.stdout
    assert "gptq3: skipped: `import gptqmodel` fails here" in done.stdout
    assert "charts not drawn: matplotlib is not installed here" in text  # the stage warns on its log (stderr)
    assert "the CUDA path (allocator stats, NVML, several GPUs) was NOT exercised" in done.stdout
    assert "memory-report fp16" in text and "memory-report int8" in text
    summary = json.loads((out / "memory_summary.json").read_text())
    assert summary["baseline_ok"] and set(summary["variants"]) == {"fp16", "int8"}
    for name, row in summary["variants"].items():
        assert row["status"] == "ok" and row["device"] == "cpu", (name, row)
        assert row["footprint_bytes"] > 0 and row["measured_rounds"] >= 10
    assert summary["variants"]["int8"]["footprint_bytes"] < summary["variants"]["fp16"]["footprint_bytes"]
    assert '"baseline": "fp16"' in done.stdout  # the summary is printed
    assert set(json.loads((out / "skipped.json").read_text())) == {"awq4", "gptq3"}
    for name in ("fp16", "int8"):
        result = json.loads((out / "memory" / f"{name}.json").read_text())
        assert result["status"] == "ok" and result["device"] == "cpu"
    assert not list(out.glob("*.png"))
    # the attribution step: on a CPU it needs memray, which the GPU machine lacks (its CUDA path does not): the
    # tracer's failure is recorded, the injected growth still judged a leak; allocators are CUDA-only, and say so
    traced = json.loads((out / "attribution" / "fp16.json").read_text())
    assert traced["growth_cause"]["status"] == "failed" and "memray" in traced["growth_cause"]["error"]
    assert traced["leak"]["leak"] is True and "skipped" in traced["allocators"]
    assert "ATTRIBUTION NOT SHOWN" in done.stdout
    assert json.loads((out / "memory" / "fp16.json").read_text()).get("injected_leak") is None  # the clean run kept
    assert done.tree_unchanged  # all in a temporary folder


def test_on_a_machine_without_a_gpu_cuda_is_refused_with_the_cpu_command(machine, tmp_path):
    python, tree, _ = machine
    done = _check(python, tree, tmp_path / "out", QUANTGATE_GPU_CHECK_DEVICE="cuda")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sees no CUDA device" in done.stderr and "QUANTGATE_GPU_CHECK_DEVICE=cpu" in done.stderr
