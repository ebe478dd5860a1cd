"""How far the fleet plan's exact search goes: seconds to plan k eligible variants over a 4-type x 3-bucket table.

    .venv/bin/python benchmarks/fleet_search.py [--max-variants 14]

Every set of the k variants is priced over every row (pipelines/routing/fleet.py `Fleet.best`), so the work grows as
2^k x rows. Synthetic variants: weights spread between 30 % and 70 % of fp16's, each eligible on a random 3/4 of the
rows (seeded). Prints, per k, the sets searched, the seconds one plan takes and the seconds per set, and where one
plan passes a second; written to docs/measured/fleet_search.json (docs/route.md quotes it; --no-record: print only).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import measured  # noqa: E402
from pipelines.core.params_sections import FleetParams  # noqa: E402
from pipelines.routing.fleet import Fleet  # noqa: E402

TYPES, BUCKETS = ("chat", "code", "code_comment", "math"), (64, 128, 256)


def fleet(k: int, seed: int = 0) -> Fleet:
    rng = random.Random(seed)
    names = [f"v{i:02d}" for i in range(k)]
    memory = {"fp16": {"footprint_bytes": 2e9, "fitted_bytes_per_token": 1e5},
              **{n: {"footprint_bytes": 2e9 * rng.uniform(0.3, 0.7), "fitted_bytes_per_token": 1e5} for n in names}}
    rows = [{"domain": t, "max_context_tokens": b, "serve": "fp16",
             "considered": [{"variant": n, "worth": True} for n in names if rng.random() < 0.75]}
            for t in TYPES for b in BUCKETS]
    shares = {(t, b): 1 / (len(TYPES) * len(BUCKETS)) for t in TYPES for b in BUCKETS}
    return Fleet(rows, memory, shares, FleetParams(), "fp16", noise_bytes=8192)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-variants", type=int, default=14)
    measured.add_arguments(parser, "fleet_search")
    args = parser.parse_args()
    results = []
    for k in range(1, args.max_variants + 1):
        f = fleet(k)
        start = time.perf_counter()
        f.best()
        seconds = time.perf_counter() - start
        sets = 2 ** len(f.candidates)
        results.append({"variants": k, "sets": sets, "seconds": round(seconds, 4),
                        "microseconds_per_set": round(1e6 * seconds / sets, 1)})
        print(f"k={k:2d}: {sets:6d} sets, {seconds:8.3f} s, {1e6 * seconds / sets:7.1f} us per set", flush=True)
    over = next((r["variants"] for r in results if r["seconds"] > 1.0), None)
    note = (f"{len(TYPES) * len(BUCKETS)} rows; one plan passes a second at k = {over} eligible variants"
            if over else f"{len(TYPES) * len(BUCKETS)} rows; every plan took under a second")
    print(note)
    if args.record:
        measured.record(args.record, "fleet_search",
                        {"header": ["eligible variants", "sets searched", "seconds", "µs per set"],
                         "rows": [[r["variants"], r["sets"], r["seconds"], r["microseconds_per_set"]] for r in results],
                         "first_k_over_one_second": over}, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
