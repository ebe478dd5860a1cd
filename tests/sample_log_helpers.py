"""`lm_eval --model hf ... --log_samples`, run as a team would run it: the sample logs of tests/test_sample_logs.py and
of the end-to-end run's candidate judged from its log (tests/conftest.py, `pipeline_run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def lm_eval_log(model_dir: Path, out: Path, plan: dict[str, dict], cwd: Path, batch_size: int,
                dtype: str = "float16") -> Path:
    """The log of `model_dir` (in `dtype`) over the items the look plan can ask (their positions in each probe pool,
    given to lm-eval as --samples), with the pipeline's batch size and seeds; code probes run in the sandbox."""
    from pipelines.evaluation.sample_logs import lm_eval_samples

    positions = lm_eval_samples(plan, cwd / "eval")
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "run", "--model", "hf", "--model_args",
           f"pretrained={model_dir},dtype={dtype}", "--tasks", ",".join(positions), "--include_path", "eval",
           "--batch_size", str(batch_size), "--seed", "0", "--log_samples", "--output_path", str(out),
           "--samples", json.dumps(positions), "--confirm_run_unsafe_code"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out
