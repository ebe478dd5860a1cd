"""What admitting a third-party checkpoint costs, against reading its bytes once.

    .venv/bin/python benchmarks/admission_cost.py [--mb 2000] [--shards 4] [--repeats 3] [--dir DIR]

Builds (or reuses, in --dir) an fp16 safetensors checkpoint of random tensors shaped like a small Llama,
sharded with an index, about --mb megabytes, plus the base model's config.json; both get the shipped reference
model's tokenizer, which admission loads and compares with the base's. Then, each --repeats
times, alternating: reads every file once into a reused buffer, validates the folder
(`admission.validate`: every check, hash and NaN/inf scan, no copy) and admits it (`admission.admit`:
the same plus the copy). Each is timed warm (the files in the page cache: the fastest a reader
can get the bytes) and cold (the files' pages dropped first with posix_fadvise(DONTNEED), which needs no
root; on a virtual disk the host may still cache them). For scale it also times a plain sha256 of every file
on one core, which the manifest needs anyway, and phase 1 alone (`admission.inspect`: the checks that read no
tensor bytes), the fixed cost that a small checkpoint weighs more than a 70B one. Prints the fastest of each, the
ratios, and the median of the per-repeat ratios (a cold read and a cold admit one after the other), which the
virtual disk's swings move less than the fastest of each; the goal is admit / read <= 1.5. The run is written to
docs/measured/admission_cost.json (docs/quantize.md renders it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import measured  # noqa: E402
from pipelines.checkpoints import admission, copying  # noqa: E402
from pipelines.checkpoints.context import Candidate  # noqa: E402
from pipelines.checkpoints.shards import INDEX  # noqa: E402


def llama_config(mb: int) -> dict:
    """A Llama config whose fp16 weights come to about `mb` megabytes (layers scale with it)."""
    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((mb * 1e6 - 2 * 2 * vocab * hidden) / per_layer))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 16, "head_dim": 64, "vocab_size": vocab, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "dtype": "float16", "hidden_act": "silu"}


def build(root: Path, mb: int, shards: int) -> tuple[Path, Path]:
    """(candidate folder, base folder); reused when already built with the same settings."""
    base, cand = root / "base", root / "candidate"
    config = llama_config(mb)
    if (cand / "config.json").is_file() and json.loads((cand / "config.json").read_text()) == config:
        add_tokenizer(base, cand)
        return cand, base
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.rmtree(root, ignore_errors=True)
    base.mkdir(parents=True)
    cand.mkdir()
    for folder in (base, cand):
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    names = list(shapes)
    per = -(-len(names) // shards)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: (torch.randn(shapes[n], generator=gen) * 0.02).half() for n in part}, cand / file,
                  metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum((cand / f).stat().st_size for f in set(weight_map.values()))
    (cand / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    add_tokenizer(base, cand)
    return cand, base


def add_tokenizer(*folders: Path) -> None:
    """The shipped reference model's tokenizer (a real tokenizer.json), which admission compares with the base's."""
    shipped = Path(__file__).resolve().parents[1] / "reference_model"
    for folder in folders:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(shipped / name, folder / name)


def read_once(folder: Path) -> int:
    """Every byte of every file read once into a reused buffer; returns the bytes read."""
    buf = memoryview(bytearray(copying.CHUNK_BYTES))
    total = 0
    for path in sorted(folder.iterdir()):
        with path.open("rb") as fh:
            while got := fh.readinto(buf):
                total += got
    return total


def sha256_all(folder: Path) -> None:
    """sha256 of every file, one after another on one core: what `sha256sum *` costs (warm)."""
    buf = memoryview(bytearray(copying.CHUNK_BYTES))
    for path in sorted(folder.iterdir()):
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while got := fh.readinto(buf):
                digest.update(buf[:got])


def drop_cache(folder: Path) -> None:
    """Evict the folder's file pages from the page cache, so the next read comes from the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="keep the generated checkpoint here (default: a temporary folder)")
    measured.add_arguments(ap, "admission_cost")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="admission-cost-"))
    cand, base = build(root, args.mb, args.shards)
    size = read_once(cand)  # the first read fills the page cache
    out = root / "admitted"
    times: dict[str, list[float]] = {k: [] for k in ("read", "sha256", "phase 1", "validate", "admit", "cold read",
                                                     "cold admit")}

    def admit() -> None:
        shutil.rmtree(out, ignore_errors=True)
        manifest = admission.admit("bench", str(cand), str(base), out)
        assert manifest["status"] == "ok", manifest.get("reasons")

    def validate() -> None:
        report = admission.validate(cand, str(base))
        assert report["admitted"], report["reasons"]

    for _ in range(args.repeats):
        times["read"].append(timed(lambda: read_once(cand)))
        times["sha256"].append(timed(lambda: sha256_all(cand)))
        times["phase 1"].append(timed(lambda: admission.inspect(Candidate(cand, str(base)))))
        times["validate"].append(timed(validate))
        times["admit"].append(timed(admit))
        drop_cache(cand)
        times["cold read"].append(timed(lambda: read_once(cand)))
        drop_cache(cand)
        times["cold admit"].append(timed(admit))
    shutil.rmtree(out, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    paired = sorted(a / r for a, r in zip(times["cold admit"], times["cold read"]))
    print(f"checkpoint: {size / 1e6:.0f} MB in {args.shards} fp16 safetensors shards + index ({cand}); "
          f"fastest of {args.repeats}")
    for key in ("read", "cold read"):
        print(f"{key + ' once:':<22}{best[key]:7.3f} s  ({size / best[key] / 1e9:.2f} GB/s)")
    print(f"{'sha256sum (warm):':<22}{best['sha256']:7.3f} s  ratio to a warm read {best['sha256'] / best['read']:.2f}")
    print(f"{'phase 1 (warm):':<22}{best['phase 1']:7.3f} s  (fixed: reads no tensor bytes)")
    print(f"{'validate (warm):':<22}{best['validate']:7.3f} s  ratio to a warm read {best['validate'] / best['read']:.2f}")
    print(f"{'admit (warm):':<22}{best['admit']:7.3f} s  ratio to a warm read {best['admit'] / best['read']:.2f}")
    print(f"{'admit (cold):':<22}{best['cold admit']:7.3f} s  ratio to a cold read "
          f"{best['cold admit'] / best['cold read']:.2f}  (goal <= 1.5)")
    print(f"{'paired cold ratios:':<22}" + " ".join(f"{r:.2f}" for r in paired) +
          f"  median {statistics.median(paired):.2f}  (goal <= 1.5)")
    measured.record(args.record, "admission_cost", {"runs": [{
        "checkpoint_mb": round(size / 1e6), "shards": args.shards, "repeats": args.repeats,
        "read_warm_s": round(best["read"], 4), "read_cold_s": round(best["cold read"], 4),
        "sha256_warm_s": round(best["sha256"], 4), "phase1_warm_s": round(best["phase 1"], 4),
        "validate_warm_s": round(best["validate"], 4), "admit_warm_s": round(best["admit"], 4),
        "admit_cold_s": round(best["cold admit"], 4), "ratio_fastest": round(best["cold admit"] / best["cold read"], 3),
        "paired_ratios": [round(r, 3) for r in paired], "paired_median": round(statistics.median(paired), 3)}]})
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
