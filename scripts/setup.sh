#!/usr/bin/env bash
# Create .venv (Python 3.11) and install quantgate with its pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.quantgate-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing quantgate and its pinned dependencies (a few minutes the first time)"
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test]"
  echo "$want" > "$stamp"
fi
