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


def test_shipped_code_probes_pass_their_canonical_body_and_fail_every_escape():
    """eval/code's 898 items through lm-eval's own process_results (eval/code/utils.py): every canonical body
    passes; every item with an escape instead of its body fails (the first three exit 0)."""
    task = _task(REPO / "eval", "quantgate_code")
    docs = list(task.eval_docs)
    assert len(docs) == 898
    failed = [d["id"] for d in docs if task.process_results(d, [d["canonical"]]) != {"pass@1": 1.0}]
    assert failed == []
    escaped = [d["id"] for n, d in enumerate(docs)
               if task.process_results(d, [BODY_ESCAPES[n % len(BODY_ESCAPES)]]) != {"pass@1": 0.0}]
    assert escaped == []


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
