"""The small repository of the whole-pipeline run (tests/conftest.py `pipeline_run`) and the fan-out tests' shared
pieces (tests/test_fanout.py, tests/test_repro.py): commands run with Ray's token authentication, and what two runs
are compared on."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

# every variant (conftest's pipeline_run): each quantizing library runs inside a Ray worker in one fan-out test
# (bitsandbytes and GPTQModel: tests/test_fanout.py's fixture; autoawq: tests/test_repro.py's)
SMALL_VARIANTS = ["fp16", "int8", "awq4", "gptq3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


TOKEN = Path(tempfile.gettempdir()) / f"ray-qg-token-{os.getpid()}" / "auth_token"  # the clusters' token, 0600


def env() -> dict:
    """Every node and driver with Ray's token authentication, as docs/fanout.md says to run a cluster."""
    if not TOKEN.is_file():
        TOKEN.parent.mkdir(mode=0o700, exist_ok=True)
        with os.fdopen(os.open(TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
    out = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(TOKEN)}
    for name in ("MLFLOW_TRACKING_URI", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "RAY_AUTH_TOKEN"):  # the copies' own
        out.pop(name, None)
    return out


def raylets() -> list[str]:
    return subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout.split()


def small_repo(dest: Path, variants: list[str], **fanout_settings) -> Path:
    """A copy of the repository with the end-to-end run's small settings (conftest's `pipeline_run` is this with every
    variant and three candidates; the fan-out tests make theirs the same way, so that their records and verdicts are
    comparable with it): a fifth request type, `sql`, added by configuration only (pipeline_e2e_helpers.py); 64
    calibration samples; 40 probe items a type in looks of 20; a shadow sample of 24 requests a type; judged on
    accuracy alone, with memory limits as wide as params.yaml's bounds allow (growth up to the minimum saving, a 5 %
    leak), so that two stages measuring side by side on two cores do not flip a verdict."""
    from tests.pipeline_e2e_helpers import add_sql_request_type, repo_copy, shadow_sample

    repo = repo_copy(dest)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    add_sql_request_type(repo, params)
    params["calibration"].update(samples=64, max_tokens=96)
    # 40 items cannot show a 5-point margin: 0 flips of 40 in ~12 families still leave an interval of about +-0.2 (t
    # with 11 df). A 0.25 margin lets the nearly lossless int8 pass, so registration and promotion run end to end;
    # 16 fidelity texts give KL the 100 tokens it needs
    params["evaluate"].update(look_items=20, max_items=40, fidelity_texts=16)
    params["compare"]["policy"]["default"].update(max_accuracy_drop=0.25, max_growth_excess_pct=10.0)
    params["memory"].update(seq_fractions=[0.5, 1.0], warmup_rounds=1, rounds=10, max_rounds=10, tail_rounds=6,
                            alternations=2, burst_size=2, leak_tolerance_pct=5.0)
    params["variants"] = {name: params["variants"][name] for name in variants}
    params["fanout"].update(fanout_settings)
    shadow_sample(repo, params)  # 24 requests a type (sql's 20), not all 440: route still listens to every type
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
    return repo


def with_a_stale_chain(finished: Path, dest: Path, variant: str) -> Path:
    """A copy of a finished run whose `variant` chain is gone: its quantize, memory and evaluate are stale, every other
    chain stage up to date (the smallest chain that still fans out). Every output dvc.yaml gives those stages is
    removed, not only the checkpoint, so that what the fan-out is compared on is what it wrote, never the copy's."""
    shutil.copytree(finished, dest, symlinks=True)
    stages = yaml.safe_load((dest / "dvc.yaml").read_text())["stages"]
    for kind in ("quantize", "memory", "evaluate"):
        body = stages[kind]["do"]
        for out in (o for section in ("outs", "metrics", "plots") for o in body.get(section, [])):
            path = dest / (next(iter(out)) if isinstance(out, dict) else out).replace("${key}", variant)
            assert path.exists(), f"{path}: an output of {kind}@{variant} the finished run did not write"
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return dest


def run(args: list[str], repo: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=repo, env=env(), capture_output=True, text=True, timeout=timeout)


def records(repo: Path) -> dict:
    out = {}
    for path in sorted((repo / "results" / "eval").glob("*/items.jsonl")):
        out[path.parent.name] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def verdicts(repo: Path) -> dict:
    report = json.loads((repo / "results" / "compare.json").read_text())
    return {(name, domain): (row["verdict"], (row.get("paired") or {}).get("items"),
                             (row.get("paired") or {}).get("difference"), (row.get("paired") or {}).get("ci_low"))
            for name, v in report["variants"].items() for domain, row in v["domains"].items()}
