"""compressed-tensors checkpoints of one model, one per admitted format and strategy: admission, the memory theory
against the footprint, and what evaluating them as served (activations quantized) shows that weights alone hide.

    .venv/bin/python benchmarks/compressed_tensors_formats.py [--model-dir models/reference] [--texts 8] [--no-record]

Each checkpoint is written by compressed-tensors' own ModelCompressor (pipelines/checkpoints/compressed_tensors_probe.py
write_rtn: round-to-nearest scales, a static input scale of 0.05), admitted (`admission.admit`), and loaded twice:
by `load_variant`, the loader every stage uses (compressed-tensors' forward: activations quantized as the scheme
says), and with `CompressedTensorsConfig(dequantize=True)` (weights dequantized, full-precision activations). Per
checkpoint: the mean per-token KL of each against the model itself in float32 over `--texts` probe texts of every
request type (evaluate's fidelity texts), the weight bytes admission's theory gives, the tensor bytes the loaded model
holds, and those it holds after its first forward (transformers unpacks the weights then). Written to
docs/measured/compressed_tensors_formats.json (docs/quantize.md renders it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402


def schemes() -> dict:
    """{kind: (scheme, format)}: compressed-tensors' presets as llm-compressor recipes name them, and one refused."""
    from compressed_tensors.quantization import QuantizationArgs

    from pipelines.checkpoints.compressed_tensors_probe import preset

    block = preset("FP8_BLOCK")
    return {"FP8_DYNAMIC": (preset("FP8_DYNAMIC"), "float-quantized"), "W8A8": (preset("W8A8"), "int-quantized"),
            "FP8 (static)": (preset("FP8"), "float-quantized"), "FP8_BLOCK": (block, "float-quantized"),
            "W4A16": (preset("W4A16"), "pack-quantized"), "W8A16 (naive)": (preset("W8A16"), "naive-quantized"),
            "W4A16_ASYM": (preset("W4A16_ASYM"), "pack-quantized"),
            "W4A8 (int8 per-token activations)": ({"weights": preset("W4A16")["weights"], "input_activations":
                                                   QuantizationArgs(num_bits=8, type="int", strategy="token",
                                                                    dynamic=True)}, "pack-quantized")}


def mean_kl(model, reference, tokenizer, texts: list[str]) -> float:
    """Mean per-token KL(reference || model) over the texts, one forward each."""
    import torch

    total, tokens = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            ref = torch.log_softmax(reference(ids).logits.float(), -1)
            got = torch.log_softmax(model(ids).logits.float(), -1)
            total += float((ref.exp() * (ref - got)).sum(-1).sum())
            tokens += ids.shape[1]
    return total / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="models/reference")
    parser.add_argument("--texts", type=int, default=8, help="fidelity texts per request type")
    measured.add_arguments(parser, "compressed_tensors_formats")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    from pipelines.checkpoints import admission
    from pipelines.checkpoints.compressed_tensors_probe import write_rtn
    from pipelines.core.logs import library_output
    from pipelines.core.params import load_params
    from pipelines.evaluation.harness import fidelity_texts
    from pipelines.measure.phases import tensor_bytes
    from pipelines.models.loading import load_variant

    params = load_params("params.yaml")
    probes = params.evaluate.model_dump()["probes"]
    texts = [t for ts in fidelity_texts(list(params.requests), args.texts, probes).values() for t in ts]
    with library_output("benchmark"):
        reference = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="quantgate-ct-bench-") as tmp:
        for kind, (scheme, fmt) in schemes().items():
            started = time.perf_counter()
            folder, admitted = Path(tmp) / "written" / kind.split()[0], Path(tmp) / "admitted"
            with library_output("benchmark"):
                write_rtn(args.model_dir, scheme, fmt, folder)
            manifest = admission.admit(kind.split()[0], str(folder), args.model_dir, admitted)
            row = {"format": fmt, "admitted": manifest["status"] == "ok", "reasons": manifest.get("reasons", [])}
            if row["admitted"]:
                served, _ = load_variant(admitted / kind.split()[0])
                row["theory_bytes"] = manifest["theoretical_weight_bytes"]["total"]
                row["loaded_tensor_bytes"] = tensor_bytes(served)
                row["kl_served"] = mean_kl(served, reference, tokenizer, texts)
                row["tensor_bytes_after_forward"] = tensor_bytes(served)
                with library_output("benchmark"):
                    weights_only = AutoModelForCausalLM.from_pretrained(
                        admitted / kind.split()[0], device_map="cpu",
                        quantization_config=CompressedTensorsConfig(dequantize=True))
                row["kl_weights_only"] = mean_kl(weights_only, reference, tokenizer, texts)
                row["forward"] = manifest["settings"]["forward"]
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows[kind] = row
            print(f"{kind:36} {fmt:16} " + (
                f"KL served {row['kl_served']:.5f}  weights only {row['kl_weights_only']:.5f}  "
                f"theory {row['theory_bytes']:,}  loaded {row['loaded_tensor_bytes']:,}  after forward "
                f"{row['tensor_bytes_after_forward']:,}" if row["admitted"] else f"refused: {row['reasons'][0][:110]}"),
                flush=True)
    fp16 = sum(t.numel() * 2 for t in reference.state_dict().values())
    header = ["checkpoint (preset)", "format", "admitted", "mean KL, as served", "mean KL, weights only",
              "theory (bytes)", "loaded (tensor bytes)", "after the first forward"]
    table = [[kind, r["format"], "yes" if r["admitted"] else "refused: " + r["reasons"][0].split(": ", 3)[-1][:170],
              *([f"{r['kl_served']:.5f}", f"{r['kl_weights_only']:.5f}", f"{r['theory_bytes']:,}",
                 f"{r['loaded_tensor_bytes']:,}", f"{r['tensor_bytes_after_forward']:,}"] if r["admitted"] else
                [""] * 5)] for kind, r in rows.items()]
    measured.record(args.record, "compressed_tensors_formats",
                    {"model_dir": args.model_dir, "texts": len(texts), "fp16_tensor_bytes": fp16, "header": header,
                     "rows": table, "by_checkpoint": rows},
                    note=f"{args.model_dir}, {len(texts)} fidelity texts; KL against the model itself in float32; the "
                         f"float16 model holds {fp16:,} tensor bytes.")


if __name__ == "__main__":
    main()
