"""Time each quantization method through quantgate against calling the library directly.

    .venv/bin/python benchmarks/quantize_overhead.py [--repeats 2] [--methods fp16,int8,awq4,gptq3]

Same model (params.yaml `model`), same calibration set (calibration_sets/built/by_method/<method>.jsonl),
same settings. Prints seconds and the ratio quantgate / direct; the goal is a ratio under 1.10. Needs
`dvc repro calibrate` first. Runs each path `repeats` times, alternating, and keeps the fastest. Writes the table to
docs/measured/quantize_overhead.json (docs/quantize.md renders it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402
from pipelines.core import logs  # noqa: E402
from pipelines.core.params import load_params  # noqa: E402
from pipelines.models.loading import dtype_of, resolve_model  # noqa: E402
from pipelines.quantize import calibration_texts, quantize_variant  # noqa: E402

BUILT = Path("calibration_sets/built")


def direct(method: str, s, base: str, texts: list[str], out: Path) -> None:
    """The library calls a user would write by hand, nothing else."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    if method == "none":
        AutoModelForCausalLM.from_pretrained(base, dtype=dtype_of(s.dtype)).save_pretrained(out)
    elif method == "bnb-int8":
        AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                             device_map="cpu", dtype=dtype_of(s.dtype)).save_pretrained(out)
    elif method == "awq":
        from awq import AutoAWQForCausalLM

        model = AutoAWQForCausalLM.from_pretrained(base, torch_dtype=dtype_of(s.dtype))
        model.quantize(AutoTokenizer.from_pretrained(base),
                       quant_config={"zero_point": s.zero_point, "q_group_size": s.group_size, "w_bit": s.bits,
                                     "version": "GEMM"},
                       calib_data=texts, max_calib_samples=len(texts), max_calib_seq_len=256,
                       **({"duo_scaling": s.duo_scaling} if s.duo_scaling is not None else {}))
        model.save_quantized(str(out))
    else:
        from gptqmodel import GPTQModel, QuantizeConfig

        extra = {"damp_percent": s.damp_percent} if s.damp_percent is not None else {}
        model = GPTQModel.load(base, QuantizeConfig(bits=s.bits, group_size=s.group_size, sym=s.sym,
                                                    desc_act=s.desc_act, **extra), device="cpu", dtype=dtype_of(s.dtype))
        model.quantize(texts)
        model.save(str(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="fp16,int8,awq4,gptq3")
    measured.add_arguments(parser, "quantize_overhead")
    args = parser.parse_args()
    started, rows = time.perf_counter(), []
    logs.setup(log_file=Path("logs/benchmark.log"))
    params = load_params()
    source = resolve_model(params.model)
    print(f"model {source.location}, best of {args.repeats}")
    print(f"{'variant':<8} {'direct s':>9} {'quantgate s':>12} {'ratio':>6}")
    for name in args.methods.split(","):
        s = params.variants[name]
        texts = (calibration_texts(BUILT, s.method) or ([], None))[0]
        best = {"direct": float("inf"), "quantgate": float("inf")}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                with logs.library_output("bench"):
                    direct(s.method, s, source.location, texts, Path(tmp) / "out")
                best["direct"] = min(best["direct"], time.perf_counter() - t)
                t = time.perf_counter()
                manifest, _ = quantize_variant(name, s, source, BUILT, "cpu", Path(tmp) / "qg")
                best["quantgate"] = min(best["quantgate"], time.perf_counter() - t)
                assert manifest["status"] == "ok", manifest.get("error")
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"{name:<8} {best['direct']:9.2f} {best['quantgate']:12.2f} {best['quantgate'] / best['direct']:6.3f}",
              flush=True)
        rows.append({"variant": name, "direct_seconds": round(best["direct"], 4),
                     "quantgate_seconds": round(best["quantgate"], 4),
                     "ratio": round(best["quantgate"] / best["direct"], 4)})
    measured.record(args.record, "quantize_overhead", {"repeats": args.repeats, "model": source.location,
                                                       "seconds": round(time.perf_counter() - started, 1),
                                                       "goal_ratio": 1.10, "rows": rows})


if __name__ == "__main__":
    main()
