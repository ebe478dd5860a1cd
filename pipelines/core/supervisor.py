"""Caps on a sandboxed program as a whole, not per process: the memory of all its processes and the bytes it wrote.

rlimits are per process (64 processes x 512 MiB address space each), and RLIMIT_FSIZE is per file, so a program
that forks or writes many files is bounded only by their product. No kernel mechanism for the whole program is
available everywhere the sandbox runs: cgroup v2's memory controller needs a delegated cgroup (root in a
container usually has a read-only /sys/fs/cgroup; the machine this was written on keeps memory on cgroup v1,
held by its own supervisor), and a user without root has neither. So the harness watches the program itself,
at every isolation level: every POLL_S it walks the process tree (the PID namespace's processes are the host's
descendants of the bwrap/unshare process) summing each process's resident anonymous and shared memory
(RssAnon + RssShmem) and the memfd files it holds open, and sums the bytes
the program's writable folders hold; over a cap, every process it has seen is SIGKILLed and the result says
which cap. What slips between two polls is bounded by the rlimits (RLIMIT_AS x RLIMIT_NPROC, RLIMIT_FSIZE per
file). At FULL the work directory is also a tmpfs of `total_write_bytes` (a kernel cap), and /tmp, /var/tmp,
/dev/shm, each capped by `tmpfs_bytes`, count toward the same total (read through /proc/PID/root).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil

POLL_S = 0.02  # a fork-and-allocate loop gains at most what the rlimits allow in this long
PAGE = os.sysconf("SC_PAGE_SIZE")
MIN_ENTRY_BYTES = 4096  # an empty file or folder still takes an inode and, on most filesystems, a block
PRIVATE_TMPFS = ("tmp", "var/tmp", "dev/shm")  # FULL's own tmpfs folders, besides the work directory
CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def descendants(pid: int) -> list[int]:
    """pid's descendants, read from /proc/PID/task/TID/children (no scan of every process on the host); a kernel
    without that file (CONFIG_PROC_CHILDREN off) gets psutil's scan of every process instead."""
    if not CHILDREN_FILES:
        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                stack.append(child)
    return found


def anonymous_bytes(pid: int) -> int:
    """Resident memory the process holds (/proc/PID/status RssAnon + RssShmem): its own pages and the shared ones
    (MAP_SHARED|MAP_ANONYMOUS, SysV or POSIX shared memory, memfd pages it mapped). A region shared by several of
    its processes is counted once per process: the sum errs toward failing, never toward a pass (statm's resident
    minus shared, counted before, let 4 forks touching one 300 MiB shared mapping pass a 512 MiB cap)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    total = 0
    for line in status.splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) * 1024
    return total


def memfd_bytes(pid: int, counted: set[tuple[int, int]]) -> int:
    """Bytes held by the memfd files the process has open (/proc/PID/fd links "/memfd:NAME"): RAM that no mapping
    need show. Each file (device, inode) once across the calls that share `counted`."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(link).startswith("/memfd:"):
                continue
            st = os.stat(link)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in counted:
            counted.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def memory_bytes(pids: list[int]) -> int:
    """The program's memory: resident anonymous and shared memory of each process, plus its memfd files once."""
    counted: set[tuple[int, int]] = set()
    return sum(anonymous_bytes(pid) + memfd_bytes(pid, counted) for pid in pids)


def folder_bytes(root: Path, stop_above: int) -> int:
    """Bytes a folder holds on disk, each entry at least MIN_ENTRY_BYTES (many empty files fill a disk's inodes);
    stops counting once above `stop_above`, so a folder of a million files costs one poll, not a million stats."""
    total, stack = 0, [root]
    while stack and total <= stop_above:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += max(st.st_blocks * 512, st.st_size, MIN_ENTRY_BYTES)
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
    return total


def open_tmpfs(pid: int, inside: str) -> list[int] | None:
    """Directory fds on the private tmpfs mounts (work directory at `inside`, /tmp, /var/tmp, /dev/shm) of the mount
    namespace `pid` lives in, through /proc/PID/root: fstatvfs reads each tmpfs's own count at once, and an open fd
    keeps the mount readable after the program ends (the last count). None when `pid` is not (yet) in that view."""
    fds: list[int] = []
    try:
        for folder in (inside.lstrip("/"), *PRIVATE_TMPFS):
            path = f"/proc/{pid}/root/{folder}"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                if folder == inside.lstrip("/"):
                    return None  # no work directory there yet: the view is still being built
                continue
            fds.append(fd)
            try:
                if os.fstat(fd).st_dev == os.stat(f"/{folder}").st_dev:
                    return None  # bwrap has not switched to the view yet: the host's folder, not its tmpfs
            except FileNotFoundError:
                pass
        kept, fds = fds, []
        return kept
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def tmpfs_bytes_used(fds: list[int]) -> int:
    total = 0
    for fd in fds:
        st = os.fstatvfs(fd)
        total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


def watch(proc: subprocess.Popen, timeout_s: float, total_memory: int, total_write: int, workdir: Path,
          inside: str | None, wrapped: bool = True) -> tuple[int | None, str]:
    """Wait for `proc`, enforcing the wall clock and the program-wide caps. Returns (returncode, why): why is ""
    when it ended by itself, else the cap it broke (returncode None). `inside`: the work directory's path in a
    private mount namespace (FULL), or None when the program writes into `workdir` on the host. `wrapped`: `proc`
    is bwrap or unshare around the program (False at WEAK: `proc` is the program itself)."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, psutil.Process] = {}
    mounts: list[int] | None = None
    why = ""

    def written() -> int:
        if inside is None:
            return folder_bytes(workdir, total_write)
        return tmpfs_bytes_used(mounts) if mounts else 0

    def over_write_cap() -> str:
        n = written()
        if n <= total_write:
            return ""
        where = "its work directory" if inside is None else "its work directory, /tmp, /var/tmp and /dev/shm"
        return f"total bytes written cap {mib(total_write)} exceeded ({mib(n)} in {where})"

    try:
        while proc.poll() is None:
            tree = descendants(proc.pid)
            for pid in tree:
                if pid not in seen:
                    try:
                        seen[pid] = psutil.Process(pid)
                    except psutil.Error:
                        pass
            memory = memory_bytes([proc.pid, *tree])
            if memory > total_memory:
                why = f"total memory cap {mib(total_memory)} exceeded ({mib(memory)} in {len(tree) + 1} processes)"
                break
            if inside is not None and mounts is None:
                mounts = next((m for m in map(lambda pid: open_tmpfs(pid, inside), reversed(tree)) if m), None)
            why = over_write_cap()
            if why:
                break
            if time.monotonic() > deadline:
                why = f"wall-clock timeout {timeout_s:g} s"
                break
            try:
                proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
        kill_all(proc, list(seen.values()), wrapped)
        why = why or over_write_cap()  # what it wrote after the last poll (a full tmpfs ends it with ENOSPC)
    finally:
        for fd in mounts or []:
            os.close(fd)
    return (None if why else proc.returncode), why


def kill_all(proc: subprocess.Popen, seen: list[psutil.Process], wrapped: bool = True) -> None:
    """SIGKILL every process ever seen in the tree (a WEAK-level child that called setsid() and was reparented away
    still dies), then the process group. The program's processes go first, so that bwrap or unshare reaps its child
    and ends by itself instead of leaving it a zombie for init; killing a PID namespace's first process takes
    every process in it down."""
    if not wrapped:  # the program itself: first, or it sees its children die and carries on
        proc.kill()
    for p in seen:
        try:
            p.kill()  # psutil checks the pid was not reused by another process
        except psutil.Error:
            pass
    try:
        proc.wait(timeout=1 if seen else 0.001)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5  # SIGKILL is delivered at once, but a process freeing its memory takes a while
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.01)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
