#!/usr/bin/env bash
# The main job: install, check, then run the whole pipeline (`quantgate repro`: `dvc repro` with the per-variant
# chains in parallel) on the model params.yaml names. Arguments: stage names for a plain `dvc repro` of them.
#   bash scripts/run.sh --model NAME [STAGES]   another model's profile (profiles/NAME.yaml, e.g. smollm2: a real
#                                               pretrained model) in workspaces/NAME/, its results apart from these
set -euo pipefail
cd "$(dirname "$0")/.."
profile=""
if [ "${1:-}" = --model ]; then
  if [ -z "${2:-}" ] || [ ! -f "profiles/${2}.yaml" ]; then
    echo "run: --model needs a profile: one of $(ls profiles/*.yaml 2>/dev/null | xargs -n1 basename 2>/dev/null | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
    exit 2
  fi
  profile="$2"
  shift 2
fi
# bubblewrap first, in seconds: where it cannot be installed and params.yaml runs code probes, stop now, not after
# minutes of pip and a pipeline whose code probes would be refused (scripts/setup.sh).
bash scripts/setup.sh --check-system
bash scripts/setup.sh ${profile:+--profile "$profile"}
export PATH="$PWD/.venv/bin:$PATH"
if [ -n "$profile" ]; then
  # this checkout with the profile's settings, in a workspace of its own (pipelines/profile.py); MLflow runs go to
  # this checkout's store, beside the default run's
  workspace="$(quantgate profile "$profile")"
  cd "$workspace"
  # the workspace's copy of pipelines/ is the code that runs (and the code its dvc.lock hashes), not this checkout's
  export PYTHONPATH="$workspace${PYTHONPATH:+:$PYTHONPATH}"
  echo "run: profile $profile in $workspace"
fi
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
echo "Results: $PWD/results/ (compare.json, routing_table.yaml, report.md, ...), models/ (checkpoints), logs/quantgate.log"
echo "MLflow UI: .venv/bin/quantgate ui   # then open http://127.0.0.1:5000 (from the repository root; profiles' runs too)"
