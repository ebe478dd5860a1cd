"""A code program passes only when its tests ran to the end: every way to leave early with exit 0 fails.

Each program here would exit 0 (or be scored a pass) without the runner's token; with it, each fails. Like
tests/test_sandbox.py they need the full sandbox, and fail instead of skipping in CI (QUANTGATE_REQUIRE_SANDBOX=1).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipelines.core import sandbox
from pipelines.core.params_requests import ProbeParams
from pipelines.core.sandbox import Limits, run_python
from pipelines.evaluation import standard_tasks

pytestmark = pytest.mark.skipif(not sandbox.isolation_available() and not os.environ.get("QUANTGATE_REQUIRE_SANDBOX"),
                                reason="the sandbox needs root, util-linux and bubblewrap (CI has them and requires it)")
REPO = Path(__file__).resolve().parents[1]
FAST = Limits(timeout_s=5, cpu_s=3)
WRONG = "def add(a, b):\n    return a - b\n"  # the tests below fail it: only an escape could pass it
TESTS = "assert add(2, 3) == 5\nassert add(0, 0) == 0\npass\n"
EARLY = "exited 0 before its tests ran to the end"
ESCAPES = {
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "raise SystemExit": "raise SystemExit\n",
    "exception before the asserts": "raise ValueError('not today')\n",
    "SIGKILL to itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "SIGTERM to itself": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "fork, the parent exits 0 early": "import os, time\nif os.fork():\n    os._exit(0)\ntime.sleep(0.5)\n",
    "a fake token": "import os\nprint()\nprint(os.urandom(16).hex())\nos._exit(0)\n",
    "a trace function jumping past the asserts": (
        "import sys\ndef jump(frame, event, arg):\n    if event == 'line' and frame.f_code.co_filename == 'program.py' "
        "and frame.f_lineno == 10:\n        frame.f_lineno = 12\n    return jump\n"
        "sys._getframe().f_trace = jump\nsys.settrace(jump)\n"),
}


def test_a_program_that_runs_to_the_end_passes_and_its_output_is_its_own():
    r = run_python(WRONG.replace("a - b", "a + b") + TESTS + "print('x' * 99999)\nprint('done')\n", FAST)
    assert r.passed and r.reason == "" and r.output.startswith("x" * 2000)  # 100 KB printed: the token is read at the end
    short = run_python("print('ok')\n", FAST)
    assert short.passed and short.output == "ok\n"  # the token line is not part of what the program printed


@pytest.mark.parametrize("escape", sorted(ESCAPES))
def test_every_escape_before_the_asserts_fails(escape):
    r = run_python(WRONG + ESCAPES[escape] + TESTS, FAST)
    assert r.status == "failed", (escape, r)
    if escape in ("sys.exit(0)", "os._exit(0)", "raise SystemExit", "fork, the parent exits 0 early", "a fake token"):
        assert r.returncode == 0 and r.reason.startswith(EARLY), r  # exit 0: what used to pass
    elif escape.startswith("SIG"):
        assert r.reason.startswith("exit 1") or "signal" in r.reason, r
    else:
        assert "Error" in r.output, r


def test_the_token_is_nowhere_the_program_can_read(monkeypatch):
    """Its file, argv (/proc/self/cmdline), environment, stdin and work directory: the program prints every
    32-hex-digit string it finds there and exits 0; none is the token, and it fails."""
    tokens = []
    real = secrets.token_hex
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda n: tokens.append(real(n)) or tokens[-1])
    code = ("import glob, os, re, sys\nseen = [open(__file__).read(), open('/proc/self/cmdline').read(), repr(os.environ),"
            " repr(sys.argv), os.read(0, 4096).decode()]\nseen += [open(p).read() for p in glob.glob('*')]\n"
            "found = re.findall(r'[0-9a-f]{32}', ''.join(seen))\nprint(len(''.join(seen)), *found, flush=True)\nos._exit(0)\n")
    r = run_python(code, FAST)
    assert r.status == "failed" and r.reason.startswith(EARLY), r
    assert len(tokens) == 1 and tokens[0] not in r.output and int(r.output.split()[0]) > len(code)


def _task(include_path: Path | str, name: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path), include_defaults=False).load([name])["tasks"][name]


# one-line completions (the probes stop at a newline) that leave before the asserts can fail, as a body would
BODY_ESCAPES = (" __import__('os')._exit(0)", " __import__('sys').exit(0)", " (_ for _ in ()).throw(SystemExit)",
                " __import__('os').kill(__import__('os').getpid(), 15)")


def test_shipped_code_probes_pass_their_canonical_body_and_fail_every_escape(every_item):
    """eval/code's 1,000 items through lm-eval's own process_results (eval/code/utils.py): every canonical body
    passes (a wrong item's tests would fail its own body: checked on every item in the full run, every ninth in the
    quick tier); an escape instead of the body fails (the first three exit 0), checked in both on every ninth item and
    the first of each template (every escape and every template among them): every item's tests call its function
    first, so an escape leaves before any of the item's own checks and what it shows does not depend on the item; the
    rest cost about a minute of sandboxes on two cores (that each item's tests run its body and fail it with any other
    number: tests/test_probes.py, test_code_probe_tests_reject_a_miscopied_number)."""
    task = _task(REPO / "eval", "quantgate_code")
    docs = list(task.eval_docs)
    assert len(docs) == 1000
    first_of_template = {}
    for n, doc in enumerate(docs):  # the function is called by the first line of the tests: an escape leaves there
        first = doc["tests"].split("\n", 1)[0]
        assert first.startswith("assert ") and f"{doc['prompt'][4:].split('(')[0]}(" in first, doc["id"]
        first_of_template.setdefault(doc["template"], n)
    sample = sorted(set(range(0, len(docs), 9)) | set(first_of_template.values()))
    picked = range(len(docs)) if every_item else sample
    # each call is its own sandboxed process: a thread per core this process may use keeps them busy (half the time
    # on two); at most 4, as every sandbox counts against the one uid's process limit (sandbox.Limits)
    with ThreadPoolExecutor(max_workers=min(4, len(os.sched_getaffinity(0)))) as pool:
        canonical = list(pool.map(lambda n: task.process_results(docs[n], [docs[n]["canonical"]]), picked))
        escapes = list(pool.map(lambda n: task.process_results(docs[n], [BODY_ESCAPES[n % len(BODY_ESCAPES)]]), sample))
    assert [docs[n]["id"] for n, got in zip(picked, canonical) if got != {"pass@1": 1.0}] == []
    assert [docs[n]["id"] for n, got in zip(sample, escapes) if got != {"pass@1": 0.0}] == []
    assert {n % len(BODY_ESCAPES) for n in sample} == set(range(len(BODY_ESCAPES)))  # every escape is tried


def test_a_declared_runs_code_type_gets_the_same_check(tmp_path):
    """A team's own type (`scripts`, runs_code: true) built as docs/request-types.md says, from eval/code's task
    YAML and hook: its canonical programs pass, and an escape instead of the body fails."""
    ProbeParams(task="quantgate_scripts", metric="pass@1", fields=["id", "prompt", "canonical", "tests"],
                text="{{prompt}}{{canonical}}", runs_code=True)  # the declaration params.yaml would hold
    items = [{"id": f"s{n}", "prompt": f"def scale_{n}(x):\n    return", "canonical": f" x * {n}",
              "tests": f"assert [scale_{n}(x) for x in range(5)] == {[x * n for x in range(5)]}\n"} for n in (2, 3, 7)]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    yaml = (REPO / "eval/code/quantgate_code.yaml").read_text()
    (tmp_path / "quantgate_scripts.yaml").write_text(
        yaml.replace("task: quantgate_code", "task: quantgate_scripts")
        .replace("eval/code/items.jsonl", str(tmp_path / "items.jsonl")))
    shutil.copy(REPO / "eval/code/utils.py", tmp_path / "utils.py")
    task = _task(tmp_path, "quantgate_scripts")
    docs = list(task.eval_docs)
    assert [task.process_results(d, [d["canonical"]]) for d in docs] == [{"pass@1": 1.0}] * 3
    for body in BODY_ESCAPES:
        assert [task.process_results(d, [body]) for d in docs] == [{"pass@1": 0.0}] * 3, body


@pytest.mark.parametrize("escape", ["    import posix; posix._exit(0)\n", "    __import__('os').kill(__import__('os').getpid(), 9)\n"])
def test_humaneval_and_mbpp_scorers_fail_an_escape(escape):
    """The standard tasks' wrapper replaces os._exit and catches SystemExit, as code_eval does; posix._exit
    still left with exit 0 before the token: scored a pass before it, a failure now."""
    doc = {"prompt": "def add(a, b):\n", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
           "entry_point": "add"}
    assert standard_tasks.humaneval_results(doc, [escape]) == {"pass@1": 0.0}
    assert standard_tasks.humaneval_results(doc, ["    return a + b\n"]) == {"pass@1": 1.0}
    mbpp = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]}
    assert standard_tasks.mbpp_results(mbpp, ["def add(a, b):\n" + escape]) == {"pass@1": 0.0}
    assert standard_tasks.mbpp_results(mbpp, [re.sub(r"^ +", "", escape)]) == {"pass@1": 0.0}


# Stealing the token instead of running the tests: each program below looks for it where a reviewer found it (a local
# of the runner's frames), or in raw memory, prints every candidate as the runner would (a newline, then it) and
# exits 0. The token lives only in the watcher thread's frame, the audit hook refuses every way to reach it, and
# the watcher writes it only once the main thread's `_main` frame is past exec(): each fails, none prints it.
EMIT = ("import posix\ndef emit(found):\n    for b in found:\n"
        "        if isinstance(b, (bytes, bytearray)) and b.strip():\n"
        "            posix.write(1, b'\\n' + bytes(b).strip(b'\\n') + b'\\n')\n    posix._exit(0)\n")
FRAME_WALK = ("import sys\nfound, f, n = [], None, 0\nwhile True:\n    try:\n        f = sys._getframe(n)\n"
              "    except ValueError:\n        break\n    found += [v for v in f.f_locals.values() if isinstance(v, bytes)]\n"
              "    n += 1\nemit(found)\n")
STEALS = {
    "the reviewer's one-liner": "__import__('posix').write(1, b'\\n'+__import__('sys')._getframe(1).f_locals['token']);"
                                " __import__('posix')._exit(0)\n",
    "f_back walk, every bytes local of every frame": FRAME_WALK,
    "traceback tb_frame.f_back walk": (
        "found = []\ntry:\n    1 / 0\nexcept ZeroDivisionError as e:\n    f = e.__traceback__.tb_frame\n"
        "while f is not None:\n    found += [v for v in f.f_locals.values() if isinstance(v, bytes)]\n"
        "    f = f.f_back\nemit(found)\n"),
    "gc.get_objects, bytes of the token's length": (  # bytes are not tracked: in frames' locals and containers
        "import gc\nfound = []\nfor o in gc.get_objects():\n    if type(o).__name__ == 'frame':\n"
        "        o = o.f_locals\n    found += [v for v in (o.values() if isinstance(o, dict) else o if isinstance(o, "
        "(list, tuple)) else ()) if isinstance(v, bytes) and len(v) in (33, 34)]\nemit(found)\n"),
    "gc.get_referrers of the frames": (
        "import gc, sys\nemit([v for r in gc.get_referrers(sys._getframe()) for v in getattr(r, 'f_locals', {}).values()])\n"),
    "sys._current_frames, every thread's frames": (
        "import sys\nfound = []\nfor f in sys._current_frames().values():\n    while f is not None:\n"
        "        found += [v for v in f.f_locals.values() if isinstance(v, bytes)]\n        f = f.f_back\nemit(found)\n"),
    "ctypes": "import ctypes\nemit([ctypes.string_at(id(b'x'), 8)])\n",
    "ctypes under another name": (
        "import glob, importlib.util\nspec = importlib.util.spec_from_file_location('json._ctypes', "
        "glob.glob('/usr/lib/python3*/lib-dynload/_ctypes*')[0])\nimportlib.util.module_from_spec(spec)\nemit([])\n"),
    "/proc/self/mem": (
        "import re\nfound = []\nwith open('/proc/self/mem', 'rb', 0) as mem:\n"
        "    for line in open('/proc/self/maps'):\n        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "        if 'rw' in line.split()[1]:\n            mem.seek(lo)\n            try:\n"
        "                found += re.findall(rb'[0-9a-f]{32}\\n', mem.read(hi - lo))\n"
        "            except OSError:\n                pass\nemit(found)\n"),
    "/proc/self/task/N/mem through a symlink": (
        "import os\nos.symlink(f'/proc/self/task/{os.getpid()}/mem', '/tmp/m')\nopen('/tmp/m', 'rb')\nemit([])\n"),
    "/proc/self/mem by dir_fd": (
        "import os\nd = os.open('/proc/self', os.O_RDONLY)\nos.open('mem', os.O_RDONLY, dir_fd=d)\nemit([])\n"),
    "a PathLike that names another file to the hook": (
        "import os\nclass P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n"
        "        return 'x' if P.n == 1 else '/proc/self/mem'\nopen(P(), 'rb')\nemit([])\n"),
    "a fork that runs a fresh interpreter on its parent's memory": (
        "import os, sys\nif os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-c', 'print(1)'])\n"
        "os.wait()\nemit([])\n"),
    "subprocess": "import subprocess\nsubprocess.run(['/bin/true'])\nemit([])\n",
    "its own audit hook, then a wake-up": (
        "import os, sys, threading\nfound = []\ndef spy(event, args):\n    f = sys._getframe(1)\n    while f:\n"
        "        found.extend(v for v in f.f_locals.values() if isinstance(v, bytes))\n        f = f.f_back\n"
        "sys.addaudithook(spy)\n"
        "for fd in os.listdir('/proc/self/fd'):\n    try:\n        os.write(int(fd), b'x')\n    except OSError:\n"
        "        pass\nimport time\ntime.sleep(0.3)\nemit(found)\n"),
    "a thread wakes the watcher through every pipe, then exit 0": (
        "import os, threading\ndef wake():\n    for fd in os.listdir('/proc/self/fd'):\n        try:\n"
        "            if os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n                os.write(int(fd), b'.')\n"
        "        except OSError:\n            pass\n    os._exit(0)\nthreading.Thread(target=wake).start()\n"
        "import time\ntime.sleep(5)\n"),
    "sys.exit(0), then an atexit handler wakes the watcher": (
        "import atexit, os, sys, time\ndef wake():\n    for fd in os.listdir('/proc/self/fd'):\n        try:\n"
        "            if os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n                os.write(int(fd), b'.')\n"
        "        except OSError:\n            pass\n    time.sleep(0.3)\natexit.register(wake)\nsys.exit(0)\n"),
    "settrace on every thread": "import threading, sys\nthreading.settrace(lambda *a: None)\nsys.settrace(None)\nemit([])\n",
}


@pytest.fixture
def issued(monkeypatch):
    """The tokens run_python issues, to look for them in what a program printed."""
    tokens = []
    real = secrets.token_hex
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda n: tokens.append(real(n)) or tokens[-1])
    return tokens


@pytest.mark.parametrize("steal", sorted(STEALS))
def test_stealing_the_token_fails(steal, issued):
    r = run_python(WRONG + EMIT + STEALS[steal] + TESTS, FAST)
    assert r.status == "failed", (steal, r)
    assert len(issued) == 1 and issued[0] not in r.output, (steal, r)


def test_waking_the_watcher_early_then_running_the_asserts_still_fails(issued):
    """The program's thread writes to every pipe (W's included), then the program runs its asserts correctly and
    ends normally: W woke while the main thread was still inside exec(), wrote nothing and stopped."""
    wake = ("import os, threading\ndef wake():\n    for fd in os.listdir('/proc/self/fd'):\n        try:\n"
            "            if os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n                os.write(int(fd), b'.')\n"
            "        except OSError:\n            pass\nt = threading.Thread(target=wake)\nt.start()\nt.join()\n"
            "import time\ntime.sleep(0.2)\n")
    r = run_python(WRONG.replace("a - b", "a + b") + wake + TESTS, FAST)
    assert r.status == "failed" and r.returncode == 0 and r.reason.startswith(EARLY), r
    ok = run_python(WRONG.replace("a - b", "a + b") + TESTS, FAST)  # the same program without the wake-up passes
    assert ok.passed, ok


def test_the_wake_line_is_the_runner_write_that_follows_exec():
    lines = sandbox.RUNNER.splitlines()
    assert lines[sandbox.WAKE_LINE - 1].strip().startswith("_write(w, ")
    assert [n for n, line in enumerate(lines, 1) if "exec(code, main.__dict__)" in line][0] < sandbox.WAKE_LINE


def test_common_standard_library_use_passes():
    """What model-written solutions import: the audit hook refuses none of it."""
    code = ("import collections, dataclasses, enum, functools, heapq, itertools, json, math, re, string, typing\n"
            "import bisect, copy, decimal, fractions, operator, random, statistics, datetime, textwrap, pathlib\n"
            "P = collections.namedtuple('P', 'x y')\nclass C(enum.Enum):\n    A = 1\n@dataclasses.dataclass\n"
            "class D:\n    a: typing.List[int]\n@functools.lru_cache(None)\ndef fib(n):\n    return n if n < 2 else "
            "fib(n - 1) + fib(n - 2)\nassert P(1, 2).y == 2 and C.A.value == 1 and D([1]).a == [1] and fib(30) == 832040\n"
            "assert json.loads(json.dumps({'a': [1]})) == {'a': [1]} and re.findall(r'\\d+', 'a1b22') == ['1', '22']\n"
            "assert list(itertools.accumulate([1, 2, 3])) == [1, 3, 6] and math.isqrt(17) == 4\n"
            "assert copy.deepcopy([[1]]) == [[1]] and str(decimal.Decimal('1.5') * 2) == '3.0'\n"
            "open('f.txt', 'w').write('x')\nassert open('f.txt').read() == 'x' and pathlib.Path('f.txt').exists()\n"
            "try:\n    import numpy\nexcept ImportError:\n    pass\nprint('ok')\n")
    r = run_python(code, FAST)
    assert r.passed and r.output == "ok\n", r


@pytest.mark.parametrize("steal", ["    " + STEALS["f_back walk, every bytes local of every frame"]
                                   .replace("\n", "\n    ").rstrip() + "\n"])
def test_humaneval_and_mbpp_wrapper_frame_walk_fails(steal, issued):
    """standard_tasks._EXEC runs the program in a nested exec(): the frame walk reaches the runner's frames
    through it and finds no token."""
    body = "    " + EMIT.replace("\n", "\n    ").rstrip() + "\n" + steal
    doc = {"prompt": "def add(a, b):\n", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
           "entry_point": "add"}
    assert standard_tasks.humaneval_results(doc, [body]) == {"pass@1": 0.0}
    mbpp = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]}
    assert standard_tasks.mbpp_results(mbpp, ["def add(a, b):\n" + body]) == {"pass@1": 0.0}
    assert standard_tasks.mbpp_results(mbpp, [EMIT + FRAME_WALK]) == {"pass@1": 0.0}
    reviewer = STEALS["the reviewer's one-liner"].replace("_getframe(1)", "_getframe(2)")  # one exec() deeper
    assert standard_tasks.mbpp_results(mbpp, [reviewer]) == {"pass@1": 0.0}
    assert len(issued) == 4
