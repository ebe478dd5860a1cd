"""Hostile programs through the sandbox: each is contained, scored as a failure, and leaves nothing behind.

They need root, util-linux and bubblewrap; .ci/run installs bubblewrap and sets QUANTGATE_REQUIRE_SANDBOX=1,
so in CI a machine without them fails these tests instead of skipping them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pipelines.core import sandbox, supervisor
from pipelines.core.sandbox import Limits, run_python

pytestmark = pytest.mark.skipif(not sandbox.isolation_available() and not os.environ.get("QUANTGATE_REQUIRE_SANDBOX"),
                                reason="the sandbox needs root, util-linux and bubblewrap (CI has them and requires it)")
REPO = Path(__file__).resolve().parents[1]
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
FAST = Limits(timeout_s=5, cpu_s=3)


def nobody_processes() -> list[int]:
    """Processes of uid 65534 still running: none should outlive its sandbox. Under pytest-xdist (scripts/test.sh) the
    other workers' sandboxes may be at work: a process below another live worker is theirs, not left over, and so is
    one below a raylet (the Ray tests' clusters run pipeline stages, whose code probes run in sandboxes)."""
    others, xdist = set(), os.environ.get("PYTEST_XDIST_WORKER") and os.getppid() > 1  # (1: the controller is gone)
    if xdist:
        others = {c.pid for c in psutil.Process(os.getppid()).children() if c.pid != os.getpid()}
    left = []
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] and p.info["uids"].real == sandbox.NOBODY:
            try:
                parents = p.parents()
                if not ({a.pid for a in parents} & others or xdist and any(a.name() == "raylet" for a in parents)):
                    left.append(p.pid)
            except psutil.NoSuchProcess:
                continue
    return left


@pytest.fixture(autouse=True)
def machine_left_as_it_was():
    workdirs = tempfile.gettempdir()  # where the sandbox makes its folders: /tmp, or the xdist worker's (tests/workers.py)
    before = {d: set(os.listdir(d)) for d in {*SHARED_TMP, workdirs}}
    yield
    time.sleep(0.2)
    assert nobody_processes() == []
    assert not [n for n in set(os.listdir(workdirs)) - before[workdirs] if n.startswith("quantgate-sandbox-")]
    assert not [f"{d}/{n}" for d in SHARED_TMP for n in set(os.listdir(d)) - before[d]
                if _owner(f"{d}/{n}") == sandbox.NOBODY and not n.startswith("quantgate-sandbox-")]  # ours: just above


def _owner(path: str) -> int | None:
    try:
        return os.lstat(path).st_uid
    except FileNotFoundError:
        return None


def test_full_isolation_is_the_level_here():
    level, why = sandbox.isolation_level()
    assert (level, why) == (sandbox.FULL, "")


def test_correct_program_passes_and_wrong_one_fails():
    ok = run_python("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n", FAST)
    assert ok.passed and ok.output.strip() == "ok" and ok.isolation == sandbox.FULL
    bad = run_python("def add(a, b):\n    return a - b\nassert add(2, 3) == 5\n", FAST)
    assert bad.status == "failed" and "AssertionError" in bad.output


def test_fork_bomb_is_contained():
    # 8 processes, not the default 64: the limit counts every process of uid 65534, and the quick tier's other worker
    # runs sandboxes of its own meanwhile (a bomb that used all 64 would stop theirs from starting)
    r = run_python("import os\nwhile True:\n    os.fork()\n", dataclasses.replace(FAST, processes=8))
    assert not r.passed


def test_unbounded_output_is_capped():
    r = run_python("while True:\n    print('x' * 1000)\n", FAST)
    assert not r.passed and len(r.output) <= FAST.output_bytes


def test_memory_hog_fails():
    r = run_python("x = bytearray(4 * 1024**3)\n", FAST)
    assert r.status == "failed" and "MemoryError" in r.output


def test_network_connection_is_impossible():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", FAST)
    time.sleep(0.5)
    server.close()
    assert r.status == "failed" and ("unreachable" in r.output.lower() or "refused" in r.output.lower())
    assert accepted in ([], [None])


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_deleting_a_file_outside_its_directory_fails(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    r = run_python(f"import os\nos.remove({str(target)!r})\n", FAST)
    assert r.status == "failed" and target.read_text() == "keep me"


def test_setsid_child_does_not_escape_the_kill(tmp_path):
    drop = tmp_path / "drop"
    drop.mkdir()
    os.chmod(drop, 0o777)
    marker = drop / "escaped"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(2)\n"
        f"    open({str(marker)!r}, 'w').write('escaped')\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )
    r = run_python(code, Limits(timeout_s=1, cpu_s=3))
    assert r.status == "timeout"
    time.sleep(3)
    assert not marker.exists()


def test_refuses_without_isolation_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    refused = run_python("print('hi')\n", FAST)
    assert refused.status == "refused" and "allow_unisolated" in refused.output
    allowed = run_python("print('hi')\n", FAST, allow_unisolated=True)
    assert allowed.passed and allowed.isolation == sandbox.NAMESPACES


def test_writes_to_shared_temp_dirs_stay_in_private_tmpfs():
    """Each of /tmp, /var/tmp, /dev/shm is the program's own empty tmpfs: writes succeed there, the host's
    folders gain nothing, the next program starts empty again, and 16 MiB (Limits.tmpfs_bytes) is all it gets."""
    marker = f"quantgate-hostile-{uuid.uuid4().hex}"
    code = (
        "import json, os\n"
        f"dirs = {SHARED_TMP!r}\n"
        "seen = {d: os.listdir(d) for d in dirs}\n"
        f"for d in dirs:\n    open(os.path.join(d, {marker!r}), 'w').write('x')\n"
        "print(json.dumps({'before': seen, 'after': {d: os.listdir(d) for d in dirs}}))\n"
    )
    first = run_python(code, FAST)
    assert first.passed, first.output
    listing = json.loads(first.output)
    assert listing == {"before": {d: [] for d in SHARED_TMP}, "after": {d: [marker] for d in SHARED_TMP}}
    assert not [d for d in SHARED_TMP if os.path.exists(os.path.join(d, marker))]
    second = run_python(code, FAST)
    assert second.passed and json.loads(second.output) == listing  # the first program's files went with it
    fill = run_python(
        "import errno\nn = 0\ntry:\n    while True:\n"
        "        open(f'/dev/shm/{n}', 'wb').write(bytes(2**19))\n        n += 1\n"
        "except OSError as e:\n    print(n, errno.errorcode[e.errno])\n", FAST)
    n, error = fill.output.split()
    assert fill.passed and error == "ENOSPC" and 30 <= int(n) <= 32  # 32 half-MiB files fill 16 MiB, less metadata


def test_files_outside_its_folder_cannot_be_read(tmp_path):
    """A world-readable secret in a world-readable host folder, and the repository's params.yaml: readable to
    any uid on the host (the NAMESPACES level reads them, which shows the test can fail), absent in the view."""
    secret_dir = Path(f"/tmp/quantgate-secret-{uuid.uuid4().hex}")
    secret_dir.mkdir(mode=0o755)
    try:
        secret = secret_dir / "secret.txt"
        secret.write_text("s3cret")
        secret.chmod(0o644)
        targets = [str(secret), str(REPO / "params.yaml")]
        code = (f"import json\nout = {{}}\nfor p in {targets!r}:\n    try:\n        out[p] = open(p).read()[:20]\n"
                "    except OSError as e:\n        out[p] = type(e).__name__\nprint(json.dumps(out))\n")
        full = run_python(code, FAST)
        assert full.passed and json.loads(full.output) == {p: "FileNotFoundError" for p in targets}
        assert full.isolation == sandbox.FULL
        weaker = _at_namespaces(code)
        assert json.loads(weaker.output)[str(secret)] == "s3cret"
        assert json.loads(weaker.output)[str(REPO / "params.yaml")] == (REPO / "params.yaml").read_text()[:20]
    finally:
        (secret_dir / "secret.txt").unlink(missing_ok=True)
        secret_dir.rmdir()


def _at_namespaces(code: str):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox, "isolation_available", lambda: False)
        result = run_python(code, FAST, allow_unisolated=True)
    assert result.isolation == sandbox.NAMESPACES and result.passed, result
    return result


def test_host_only_directories_are_absent():
    r = run_python("import json, os\nprint(json.dumps({'root': sorted(os.listdir('/')), 'uid': os.getuid(), "
                   "'cwd': os.getcwd(), 'dev': sorted(os.listdir('/dev'))}))\n", FAST)
    seen = json.loads(r.output)
    assert r.passed and seen["uid"] == sandbox.NOBODY and seen["cwd"] == sandbox.INSIDE
    assert set(seen["root"]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin",
                                 "tmp", "usr", "var"}
    assert not {"work", "root", "home", "mnt", "opt", "srv", "boot"} & set(seen["root"])
    assert "shm" in seen["dev"] and not [d for d in seen["dev"] if d.startswith(("sd", "nvme", "loop", "mem"))]


def test_without_bwrap_the_level_falls_back_and_is_refused(monkeypatch):
    """bwrap missing: the probe finds NAMESPACES and says why; code is refused by default, and when the caller
    allows it, it runs at NAMESPACES, named in the result (and sees the host's /work)."""
    real_which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool == "bwrap" else real_which(tool))
    level, why = sandbox.isolation_level.__wrapped__()
    assert level == sandbox.NAMESPACES and "bwrap not found" in why and "bubblewrap" in why
    monkeypatch.setattr(sandbox, "isolation_level", lambda: (level, why))
    refused = run_python("print('hi')\n", FAST)
    assert (refused.status, refused.isolation) == ("refused", sandbox.NAMESPACES)
    assert "bwrap not found" in refused.output and "allow_unisolated" in refused.output
    allowed = run_python("import os\nprint(os.path.isdir('/work'))\n", FAST, allow_unisolated=True)
    assert allowed.passed and allowed.isolation == sandbox.NAMESPACES and allowed.output.strip() == "True"


@pytest.mark.parametrize("fake, says", [
    ("echo 'bwrap: Unknown option --size' >&2; exit 1", "Unknown option --size"),  # an older bubblewrap
    ('while [ "$1" != -- ]; do shift; done; shift; exec "$@"', "exit 1: "),  # runs the program with no view
])
def test_a_bwrap_that_does_not_build_the_view_is_not_trusted(monkeypatch, tmp_path, fake, says):
    """The level comes from a real program run through bwrap, which must not see /root or /work."""
    (tmp_path / "bwrap").write_text(f"#!/bin/sh\n{fake}\n")
    (tmp_path / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    level, why = sandbox.isolation_level.__wrapped__()
    assert level == sandbox.NAMESPACES and why.startswith("bwrap cannot build the sandbox") and why.endswith(says)


LEVELS = (sandbox.FULL, sandbox.NAMESPACES, sandbox.WEAK)
CAPPED = Limits(timeout_s=30, cpu_s=5, total_memory_bytes=256 * 2**20, total_write_bytes=16 * 2**20)


def _run_at(level: str, code: str, limits: Limits):
    """Run at `level`: FULL as the machine gives it, the weaker ones by forcing the fallback as above."""
    with pytest.MonkeyPatch.context() as mp:
        if level != sandbox.FULL:
            mp.setattr(sandbox, "isolation_available", lambda: False)
            mp.setattr(sandbox, "isolation_level", lambda: (level, "forced by the test"))
        result = run_python(code, limits, allow_unisolated=level != sandbox.FULL)
    assert result.isolation == level
    return result


def _named(code: str) -> tuple[str, str]:
    """The program renamed (/proc/self/comm, which its forks inherit) so that its processes, and no one else's,
    can be looked for afterwards."""
    name = f"qg{uuid.uuid4().hex[:12]}"
    return name, f"open('/proc/self/comm', 'w').write({name!r})\n{code}"


def _left(name: str) -> list[int]:
    """Its processes still alive (a killed one is a zombie until its new parent reaps it: dead, holding nothing)."""
    return [p.pid for p in psutil.process_iter(["name", "status"])
            if p.info["name"] == name and p.info["status"] != psutil.STATUS_ZOMBIE]


MEMORY_HOGS = {
    # 6 children of 80 MiB each: every one under the 512 MiB address-space cap, 480 MiB together
    "private": ("import os, time\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
                "        block = b'x' * (80 * 2**20)\n        time.sleep(8)\n        os._exit(0)\n    kids.append(pid)\n"
                "for pid in kids:\n    os.waitpid(pid, 0)\nprint('all done')\n"),
    # one 300 MiB MAP_SHARED|MAP_ANONYMOUS region touched by 4 children: statm's "shared" pages, uncounted before
    "shared mapping": ("import mmap, os, time\nm = mmap.mmap(-1, 300 * 2**20, flags=mmap.MAP_SHARED)\nkids = []\n"
                       "for _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                       "        for i in range(0, len(m), 4096):\n            m[i] = 1\n        time.sleep(8)\n"
                       "        os._exit(0)\n    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\n"
                       "print('all done')\n"),
    # 300 memfd files of 1 MiB less a page (each under RLIMIT_FSIZE) held open and never mapped: no Rss counts them
    "memfd files": ("import os, time\nfds = [os.memfd_create(f'm{n}') for n in range(300)]\nfor fd in fds:\n"
                    "    os.write(fd, bytes(2**20 - 4096))\ntime.sleep(8)\nprint('all done')\n"),
}


@pytest.mark.parametrize("hog", sorted(MEMORY_HOGS))
@pytest.mark.parametrize("level", LEVELS)
def test_total_memory_of_all_its_processes_is_capped(level, hog):
    """Each program holds ~300-480 MiB, over the program's 256 MiB, in memory no single rlimit catches: private
    memory split over forks, a shared anonymous mapping, memfd files. Without the program-wide cap it exits 0 once
    they end, 8 s later."""
    ours = psutil.Process().memory_info().rss
    name, code = _named(MEMORY_HOGS[hog])
    r = _run_at(level, code, CAPPED)
    assert r.status == "failed" and r.reason.startswith("total memory cap 256 MiB exceeded"), r
    assert "all done" not in r.output and _left(name) == []
    assert psutil.Process().memory_info().rss - ours < 64 * 2**20


@pytest.mark.parametrize("level", LEVELS)
def test_total_bytes_written_are_capped(level):
    """1,000 files of 64 KiB: each under the 1 MiB per-file cap, 62 MiB together over the program's 16 MiB. At FULL
    they land in its tmpfs (nothing reaches the host's disk), elsewhere in its work directory, removed after."""
    free, ours = shutil.disk_usage("/tmp").free, _bytes_below(tempfile.gettempdir())  # (the worker's folder)
    code = "for n in range(1000):\n    open(f'f{n}', 'wb').write(bytes(2**16))\nprint('all written')\n"
    name, code = _named(code)
    r = _run_at(level, code, CAPPED)
    assert r.status == "failed" and r.reason.startswith("total bytes written cap 16 MiB exceeded"), r
    assert _left(name) == []  # it may have finished before a poll: the count at its end still fails it
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        assert shutil.disk_usage("/tmp").free > free - 8 * 2**20
    else:  # the disk is shared, other workers write to it meanwhile: this worker's own folder, the work directory's
        assert _bytes_below(tempfile.gettempdir()) < ours + 8 * 2**20


def _bytes_below(folder: str) -> int:
    """Disk space below `folder`, counted as the sandbox counts its own (pipelines/core/supervisor.py), all of it."""
    return supervisor.folder_bytes(Path(folder), stop_above=2**62)


def test_files_in_its_private_tmp_count_toward_the_total():
    """At FULL /tmp, /var/tmp and /dev/shm (16 MiB each) add up with the work directory under one total."""
    code = ("for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n    for n in range(6):\n"
            "        open(f'{d}/f{n}', 'wb').write(bytes(2**20 - 4096))\nprint('all written')\n")
    under = run_python(code, Limits(timeout_s=15, total_write_bytes=32 * 2**20))
    assert under.passed, under
    over = run_python(code, Limits(timeout_s=15, total_write_bytes=16 * 2**20))
    assert over.status == "failed" and over.reason.startswith("total bytes written cap 16 MiB exceeded"), over


def test_without_proc_children_files_the_tree_is_still_found(monkeypatch):
    """A kernel without /proc/PID/task/TID/children: psutil's scan finds the same processes, the cap still holds."""
    monkeypatch.setattr(supervisor, "CHILDREN_FILES", False)
    code = "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        block = b'x' * (80 * 2**20)\n" \
           "        time.sleep(8)\n        os._exit(0)\ntime.sleep(8)\n"
    r = run_python(code, Limits(timeout_s=30, total_memory_bytes=128 * 2**20))
    assert r.status == "failed" and r.reason.startswith("total memory cap 128 MiB exceeded"), r
