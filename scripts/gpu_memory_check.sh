#!/usr/bin/env bash
# CUDA check of the memory stage: fp16, int8, awq4 and gptq3 of a randomly initialised Llama large
# enough to matter (~0.5B parameters; memory needs no trained weights), each measured in a fresh
# process on the GPU. Sized to finish in under 10 minutes on one H100/H200.
#
#   bash scripts/gpu_memory_check.sh [OUT_DIR]
#
# Needs quantgate installed with a CUDA build of torch (docs/install.md) and a built reference
# tokenizer (models/reference, from `dvc repro reference`). Writes OUT_DIR/memory_summary.json,
# OUT_DIR/memory/<variant>.json and the two charts; prints the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-results/gpu_check}}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cp -r pipelines calibration_sets params.yaml "$WORK"/
mkdir -p "$WORK/models" && cp -r models/reference "$WORK/models/reference"
cd "$WORK"
python - <<'PY'
import torch, yaml
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
model = LlamaForCausalLM(config).to(torch.float16)
model.save_pretrained("models/random-llama")
AutoTokenizer.from_pretrained("models/reference").save_pretrained("models/random-llama")
params = yaml.safe_load(open("params.yaml"))
params.update(model="models/random-llama", device="cuda")
params["calibration"].update(samples=128)
params["memory"].update(max_tokens=4096, rounds=10, warmup_rounds=2)
yaml.safe_dump(params, open("params.yaml", "w"), sort_keys=False)
print(f"random Llama: {model.num_parameters() / 1e6:.0f}M parameters")
PY
quantgate calibrate
for v in fp16 int8 awq4 gptq3; do quantgate quantize "$v"; done
for v in fp16 int8 awq4 gptq3; do quantgate memory "$v"; done
quantgate memory-report
cd - >/dev/null
mkdir -p "$OUT"
cp -r "$WORK/results/memory" "$WORK/results/memory_summary.json" "$WORK"/results/plots/*.png "$OUT"/
cp "$WORK/logs/quantgate.log" "$OUT"/ 2>/dev/null || true
cat "$OUT/memory_summary.json"
