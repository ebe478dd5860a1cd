#!/usr/bin/env bash
# The main job: install, then run the whole pipeline (`dvc repro`) on the model params.yaml names.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
dvc repro "$@"
echo
echo "Results: results/ (reference.json and the stage reports), models/ (checkpoints), logs/quantgate.log"
echo "MLflow UI: .venv/bin/quantgate ui   # then open http://127.0.0.1:5000"
