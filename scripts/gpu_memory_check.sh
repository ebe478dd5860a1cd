#!/usr/bin/env bash
# CUDA check of the memory stage: fp16, int8, awq4 and gptq3 of a randomly initialised Llama large
# enough to matter (~0.5B parameters; memory needs no trained weights), each measured in a fresh
# process on the GPU. Sized to finish in under 10 minutes on one H100/H200.
# With more than one GPU visible it then measures fp16 and int8 again with gpus.max_memory set to 75 % of each
# variant's weights per GPU, so each must load across GPUs (OUT_DIR/multi_gpu/<variant>.json, with the per-device
# breakdown under `devices`); with one GPU it says that path was not exercised.
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
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -gt 1 ]; then
  echo "== $NGPU GPUs visible: fp16 and int8 again, each capped at 75 % of its weights per GPU, so each must split"
  mkdir -p results/multi_gpu
  cp -r results/memory results/memory_first   # the runs above are what OUT_DIR/memory reports
  for v in fp16 int8; do
    python - "$v" <<'PY'
import glob, os, sys, yaml
v = sys.argv[1]
share = int(0.75 * sum(os.path.getsize(f) for f in glob.glob(f"models/variants/{v}/*.safetensors")))
params = yaml.safe_load(open("params.yaml"))
params["gpus"] = {"max_memory": share}
yaml.safe_dump(params, open("params.yaml", "w"), sort_keys=False)
print(f"{v}: gpus.max_memory = {share} bytes per GPU")
PY
    quantgate memory "$v"
    cp "results/memory/$v.json" "results/multi_gpu/$v.json"
    python - "$v" <<'PY'
import json, sys
r = json.load(open(f"results/multi_gpu/{sys.argv[1]}.json"))
devices = r.get("devices") or {}
print(f"{sys.argv[1]}: status {r['status']}, footprint {r.get('load', {}).get('footprint_bytes')} B summed over "
      f"{len(devices)} device(s)")
for name, d in devices.items():
    print(f"  {name}: load footprint {d['footprint_bytes']} B, end allocated {d['allocated_end']} B, "
          f"reserved {d['reserved_end']} B")
print("  MULTI-DEVICE OK" if r["status"] == "ok" and len(devices) > 1 else
      f"  MULTI-DEVICE NOT SHOWN: {r.get('error') or 'the model stayed on one GPU'}")
PY
  done
  rm -rf results/memory && mv results/memory_first results/memory
else
  echo "== one GPU visible: the multi-GPU path (fp16/int8 across GPUs, per-device sums) was NOT exercised by this run"
fi
cd - >/dev/null
mkdir -p "$OUT"
cp -r "$WORK/results/memory" "$WORK/results/memory_summary.json" "$WORK"/results/plots/*.png "$OUT"/
cp -r "$WORK/results/multi_gpu" "$OUT"/ 2>/dev/null || true
cp "$WORK/logs/quantgate.log" "$OUT"/ 2>/dev/null || true
cat "$OUT/memory_summary.json"
