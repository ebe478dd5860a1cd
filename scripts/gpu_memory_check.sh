#!/usr/bin/env bash
# CUDA check of the memory stage on a GPU machine that reaches no package index: fp16 and int8 (and awq4, gptq3 where
# their libraries import) of a randomly initialised Llama large enough to matter (~0.5B parameters; memory needs no
# trained weights), each quantized with the project's quantize stage and measured in a fresh process on the GPU with
# its memory stage (allocator stats and NVML), then memory-report. Sized to finish in under 10 minutes on one H100/H200.
# With more than one GPU visible it then measures fp16 and int8 again with gpus.max_memory set to 75 % of each
# variant's weights per GPU, so each must load across GPUs (OUT_DIR/multi_gpu/<variant>.json, with the per-device
# breakdown under `devices`); with one GPU it says that path was not exercised. Last, fp16 once more with 4 MiB a round
# kept alive (--inject-leak-bytes): the growth traced (the CUDA allocator's recorded history on a GPU) must be called a
# leak at the injecting function, and the soak is repeated under expandable_segments:True and backend:cudaMallocAsync
# (OUT_DIR/attribution/: fp16.json with growth_cause and allocators, traces/ with the snapshot memory_viz reads).
#
#   bash scripts/gpu_memory_check.sh --prepare   # here, on a machine that reaches PyPI: the wheels -> .gpu_wheels/
#   bash scripts/gpu_memory_check.sh [OUT_DIR]   # there, from the repository root (the git working tree + .gpu_wheels/)
#
# The GPU machine needs Python 3.12 as `python3` (or $PYTHON) with torch (CUDA), transformers, accelerate, safetensors,
# tokenizers, psutil, nvidia-ml-py, pyyaml, numpy and scipy; the rest (pydantic and its dependencies, bitsandbytes:
# scripts/gpu_wheels.py WHEELS) is installed offline from .gpu_wheels/ into a temporary folder, never into the machine's
# site-packages. quantgate need not be installed: the stages run as `python3 -m pipelines.cli`. No dvc, mlflow,
# lm-eval or models/reference (the tokenizer is the one shipped in reference_model/). Writes OUT_DIR (default
# results/gpu_check): memory_summary.json, memory/<variant>.json, skipped.json, quantgate.log and, where matplotlib is
# installed, the two charts; prints the summary. Exit 0 when every variant it ran was measured, 1 otherwise, 2 when
# something it needs is missing (the message says what, and the command that fixes it).
#
# Environment: PYTHON (default python3), QUANTGATE_GPU_WHEELS (default .gpu_wheels),
# QUANTGATE_GPU_CHECK_DEVICE=cuda|cpu and QUANTGATE_GPU_CHECK_SIZE=full|tiny (cpu + tiny: the same flow on a CPU in
# seconds; tests/test_gpu_memory_check.py runs it so).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the check changes folder
WHEELS="${QUANTGATE_GPU_WHEELS:-.gpu_wheels}"
case "$WHEELS" in /*) ;; *) WHEELS="$ROOT/$WHEELS" ;; esac
if [ "${1:-}" = "--prepare" ]; then
  [ -n "${PYTHON:-}" ] || [ ! -x .venv/bin/python ] || PY="$ROOT/.venv/bin/python"  # its pip; a bare python3 may have none
  exec "$PY" scripts/gpu_check.py prepare --dest "$WHEELS"
fi
if ! command -v "$PY" >/dev/null; then
  echo "gpu_memory_check: error: no $PY on PATH (set PYTHON to the Python that has torch)" >&2
  exit 2
fi
OUT="${1:-${OUT:-results/gpu_check}}"
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
DEVICE="${QUANTGATE_GPU_CHECK_DEVICE:-cuda}"
SIZE="${QUANTGATE_GPU_CHECK_SIZE:-full}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
step() { echo "== [${SECONDS}s] $*"; }

step "packages: what $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])') lacks, offline from $WHEELS"
"$PY" scripts/gpu_check.py install --wheels "$WHEELS" --target "$WORK/site" || exit 2
export PYTHONPATH="$WORK/site:$WORK${PYTHONPATH:+:$PYTHONPATH}"

cp -r pipelines calibration_sets params.yaml "$WORK"/
cd "$WORK"
QG=("$PY" -m pipelines.cli)
step "setup: random Llama ($SIZE) on $DEVICE, params.yaml"
"$PY" "$ROOT/scripts/gpu_check.py" setup --device "$DEVICE" --size "$SIZE" --reference "$ROOT/reference_model" || exit 2
mapfile -t VARIANTS < variants.txt
if [ "${#VARIANTS[@]}" -gt 2 ]; then  # awq4/gptq3 read the calibration set
  step "calibrate"
  "${QG[@]}" calibrate
fi
for v in "${VARIANTS[@]}"; do step "quantize $v"; "${QG[@]}" quantize "$v"; done
for v in "${VARIANTS[@]}"; do step "memory $v"; "${QG[@]}" memory "$v"; done
step "memory-report"
"$PY" "$ROOT/scripts/gpu_check.py" memory-report
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" = cuda ] && [ "$NGPU" -gt 1 ]; then
  step "$NGPU GPUs visible: fp16 and int8 again, each capped at 75 % of its weights per GPU, so each must split"
  mkdir -p results/multi_gpu
  cp -r results/memory results/memory_first   # the runs above are what OUT_DIR/memory reports
  cp params.yaml params.single.yaml
  for v in fp16 int8; do
    "$PY" - "$v" <<'PY'
import glob, os, sys, yaml
v = sys.argv[1]
share = int(0.75 * sum(os.path.getsize(f) for f in glob.glob(f"models/variants/{v}/*.safetensors")))
params = yaml.safe_load(open("params.yaml"))
params["gpus"] = {"max_memory": share}
yaml.safe_dump(params, open("params.yaml", "w"), sort_keys=False)
print(f"{v}: gpus.max_memory = {share} bytes per GPU")
PY
    "${QG[@]}" memory "$v"
    cp "results/memory/$v.json" "results/multi_gpu/$v.json"
    "$PY" - "$v" <<'PY'
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
  mv params.single.yaml params.yaml
  rm -rf results/memory && mv results/memory_first results/memory
elif [ "$DEVICE" = cuda ]; then
  step "one GPU visible: the multi-GPU path (fp16/int8 across GPUs, per-device sums) was NOT exercised by this run"
else
  step "device $DEVICE: the CUDA path (allocator stats, NVML, several GPUs) was NOT exercised by this run"
fi
step "why memory grows: fp16 again with 4 MiB/round injected, traced (${DEVICE}); allocators compared (CUDA only)"
mkdir -p results/attribution
cp params.yaml params.plain.yaml
"$PY" - <<'PY'
import yaml
params = yaml.safe_load(open("params.yaml"))
# 10 soak rounds (it grows, so the soak runs to max_rounds) and 10 traced: bounded time, three thirds to compare
params["memory"].update(rounds=10, max_rounds=10, trace_rounds=max(10, params["memory"]["tail_rounds"] + 2),
                        compare_allocators=["expandable_segments:True", "backend:cudaMallocAsync"])
yaml.safe_dump(params, open("params.yaml", "w"), sort_keys=False)
PY
cp "results/memory/fp16.json" results/fp16.clean.json
"${QG[@]}" memory fp16 --inject-leak-bytes 4194304
cp "results/memory/fp16.json" results/attribution/fp16.json
cp -r results/memory/traces/fp16 results/attribution/traces && rm -rf results/memory/traces/fp16/*
mv results/fp16.clean.json results/memory/fp16.json
mv params.plain.yaml params.yaml
"$PY" - <<'PY'
import json
r = json.load(open("results/attribution/fp16.json"))
cause = r.get("growth_cause") or {}
top = (cause.get("sites") or [{}])[0]
print(f"fp16 + 4 MiB/round: {cause.get('class')} by {cause.get('tracer')}: top site {top.get('frame')} "
      f"({(top.get('share') or 0):.0%}), {cause.get('seconds')} s for {cause.get('traced_rounds')} traced rounds")
print("  ATTRIBUTION OK" if cause.get("class") == "leak" and "after_round" in (top.get("frame") or "")
      else f"  ATTRIBUTION NOT SHOWN: {cause}")
for setting, row in (r.get("allocators") or {}).items():
    print(f"  allocator {setting}: {row}")
PY
cd "$ROOT"
mkdir -p "$OUT"
rm -rf "$OUT/memory" "$OUT/multi_gpu" "$OUT/attribution"
cp -r "$WORK/results/memory" "$WORK/results/memory_summary.json" "$WORK/skipped.json" "$OUT"/
for f in "$WORK"/results/plots/*.png; do [ -e "$f" ] && cp "$f" "$OUT"/; done
cp -r "$WORK/results/multi_gpu" "$OUT"/ 2>/dev/null || true
cp -r "$WORK/results/attribution" "$OUT"/ 2>/dev/null || true
cp "$WORK/logs/quantgate.log" "$OUT"/ 2>/dev/null || true
cat "$OUT/memory_summary.json"
step "done in ${SECONDS}s -> $OUT"
"$PY" - "$OUT" "$DEVICE" "${VARIANTS[@]}" <<'PY'
import json, sys
out, device, ran = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = json.load(open(f"{out}/memory_summary.json"))["variants"]
skipped = json.load(open(f"{out}/skipped.json"))
bad = [f"{v}: {rows.get(v, {}).get('error', 'no result')}" for v in ran if rows.get(v, {}).get("status") != "ok"]
bad += [f"{v}: measured on {rows[v]['device']}, not {device}" for v in ran if v in rows and rows[v].get("device")
        not in (None, device)]
print(f"GPU MEMORY CHECK: {'FAILED' if bad else 'OK'}: {', '.join(ran)} on {device}"
      + (f"; {', '.join(skipped)} skipped (skipped.json says why)" if skipped else ""))
for line in bad:
    print(f"  {line}")
sys.exit(1 if bad else 0)
PY
