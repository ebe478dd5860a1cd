#!/usr/bin/env bash
# Install, then run the test suite (the end-to-end `dvc repro` test included). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --profile smollm2  # the real model's GGUF: tests/test_gguf.py loads it
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/python -m pytest "$@"
