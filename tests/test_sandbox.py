"""Hostile programs through the sandbox: each is contained, scored as a failure, and leaves nothing behind."""

from __future__ import annotations

import os
import socket
import threading
import time

import psutil
import pytest

from pipelines import sandbox
from pipelines.sandbox import Limits, run_python

pytestmark = pytest.mark.skipif(not sandbox.isolation_available(),
                                reason="sandbox isolation needs root, unshare and setpriv (CI runs as root)")
FAST = Limits(timeout_s=5, cpu_s=3)


def nobody_processes() -> list[int]:
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == sandbox.NOBODY]


@pytest.fixture(autouse=True)
def machine_left_as_it_was():
    before = set(os.listdir("/tmp"))
    yield
    time.sleep(0.2)
    assert nobody_processes() == []
    assert not [n for n in set(os.listdir("/tmp")) - before if n.startswith("quantgate-sandbox-")]


def test_correct_program_passes_and_wrong_one_fails():
    ok = run_python("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n", FAST)
    assert ok.passed and ok.output.strip() == "ok" and ok.isolation == sandbox.FULL
    bad = run_python("def add(a, b):\n    return a - b\nassert add(2, 3) == 5\n", FAST)
    assert bad.status == "failed" and "AssertionError" in bad.output


def test_fork_bomb_is_contained():
    r = run_python("import os\nwhile True:\n    os.fork()\n", FAST)
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
    assert allowed.passed and allowed.isolation == sandbox.WEAK
