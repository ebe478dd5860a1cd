"""Which model is under test, where its weights come from, and the one loader every stage uses.

`model:` in params.yaml is `reference` (the embedded model this project trains), a local Hugging
Face checkpoint directory, a GGUF file (a path, or `pkg:DIST==VERSION/FILE` that an installed package ships:
pipelines/models/gguf.py), or a hub id (`org/name`) for users with hub access. The reference and GGUF kinds are
built into models/reference by the reference stage; every later stage reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.params import HUB_ID, profile_hint
from pipelines.core.paths import MANIFEST, REFERENCE_DIR


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "reference", "local", "gguf" or "hub"
    location: str  # what from_pretrained() takes
    origin: str | None = None  # gguf: the file as params.yaml names it, which the reference stage dequantizes

    @property
    def is_reference(self) -> bool:
        return self.kind == "reference"

    @property
    def built_by_reference_stage(self) -> bool:
        """The reference stage writes this model into models/reference (trained, copied or dequantized)."""
        return self.kind in ("reference", "gguf")


def resolve_model(spec: str) -> ModelSource:
    """Turn the `model:` setting into a source; anything else stops with a one-line reason."""
    if spec == "reference":
        return ModelSource("reference", str(REFERENCE_DIR))
    from pipelines.models import gguf

    if gguf.is_gguf_spec(spec):
        gguf.find(spec)  # a missing file or package stops here, naming it
        return ModelSource("gguf", str(REFERENCE_DIR), origin=spec)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantgateError(f"params.yaml: model: {spec} is a file; expected a checkpoint directory or a "
                                 f".gguf file{profile_hint()}")
        if not (path / "config.json").is_file():
            raise QuantgateError(f"params.yaml: model: {path} has no config.json; expected a Hugging Face checkpoint"
                                 f"{profile_hint()}")
        return ModelSource("local", str(path))
    if HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return ModelSource("hub", spec)
    raise QuantgateError(
        f"params.yaml: model: {spec!r} is not 'reference', an existing checkpoint directory, a .gguf file "
        f"(or pkg:DISTRIBUTION==VERSION/FILE.gguf), or a hub id of the form org/name{profile_hint()}"
    )


def load_tokenizer(source: ModelSource):
    """The model's own tokenizer: token counts everywhere are measured with it."""
    from transformers import AutoTokenizer

    if source.built_by_reference_stage and not (Path(source.location) / "tokenizer.json").is_file():
        raise QuantgateError(f"{source.location}: no tokenizer; run `dvc repro reference` (or quantgate reference) first")
    try:
        return AutoTokenizer.from_pretrained(source.location)
    except (OSError, ValueError) as err:
        raise QuantgateError(f"model {source.location}: cannot load its tokenizer ({str(err).splitlines()[0]})") from None


class VariantFailed(QuantgateError):
    """The variant has no usable checkpoint (quantization or validation failed); the error says why."""


def dtype_of(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg", "/dev/nvhost-ctrl-gpu")  # NVIDIA, ROCm, WSL, Jetson


def resolve_device(setting: str) -> str:
    """`auto` picks CUDA when a GPU is visible, else the CPU; `cuda` without a GPU is an error.

    `auto` on a machine without a GPU driver's device node is the CPU without importing torch (2 s here): the
    stages' parent processes, which only hand the work to an isolated child, then never load it."""
    if setting == "cpu" or (setting == "auto" and not any(Path(node).exists() for node in GPU_DEVICE_NODES)):
        return "cpu"
    import torch

    from pipelines.core.logs import quiet_libraries

    quiet_libraries()  # a command that set up its logging without torch: take back torch's console handlers
    if setting == "cuda" and not torch.cuda.is_available():
        raise QuantgateError("params.yaml: device: cuda, but torch sees no CUDA device (CPU build or no GPU)")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


LOG_SOURCE = "samples"  # a candidate whose evidence is an lm-eval sample log (pipelines/evaluation/sample_logs.py)
ENDPOINT_SOURCE = "endpoint"  # a candidate behind an OpenAI-compatible server (pipelines/evaluation/endpoints.py)
ELSEWHERE = (LOG_SOURCE, ENDPOINT_SOURCE)  # evidence without weights here: no KL, no audit re-run, no registry
NOT_MEASURED = "not_measured"  # the status a stage records for what it cannot measure of such a candidate


def _source(variant_dir: str | Path) -> str | None:
    from pipelines.core.io import read_json

    path = Path(variant_dir) / MANIFEST
    return read_json(path).get("source") if path.is_file() else None


def no_model_here(variant_dir: str | Path) -> bool:
    """Whether the variant's folder holds an lm-eval sample log or an endpoint's address rather than a model: no
    weights here to load, measure or re-run (its manifest's `source`)."""
    return _source(variant_dir) in ELSEWHERE


def log_only(variant_dir: str | Path) -> bool:
    """Whether the variant's evidence is an lm-eval sample log: not even a server to send the replay to."""
    return _source(variant_dir) == LOG_SOURCE


def endpoint_of(variant_dir: str | Path) -> dict | None:
    """The endpoint (base_url, model, api_key_env, ...) a candidate is served at, from its manifest; None otherwise."""
    from pipelines.core.io import read_json

    if _source(variant_dir) != ENDPOINT_SOURCE:
        return None
    return read_json(Path(variant_dir) / MANIFEST).get("endpoint")


def variant_manifest(variant_dir: str | Path) -> dict:
    """The variant's quantgate.json; a missing one means the variant was never built."""
    from pipelines.core.io import read_json

    path = Path(variant_dir) / MANIFEST
    if not path.is_file():
        raise VariantFailed(f"{variant_dir}: no quantgate.json; run its quantize/admit stage first")
    return read_json(path)


# --------------------------------------------------------------------------------------------
# Placement across GPUs (fp16 and int8; GPTQ and AWQ keep their backends' own placement)
# --------------------------------------------------------------------------------------------

SPREAD_METHODS = ("none", "bnb-int8")


def weights_sha256(manifest: dict | None) -> dict[str, str]:
    """The checkpoint's weight files and their sha256, from its manifest."""
    return {k: v for k, v in ((manifest or {}).get("files") or {}).items() if k.endswith(".safetensors")}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def gpu_budget(shares: dict | None, totals: list[int]) -> dict[int, int] | None:
    """{gpu index: bytes} from `gpus.max_memory` parsed (GpusParams.shares()) and each visible GPU's total memory.

    None stays None (accelerate's own figure). A fraction is of that GPU's total; a GPU the setting names but torch
    does not see is an error."""
    if shares is None:
        return None
    if "all" in shares:
        shares = {i: shares["all"] for i in range(len(totals))}
    budget = {}
    for index, share in shares.items():
        if index >= len(totals):
            raise QuantgateError(f"params.yaml: gpus.max_memory names GPU {index}, but torch sees "
                                 f"{len(totals)} GPU(s) (indices 0-{len(totals) - 1})")
        budget[index] = int(share * totals[index]) if isinstance(share, float) else int(share)
    return budget


def device_map_for(method: str, device: str, n_gpus: int, max_memory: dict[int, int] | None):
    """(device_map, max_memory) for from_pretrained.

    fp16 (`none`) and `bnb-int8` on CUDA with more than one visible GPU, or with `gpus.max_memory` set, spread
    over the GPUs in layer order, filling GPU 0 first (`"sequential"`: a model that fits one GPU stays on GPU 0);
    everything else (one GPU and no budget, a CPU, GPTQ, AWQ) loads on `device` as it always did."""
    if method in SPREAD_METHODS and device == "cuda" and (n_gpus > 1 or max_memory is not None):
        return "sequential", max_memory
    return device, None


def check_budget(model_bytes: int, max_memory: dict[int, int], what: str = "the model") -> None:
    """A budget smaller than the weights cannot hold them: say so before anything is loaded."""
    total = sum(max_memory.values())
    if model_bytes > total:
        per_gpu = ", ".join(f"cuda:{i} {_gib(b)}" for i, b in sorted(max_memory.items()))
        raise QuantgateError(f"{what} needs {_gib(model_bytes)} ({model_bytes} bytes) for its weights, but "
                             f"gpus.max_memory allows {_gib(total)} in all ({per_gpu}); raise it or use more GPUs")


def plan_placement(model, max_memory: dict[int, int], dtype=None) -> dict[str, int]:
    """Module -> GPU index for `model` (built on the meta device) within `max_memory` ({gpu index: bytes}).

    accelerate's `infer_auto_device_map`, filling GPU 0 first, decoder layers kept whole; raises QuantgateError
    naming the budget and the model's size when the weights cannot fit on the GPUs (no CPU or disk offload)."""
    from accelerate.utils import compute_module_sizes, infer_auto_device_map

    sizes = compute_module_sizes(model, dtype=dtype)
    check_budget(sizes[""], max_memory)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = infer_auto_device_map(model, max_memory=dict(max_memory), no_split_module_classes=no_split,
                                       dtype=dtype)
    off = [name for name, d in device_map.items() if not isinstance(d, int)]
    if off:  # the total fits but the pieces do not (a layer larger than any GPU's share, or the layer reserve)
        per_gpu = ", ".join(f"cuda:{i} {_gib(b)}" for i, b in sorted(max_memory.items()))
        raise QuantgateError(f"the model ({_gib(sizes[''])}) does not fit gpus.max_memory ({per_gpu}) layer by "
                             f"layer: {off[0]} ({_gib(sizes[off[0]])}) finds no GPU with room; raise the shares")
    return device_map


def meta_model(location: str, dtype):
    """The model's architecture on the meta device (no weights read, no memory used)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def gpu_totals() -> list[int]:
    import torch

    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def free_gpu_memory() -> dict[int, int]:
    """accelerate's own figure for each visible GPU (free memory, what `device_map="auto"` fills), plus what this
    process's caching allocator holds unused (a model loaded and dropped before leaves it reserved, not free)."""
    import torch
    from accelerate.utils import get_max_memory

    return {k: v + torch.cuda.memory_reserved(k) - torch.cuda.memory_allocated(k)
            for k, v in get_max_memory().items() if isinstance(k, int)}


def weights_on_disk(location: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(location).glob("*.safetensors"))


def _eager_gptq_on_cpu() -> None:
    """GPTQModel's CPU kernel (TorchQuantLinear) hands its dequantization to torch.compile, and inductor builds C++ for
    it at the first forward: a compiler needed where it runs, 5-20 s of building in every process that loads the
    checkpoint, and the build's allocations inside the memory stage's first rounds. Eager runs the same dequantization
    unfused; quantgate compiles nothing else, so this loading process turns torch.compile off."""
    import torch

    torch._dynamo.config.disable = True


def load_variant(variant_dir: str | Path, device: str = "cpu", max_memory: dict | None = None):
    """(model, tokenizer) for any variant or admitted candidate, in eval mode, on `device`.

    `max_memory`: `gpus.max_memory` parsed (GpusParams.shares()); on CUDA with more than one GPU, or with it set,
    fp16 and int8 load across the GPUs (device_map_for). Raises VariantFailed when the variant's quantization or
    validation failed, with the recorded error.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.core.logs import library_output
    from pipelines.core.timing import library_call

    manifest = variant_manifest(variant_dir)
    if manifest.get("status") != "ok":
        reasons = manifest.get("error") or "; ".join(manifest.get("reasons", [])) or "unknown"
        raise VariantFailed(f"variant {manifest.get('variant', variant_dir)} is not usable: {reasons}")
    method = manifest["method"]
    location = str(variant_dir)
    device_map, budget = device, None
    if device == "cuda" and method in SPREAD_METHODS:
        import torch

        totals = gpu_totals()
        device_map, budget = device_map_for(method, device, torch.cuda.device_count(), gpu_budget(max_memory, totals))
        if device_map != device and budget is not None:
            check_budget(weights_on_disk(location), budget, f"variant {manifest.get('variant', Path(location).name)}")
    if method == "compressed-tensors":  # a format these libraries cannot run here: could not measure, not a failure
        from pipelines.checkpoints.compressed_tensors_probe import check_runs_here

        check_runs_here(manifest, device)
    with library_output(method), library_call("load checkpoint"):
        if method == "gptq":  # transformers needs optimum for GPTQ; GPTQModel loads its own format
            from gptqmodel import GPTQModel

            if device == "cpu":
                _eager_gptq_on_cpu()

            model = GPTQModel.load(location, device=device, dtype=dtype_of(manifest["dtype"])).model
        elif method == "none":
            dtype = dtype_of(manifest["dtype"])
            if device_map != device:  # across GPUs: the placement plan_placement makes (tested on the meta device)
                device_map = plan_placement(meta_model(location, dtype), budget or free_gpu_memory(), dtype)
            model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, device_map=device_map)
        elif device_map != device:  # bnb-int8 across GPUs: transformers sizes the int8 layers itself
            model = AutoModelForCausalLM.from_pretrained(location, device_map=device_map, max_memory=budget)
        else:  # bnb-int8, awq, compressed-tensors: transformers reads quantization_config (AWQ runs on GPTQModel's
            model = AutoModelForCausalLM.from_pretrained(location, device_map=device)  # kernels)
        tokenizer = AutoTokenizer.from_pretrained(location)
    if method == "compressed-tensors":  # evaluated as served: activations quantized as the scheme says
        from pipelines.checkpoints.compressed_tensors import check_served

        try:
            check_served(model, manifest)
        except RuntimeError as err:
            raise VariantFailed(f"variant {manifest.get('variant', variant_dir)} is not evaluated as served: {err}") from None
    model.eval()
    return model, tokenizer


def model_devices(model) -> list[str]:
    """The devices a loaded model's weights sit on, e.g. ["cuda:0", "cuda:1"], in index order."""
    devices = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    return sorted(devices, key=lambda d: (d.split(":")[0], int(d.split(":")[1]) if ":" in d else -1))
