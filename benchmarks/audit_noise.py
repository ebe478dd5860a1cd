"""The float noise the audit's tolerances must stand above, and what the audit costs.

Re-measures a large sample of the workspace's records (made by `dvc repro` with torch's default thread count and
CPU kernels) through each checkpoint, once per setting, each in its own process: torch threads 1, threads 2, and
ATEN_CPU_CAPABILITY=default (the plain kernels: a stand-in for another machine's CPU). Prints, per setting, the
largest log-likelihood / per-token log-prob and per-token KL difference from the records, how many items or texts
disagreed beyond the tolerance of params `audit:`, and the seconds it took. Run it in a finished workspace (after
`dvc repro`): `.venv/bin/python benchmarks/audit_noise.py [--items 40] [--texts 50]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {"threads=1": {"QUANTGATE_NOISE_THREADS": "1"}, "threads=2": {"QUANTGATE_NOISE_THREADS": "2"},
            "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"}}


def one(items: int, texts: int, seed: int) -> dict:
    """One setting, in this process: the audit over every variant with a large sample."""
    import torch

    from pipelines.core.params import load_params
    from pipelines.core.paths import BASELINE
    from pipelines.evaluation.remeasure import audit

    if os.environ.get("QUANTGATE_NOISE_THREADS"):
        torch.set_num_threads(int(os.environ["QUANTGATE_NOISE_THREADS"]))
        os.environ["OMP_NUM_THREADS"] = os.environ["QUANTGATE_NOISE_THREADS"]  # the audit's own process reads it
    params = load_params()
    params = params.model_copy(update={"audit": params.audit.model_copy(update={"items": items, "texts": texts})})
    names = [BASELINE, *[n for n in params.variants if n != BASELINE]]
    out = {"largest_difference": {"logprob": 0.0, "kl": 0.0, "items": 0, "texts": 0, "mismatched": 0, "tolerated": []},
           "seconds": {}, "refused": [], "could_not_run": {}, "torch_threads": torch.get_num_threads()}
    for name in names:  # one at a time: a kernel that cannot build under a setting is that variant's note, not the end
        try:
            found = audit(params, [name], seed, "cpu")
        except Exception as err:  # noqa: BLE001 - e.g. AWQ's compiled kernel under ATEN_CPU_CAPABILITY=default
            out["could_not_run"][name] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        d, n = out["largest_difference"], found["largest_difference"]
        for key in d:
            d[key] = d[key] + n[key] if key in ("items", "texts", "tolerated") else max(d[key], n[key])
        out["seconds"].update(found["seconds"])
        out["refused"] += [p for p in found["problems"] if p["variant"] == name]  # not "fp16 was not audited"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40, help="items per variant x request type")
    parser.add_argument("--texts", type=int, default=50, help="fidelity texts per variant x request type")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.items, args.texts, args.seed)))
        return 0
    out = {}
    for name, env in ((n, SETTINGS[n]) for n in args.settings):
        run = subprocess.run([sys.executable, __file__, "--one", "--items", str(args.items), "--texts", str(args.texts),
                              "--seed", str(args.seed)], env={**os.environ, **env}, capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
        d = out[name]["largest_difference"]
        print(f"{name:28s} items {d['items']:4d} texts {d['texts']:4d}  max |d log-prob| {d['logprob']:.3g}  "
              f"max |d KL| {d['kl']:.3g}  items that differed {len(d['tolerated']) + sum(len(p['items']) for p in out[name]['refused'])}"
              f"  {sum(out[name]['seconds'].values()):.1f} s  could not run: {out[name]['could_not_run'] or 'none'}",
              flush=True)
        print(json.dumps(out[name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
