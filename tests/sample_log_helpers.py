"""`lm_eval --model hf ... --log_samples`, run as a team would run it: the sample logs of tests/test_sample_logs.py and
tests/test_baseline_log.py (tests/tiny_chain.py, `log_evidence`) and of the end-to-end run's candidate judged from its
log (`pipeline_run`); and the edits a hurried user makes to one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipelines.core.params_sections import CompareParams, EvaluateParams
from pipelines.evaluation import sample_logs

# the plan the logs of `log_evidence` (tests/tiny_chain.py) cover: generation (exact match) and multiple choice
P = EvaluateParams(look_items=4, max_items=8, batch_size=8, fidelity_texts=4)
DOMAINS = ["math", "chat", "code_comment"]
COMPARE = CompareParams()


def lm_eval_log(model_dir: Path, out: Path, plan: dict[str, dict], cwd: Path, batch_size: int,
                dtype: str = "float16") -> Path:
    """The log of `model_dir` (in `dtype`) over the items the look plan can ask (their positions in each probe pool,
    given to lm-eval as --samples), with the pipeline's batch size and seeds; code probes run in the sandbox."""
    from pipelines.evaluation.plans import lm_eval_samples

    positions = lm_eval_samples(plan, cwd / "eval")
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "run", "--model", "hf", "--model_args",
           f"pretrained={model_dir},dtype={dtype}", "--tasks", ",".join(positions), "--include_path", "eval",
           "--batch_size", str(batch_size), "--seed", "0", "--log_samples", "--output_path", str(out),
           "--samples", json.dumps(positions), "--confirm_run_unsafe_code"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out


def from_log(evidence, folder):
    base_result, base_items = evidence["base"]
    return sample_logs.records(sample_logs.read_log(folder), evidence["plan"], base_items, base_result,
                               COMPARE.policy_for, COMPARE)


def edited_log(evidence, name: str, edit) -> Path:
    """A copy of fp16's log with `edit(folder)` applied."""
    folder = evidence["tmp"] / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(evidence["logs"]["fp16"], folder)
    edit(next(folder.rglob("results_*.json")).parent)
    return folder


def refusal(evidence, folder: Path, row: str) -> str:
    """The reason the row of the log in `folder` is refused (it must be; the other rows are still judged)."""
    summary, _ = from_log(evidence, folder)
    assert summary[row]["status"] == "refused", summary[row]
    assert all(s["status"] == "ok" for r, s in summary.items() if r != row)
    return summary[row]["reason"]


def samples_file(folder: Path, task: str) -> Path:
    return next(folder.glob(f"samples_{task}_*.jsonl"))


def rewrite_line(path: Path, number: int, change) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[number - 1] = change(lines[number - 1])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
