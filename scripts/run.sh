#!/usr/bin/env bash
# The main job: install, check, then run the whole pipeline (`quantgate repro`: `dvc repro` with the per-variant
# chains in parallel) on the model params.yaml names. Arguments: stage names for a plain `dvc repro` of them.
set -euo pipefail
cd "$(dirname "$0")/.."
# bubblewrap first, in seconds: where it cannot be installed and params.yaml runs code probes, stop now, not after
# minutes of pip and a pipeline whose code probes would be refused (scripts/setup.sh).
bash scripts/setup.sh --check-system
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# What the run needs on this machine (sandbox, torch and devices, backends, MLflow, disk, model, dvc): a table.
if ! quantgate doctor; then
  echo "run: stopped before the pipeline: the FAIL rows above would keep it from a verdict (fix them, then run again)" >&2
  exit 1
fi
echo
if [ "$#" -eq 0 ]; then
  # The per-variant chains side by side on a local Ray cluster (127.0.0.1, token auth) when this machine has 2+
  # cores, then `dvc repro` for the rest; one core or no Ray: plain `dvc repro` (it says which).
  quantgate repro
else
  dvc repro "$@"   # stages named: DVC runs them (and what they need), one after another
fi
echo
# The release verdict (exit 0 pass, 1 fail, 2 undecided); CI gates on it, this script only shows it.
quantgate gate || echo "(gate exit code $?: see results/report.md; gate one variant with: quantgate gate --variant gptq3)"
echo
echo "Results: results/ (compare.json, routing_table.yaml, report.md, ...), models/ (checkpoints), logs/quantgate.log"
echo "MLflow UI: .venv/bin/quantgate ui   # then open http://127.0.0.1:5000"
