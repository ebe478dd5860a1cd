#!/usr/bin/env bash
# The main job: install, then run the whole pipeline (`dvc repro`) on the model params.yaml names.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
dvc repro "$@"
echo
# The release verdict (exit 0 pass, 1 fail, 2 undecided); CI gates on it, this script only shows it.
quantgate gate || echo "(gate exit code $?: see results/report.md; gate one variant with: quantgate gate --variant gptq3)"
echo
echo "Results: results/ (compare.json, routing_table.yaml, report.md, ...), models/ (checkpoints), logs/quantgate.log"
echo "MLflow UI: .venv/bin/quantgate ui   # then open http://127.0.0.1:5000"
