"""The fleet plan: which variants to deploy beside fp16, and which deployed variant serves each routing-table row.

A team pays for every variant it deploys: its weights on every replica, its own KV pool, its own canary and on-call.
So the plan minimises the fleet's expected memory for the production traffic mix, not each row's cost on its own:

    fleet bytes(S) = requests_in_flight x sum over rows r of share(r) x cost(r, variant serving r in S)
                     + sum over deployments d in S of standby_replicas x replica(d)
    replica(d)     = weights(d) + kv_pool_tokens x KV bytes per token(d)
    cost(r, d)     = replica(d) / min(requests_per_replica, kv_pool_tokens / r's context bucket)

(a request holds its share of a replica: one of its batch slots, or its context's share of the KV pool, whichever
runs out first). fp16 is always in S: it is the fallback and serves what no variant may. A row is served by the
cheapest variant in S it is eligible for (compare passed it, the shadow replay agreed, it saves at least the
type's min_memory_saving_pct: routing table's `considered`), else fp16. Shares: each request type's share of the
production sample (calibrate's coverage.json), split over its context buckets as the shadow replay counted them.

The search is exact: every subset of the eligible variants (2^k sets for k of them, each priced over every row).
At k = 4 that is 16 sets; it stays under a second to about k = 16 (65,536 sets x rows); past about 20 variants a
solver (an integer program) would be needed.

Stable under noise: plans whose fleet bytes differ by less than what footprint noise can move (memory.noise_floor_bytes
on every replica, `margin`) count as equal, and among equals the plan with the fewest deployments wins, then the one
closest to the rows' own choices, then names. The same inputs always give the same plan, and a noise-sized change in
one variant's cost does not reshuffle the fleet unless that variant's earnings sit at the margin itself: `stability`
measures it, `headroom_bytes` says how far each deployed variant is from that edge, and a note flags one within it.
"""

from __future__ import annotations

import itertools
import random

from pipelines.judging.verdict import usable
from pipelines.text.classify import UNKNOWN

def kv_per_token(memory: dict | None) -> float | None:
    """KV bytes per token of context: the theoretical one (layers x KV heads x head size x 2 x the cache's bytes: what
    a serving engine reserves its pool by, the same for every weight format), else the memory stage's fit. The fit
    moves by a few percent between runs of one checkpoint on a CPU (510 vs 493 B for fp16 on the default model), which
    would price one pool differently per variant and per run."""
    memory = memory or {}
    for key in ("theoretical_kv_bytes_per_token", "fitted_bytes_per_token"):
        if usable(memory.get(key)) and memory[key] > 0:
            return float(memory[key])
    return None


def replica_bytes(memory: dict | None, fleet) -> float | None:
    """One replica of a deployment: its weights plus the KV pool it reserves (None: not measured)."""
    per_token = kv_per_token(memory)
    if not memory or not usable(memory.get("footprint_bytes")) or per_token is None:
        return None
    return memory["footprint_bytes"] + fleet.kv_pool_tokens * per_token


def request_bytes(replica: float, tokens: int, fleet) -> float:
    """The share of a replica one request of `tokens` context holds: a batch slot, or its part of the KV pool."""
    return replica / min(fleet.requests_per_replica, fleet.kv_pool_tokens / tokens)


def row_shares(rows: list[dict], coverage: dict | None, shadow: dict | None, baseline: str) -> tuple[dict, list[str]]:
    """Each (type, bucket) row's share of production traffic, and notes on how it was estimated.

    Type shares: coverage.json `domains.<type>.production_share` (`unknown.production_share` for the unknown rows;
    what no type claims is the ambiguous rows'). A type's split over its buckets: the shadow replay's request counts
    per bucket (the first replayed variant whose replay finished: they all replay the same traffic); a type it
    replayed none of splits evenly, and the notes say so. A share that is not a number in [0, 1], or shares adding up
    to more than 1, is an error naming the file and key."""
    from pipelines.core.errors import QuantgateError

    notes = []
    by_type: dict[str, list[int]] = {}
    for r in rows:
        by_type.setdefault(r["domain"], []).append(r["max_context_tokens"])
    domains = (coverage or {}).get("domains") or {}
    for key, entry in [*((f"domains.{t}", d) for t, d in domains.items()), ("unknown", (coverage or {}).get("unknown"))]:
        share = (entry or {}).get("production_share") if isinstance(entry, dict) else None
        if (entry is not None or key != "unknown") and not (usable(share) and 0 <= share <= 1):
            raise QuantgateError(f"results/calibration/coverage.json: key '{key}.production_share': {share!r} is not a "
                                 "share of production requests in [0, 1]; re-run `quantgate calibrate`")
    claimed = sum(float(d.get("production_share") or 0) for name, d in domains.items() if name in by_type)
    shares_by_type = {t: float((domains.get(t) or {}).get("production_share") or 0) for t in by_type if t in domains}
    unknown = (coverage or {}).get("unknown") or {}
    if UNKNOWN in by_type and usable(unknown.get("production_share")):
        shares_by_type[UNKNOWN] = float(unknown["production_share"])
        claimed += shares_by_type[UNKNOWN]
    if claimed > 1.01:  # coverage.json rounds each share to 4 decimals: 1.0001 is rounding, 1.8 is a broken file
        raise QuantgateError(f"results/calibration/coverage.json: the production shares add up to {claimed:.4f}, more "
                             "than all of the sample; re-run `quantgate calibrate`")
    rest = [t for t in by_type if t not in shares_by_type]
    for t in rest:  # ambiguous and types the sample never shows share what no type claims
        shares_by_type[t] = max(0.0, 1.0 - claimed) / len(rest)
    if not domains:
        notes.append("no coverage numbers (results/calibration/coverage.json): every request type weighs the same")
        shares_by_type = {t: 1 / len(by_type) for t in by_type}
    # every replayed model saw the same traffic: the first with agreement numbers counts it by bucket
    replayed = next((m["agreement"] for m in ((shadow or {}).get("models") or {}).values()
                     if m.get("status") == "ok" and m.get("agreement")), {})
    shares = {}
    for t, buckets in by_type.items():
        counts = {b: ((replayed.get(t) or {}).get(str(b)) or {}).get("requests", 0) for b in buckets}
        total = sum(counts.values())
        if not total:
            counts, total = {b: 1 for b in buckets}, len(buckets)
            if shares_by_type[t] > 1e-9:
                notes.append(f"{t}: the shadow replay counted none of its requests by bucket; split evenly")
        for b in buckets:
            shares[(t, b)] = shares_by_type[t] * counts[b] / total
    return shares, notes


class Fleet:
    """The priced rows of one routing table: who may serve each row, at what cost, and what each deployment costs."""

    def __init__(self, rows: list[dict], memory: dict[str, dict | None], shares: dict, fleet, baseline: str,
                 noise_bytes: float = 0.0):
        self.baseline, self.fleet, self.shares, self.table_rows = baseline, fleet, shares, rows
        self.noise_bytes = noise_bytes
        self.alone = {(r["domain"], r["max_context_tokens"]): r.get("row_by_row", r["serve"]) for r in rows}
        self.replica = {n: replica_bytes(m, fleet) for n, m in memory.items()}
        self.rows = [(r["domain"], r["max_context_tokens"]) for r in rows]
        # eligible: compare passed it, the replay agreed, it saves enough (route.build_table's `worth`), it is priced
        self.eligible = {(r["domain"], r["max_context_tokens"]): [c["variant"] for c in r.get("considered") or []
                         if c.get("worth") and self.replica.get(c["variant"]) is not None] for r in rows}
        self.candidates = sorted({v for names in self.eligible.values() for v in names})

    def cost(self, variant: str, row: tuple[str, int]) -> float:
        return request_bytes(self.replica[variant], row[1], self.fleet)

    def assign(self, deployed: tuple[str, ...]) -> dict:
        """Each row's server in the deployed set: its cheapest eligible variant there (ties: name), else fp16."""
        out = {}
        for row in self.rows:
            options = [v for v in self.eligible[row] if v in deployed]
            out[row] = min(options, key=lambda v: (self.cost(v, row), v)) if options else self.baseline
        return out

    def price(self, assignment: dict) -> float | None:
        """Expected fleet bytes of an assignment (None: fp16's memory was not measured)."""
        deployed = {self.baseline, *assignment.values()}
        if any(self.replica.get(d) is None for d in deployed):  # fp16 (or a variant) not priced: no fleet bytes
            return None
        traffic = sum(self.shares.get(row, 0.0) * self.cost(v, row) for row, v in assignment.items())
        standby = sum(self.replica[d] for d in deployed) * self.fleet.standby_replicas
        return self.fleet.requests_in_flight * traffic + standby

    def plan(self, deployed: tuple[str, ...]) -> dict:
        assignment = self.assign(deployed)
        used = tuple(sorted({v for v in assignment.values() if v != self.baseline}))
        return {"deployed": [self.baseline, *used], "assignment": assignment, "bytes": self.price(assignment)}

    def margin(self) -> float:
        """The most footprint noise can move the difference between two plans' fleet bytes: every replica's weights
        off by up to noise_bytes, in both plans, over the replicas the traffic needs plus every deployment's standby
        (fp16 and each eligible variant)."""
        replicas = self.fleet.requests_in_flight * sum(
            share / min(self.fleet.requests_per_replica, self.fleet.kv_pool_tokens / row[1])
            for row, share in self.shares.items()) + self.fleet.standby_replicas * (1 + len(self.candidates))
        return 2 * self.noise_bytes * replicas

    def best(self, max_deployments: int | None = None, exactly: int | None = None) -> dict:
        """The plan over every set of eligible variants (at most max_deployments - 1, or exactly `exactly` - 1 of
        them, beside fp16): of the plans within the noise margin of the cheapest, the one with the fewest
        deployments, then the one that serves the most rows as they would be served alone, then the cheapest, then
        by name. Costs that noise can reorder never decide between plans: the choice holds when they move."""
        cap = len(self.candidates) if max_deployments is None else max(0, max_deployments - 1)
        sizes = [exactly - 1] if exactly is not None else range(min(cap, len(self.candidates)) + 1)
        plans = [self.plan(s) for k in sizes for s in itertools.combinations(self.candidates, k)]
        plans = [p for p in plans if exactly is None or len(p["deployed"]) == exactly] or plans
        priced = [p for p in plans if p["bytes"] is not None]
        if not priced:
            return plans[0]
        floor = min(p["bytes"] for p in priced) + self.margin()
        return min((p for p in priced if p["bytes"] <= floor),
                   key=lambda p: (len(p["deployed"]), -sum(p["assignment"][r] == self.alone[r] for r in self.rows),
                                  p["bytes"], p["deployed"]))

    def row_by_row(self, served: dict) -> dict:
        """The table as each row chose alone (route's own cheapest eligible variant per row)."""
        return {"deployed": [self.baseline, *sorted({v for v in served.values() if v != self.baseline})],
                "assignment": dict(served), "bytes": self.price(served)}

    def earns(self, plan: dict) -> dict[str, float | None]:
        """What each deployed variant earns: the fleet bytes the plan would cost without it, minus the plan's."""
        out = {}
        for v in plan["deployed"][1:]:
            without = self.plan(tuple(d for d in plan["deployed"][1:] if d != v))
            out[v] = None if without["bytes"] is None or plan["bytes"] is None else without["bytes"] - plan["bytes"]
        return out


def summary(name: str, plan: dict, fp16_bytes: float | None) -> dict:
    """One alternative as report.md and MLflow show it: deployments, fleet bytes, saving against fp16 alone."""
    saving = (100 * (1 - plan["bytes"] / fp16_bytes) if usable(plan["bytes"]) and usable(fp16_bytes) and fp16_bytes
              else None)
    return {"plan": name, "deployments": len(plan["deployed"]), "deployed": plan["deployed"],
            "fleet_bytes": plan["bytes"], "saving_pct": saving}


def memory_of(report: dict, baseline: str) -> dict[str, dict | None]:
    """Every model's memory numbers in compare.json: fp16's and each variant's."""
    return {baseline: report[baseline].get("memory"), **{n: v.get("memory") for n, v in report["variants"].items()}}


def stability(fleet: Fleet, memory: dict, noise_bytes: float, chosen: dict, max_deployments: int | None,
              draws: int = 200, seed: int = 0) -> dict:
    """How many rows change server when each model's measured footprint moves by up to the memory stage's noise
    floor (uniform, independent per model; `draws` seeded draws): the plan should not reshuffle on noise."""
    rng = random.Random(seed)
    changed = []
    for _ in range(draws):
        moved = {n: dict(m or {}) for n, m in memory.items()}
        for m in moved.values():
            if usable(m.get("footprint_bytes")):
                m["footprint_bytes"] += rng.uniform(-noise_bytes, noise_bytes)
        plan = Fleet(fleet.table_rows, moved, fleet.shares, fleet.fleet, fleet.baseline,
                     fleet.noise_bytes).best(max_deployments)
        changed.append(sum(plan["assignment"][r] != chosen["assignment"][r] for r in fleet.rows))
    return {"draws": draws, "noise_bytes": noise_bytes, "rows": len(fleet.rows),
            "mean_changed_rows": sum(changed) / draws, "max_changed_rows": max(changed),
            "share_of_draws_with_a_change": sum(c > 0 for c in changed) / draws}


def plan_fleet(table: dict, report: dict, coverage: dict | None, shadow: dict | None, route_params,
               noise_bytes: float) -> tuple[dict, dict]:
    """The fleet plan for a routing table built row by row: the chosen set, each row's server under it, the
    alternatives beside it (fp16 alone, row by row, the best single variant, the best plan per deployment count),
    what each deployed variant earns, and the plan's stability under measurement noise; and each row's server."""
    baseline = table["baseline"]
    shares, notes = row_shares(table["rows"], coverage, shadow, baseline)
    memory = memory_of(report, baseline)
    fleet = Fleet(table["rows"], memory, shares, route_params.fleet, baseline, noise_bytes)
    chosen = fleet.best(route_params.max_deployments)
    # the stability check plans again per draw: 200 draws up to 10 eligible variants (1,024 sets), then fewer (down to
    # 20) as the sets double; counted from the sets, not timed, so the same inputs give the same table anywhere
    draws = max(20, min(200, 200 * 1024 // 2 ** len(fleet.candidates)))
    alone = fleet.plan(())
    fp16_bytes = alone["bytes"]
    curve = [summary(f"best with {k} deployments", fleet.best(exactly=k), fp16_bytes)
             for k in range(1, len(fleet.candidates) + 2)]
    single = fleet.best(exactly=2) if fleet.candidates else alone  # by the plan's own rule, margin included
    served = {(r["domain"], r["max_context_tokens"]): r["serve"] for r in table["rows"]}
    if fp16_bytes is None:
        notes.append("fp16's memory was not measured: no plan can be priced; every row stays on fp16")
        chosen = alone
    earns, margin = fleet.earns(chosen), fleet.margin()
    notes += [f"{v} earns the fleet {e:,.0f} B, within twice the noise margin ({margin:,.0f} B): a re-measurement "
              "may drop it from the plan" for v, e in earns.items() if e is not None and e < 2 * margin]
    return {
        "objective": "requests_in_flight x sum(row share x request bytes) + standby_replicas x sum(replica bytes)",
        "fleet": route_params.fleet.model_dump(), "max_deployments": route_params.max_deployments,
        "deployed": chosen["deployed"], "fleet_bytes": chosen["bytes"],
        "assignment": {f"{t}@{b}": v for (t, b), v in chosen["assignment"].items()},
        "shares": {f"{t}@{b}": s for (t, b), s in shares.items()},
        "replica_bytes": fleet.replica, "earns_bytes": earns, "noise_margin_bytes": margin,
        "headroom_bytes": {v: None if e is None else e - margin for v, e in earns.items()},
        "alternatives": [summary("fp16 only", alone, fp16_bytes), summary("row by row", fleet.row_by_row(served),
                                                                          fp16_bytes),
                         summary("best single variant", single, fp16_bytes), summary("fleet plan", chosen, fp16_bytes)],
        "by_deployments": curve,
        "stability": stability(fleet, memory, noise_bytes, chosen, route_params.max_deployments, draws),
        "notes": notes,
    }, chosen["assignment"]
