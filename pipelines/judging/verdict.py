"""The verdict's rules: the one place where numbers become pass, inconclusive or fail.

compare judges every row with `judge`; the gate re-derives each row from compare.json's numbers with
`rederive` (the same rules), refuses rows whose numbers contradict each other or the workspace's records
(`inconsistencies`) and turns each row into pass, fail or undecided (`check_row`, `worst`): rules and their
re-check in one module, so they cannot drift apart. The accuracy rule is
non-inferiority (judging/sequential.py): `pass` when the interval's low end is at or above -margin,
`fail` when its high end is below -margin, `inconclusive` when the interval holds -margin after the last look
or when fp16 itself is not above the probe's chance level (no signal); every other limit is a hard limit.
"""

from __future__ import annotations

import math

from pipelines.core.params import Params
from pipelines.core.params_requests import PolicyParams
from pipelines.core.paths import BASELINE
from pipelines.evaluation import standard_tasks
from pipelines.evaluation.plans import PLACEHOLDERS, by_id
from pipelines.judging import sequential, stats

VERDICTS = ("pass", "inconclusive", "fail")
MIN_FIDELITY_TOKENS = 100  # llama.cpp prints no KL summary below 100 scored tokens


def usable(value) -> bool:
    """A real, finite number: not None, NaN, inf, a bool, a string or an lm-eval placeholder."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value not in PLACEHOLDERS


def pairing_problems(base: dict[str, dict], variant: dict[str, dict], ids: list[str],
                     base_name: str = BASELINE) -> list[str]:
    """Why the two models' records of `ids` cannot be paired: missing items, other prompts, no true/false."""
    problems = []
    missing = [i for i in ids if i not in base]
    if missing:
        problems.append(f"{base_name} has no record of {len(missing)} of the items (e.g. {missing[0]})")
    missing = [i for i in ids if i not in variant]
    if missing:
        problems.append(f"no record of {len(missing)} of the items (e.g. {missing[0]})")
    both = [i for i in ids if i in base and i in variant]
    differ = [i for i in both if (base[i].get("doc_hash"), base[i].get("prompt_hash"))
              != (variant[i].get("doc_hash"), variant[i].get("prompt_hash"))]
    if differ:
        problems.append(f"{len(differ)} items have other prompts than {base_name}'s (e.g. {differ[0]})")
    differ = [i for i in both if base[i].get("filter") != variant[i].get("filter")]
    if differ:  # a standard task's answers extracted by another filter are not the same measurement
        problems.append(f"{len(differ)} items were scored through another lm-eval filter than {base_name}'s "
                        f"(e.g. {differ[0]}: {variant[differ[0]].get('filter')!r} vs {base[differ[0]].get('filter')!r})")
    if any(not isinstance(base[i].get("correct"), bool) or not isinstance(variant[i].get("correct"), bool) for i in both):
        problems.append("an item has no true/false correctness")
    return problems


NOT_HERE = {"fidelity": ("KL", ("KL {p}", "fidelity tokens")), "memory": ("memory growth", ("memory growth excess",))}


def not_here_lines(not_here: dict | None, judged_elsewhere: bool) -> list[str]:
    """What a row's evidence could not measure here (a candidate judged from its lm-eval sample log), as the report
    and the gate's reasons say it: declared judged elsewhere, or open."""
    lines = []
    for check, row in sorted((not_here or {}).items()):
        if bool(row.get("judged_elsewhere")) != judged_elsewhere:
            continue
        what = NOT_HERE.get(check, (check,))[0]
        lines.append(f"{what} not measured here ({row.get('reason')}): judged elsewhere, as the candidate's "
                     f"judged_elsewhere declares" if judged_elsewhere else
                     f"{what} not measured here ({row.get('reason')}): inconclusive until it is"
                     + (f"; {row['remedy']}" if row.get("remedy") else ", or until the candidate's judged_elsewhere in "
                        f"params.yaml lists {check!r} (measured by the team elsewhere)"))
    return lines


def judge(paired: dict | None, fidelity: dict | None, memory: dict | None, policy: PolicyParams,
          identical: bool, tasks: dict[str, dict] | None = None,
          not_here: dict[str, dict] | None = None) -> tuple[str, list[str], dict]:
    """Verdict, reasons and the value/limit of each check, for one variant and domain.

    The accuracy part is sequential.accuracy_rule on the decisive look's numbers; every other limit is
    a hard limit (flips, KL, memory growth beyond fp16's, a leak, an out-of-memory error). `tasks`: the
    domain's standard-task rows ({row: {"verdict", "reasons"}}, as compare.json keeps them in the domain's
    row): one that fails (or has no known verdict) fails the domain, one that is inconclusive makes an
    otherwise passing domain inconclusive. `not_here`: checks the evidence cannot give here ({"fidelity"|"memory":
    {"reason", "judged_elsewhere"}}, a candidate judged from its sample log): not required, never a pass on their own
    account: the row is inconclusive unless each is declared judged elsewhere, and the reasons say which.
    """
    fails, checks, not_here = [], {}, not_here or {}
    task_fails, task_open = task_verdicts(tasks)
    paired = paired or {}
    margin = policy.max_accuracy_drop
    kl = (fidelity or {}).get("kl", {}).get(policy.kl_percentile)
    tokens = (fidelity or {}).get("tokens")
    growth = (memory or {}).get("growth_excess_pct")
    required = {"accuracy difference": paired.get("difference"), "interval low end": paired.get("ci_low"),
                "interval high end": paired.get("ci_high"), "interval confidence": paired.get("confidence"),
                "fp16 accuracy low end": paired.get("accuracy_fp16_low"), "chance level": paired.get("chance"),
                "item count": paired.get("items"), "flip rate": paired.get("flip_rate"),
                f"KL {policy.kl_percentile}": kl, "fidelity tokens": tokens, "memory growth excess": growth}
    for check in not_here:
        for name in NOT_HERE[check][1]:
            required.pop(name.format(p=policy.kl_percentile))
    memory, out_of_memory = memory or {}, []
    if memory.get("oom"):  # named even when the soak stopped too early to give a growth rate
        out_of_memory.append(f"out of memory: {memory['oom']}")
    for name, value in required.items():
        if not usable(value):
            fails.append(f"{name} is missing or not a number ({value!r})")
    if fails:
        return "fail", out_of_memory + fails + task_fails, checks
    fails += _inconsistent(paired)
    if fails:
        return "fail", fails + task_fails, checks
    if "fidelity" not in not_here and tokens < MIN_FIDELITY_TOKENS:
        fails.append(f"KL over {tokens} tokens only (at least {MIN_FIDELITY_TOKENS})")
    if identical:
        fails.append("every response and every token distribution equals fp16's: the variant was not really evaluated"
                     if "fidelity" not in not_here else "every response equals fp16's, multiple-choice log-likelihoods "
                     "to the last digit: the log is fp16's own run (or lm-eval's cache answered), not the candidate's")
    if paired.get("accuracy_fp16") == 0 and paired.get("accuracy") == 0:
        fails.append(f"fp16 and the variant answer none of the {paired['items']} items correctly: the probes measure "
                     "nothing here (check the task's answer extraction, or the model is not up to the domain)")
    accuracy, why = sequential.accuracy_rule(paired, margin)
    signal = no_signal(paired, margin)
    checks["signal"] = {"value": paired["accuracy_fp16_low"], "limit": paired["chance"], "decision": "no" if signal else "yes"}
    if signal and accuracy != sequential.FAIL:  # (a variant far below fp16's chance-level score still fails)
        accuracy, why = sequential.UNDECIDED, signal
    checks["accuracy_drop"] = {"value": -paired["difference"], "ci_low": paired["ci_low"], "limit": margin,
                               "decision": accuracy}
    if accuracy == sequential.FAIL:
        fails.append(why)
    checks["flip_rate"] = {"value": paired["flip_rate"], "limit": policy.max_flip_rate}
    if paired["flip_rate"] > policy.max_flip_rate:
        fails.append(f"flip rate {paired['flip_rate']:.3f} > {policy.max_flip_rate:.3f}")
    checks["kl"] = {"value": kl, "limit": policy.max_kl, "percentile": policy.kl_percentile}
    if "fidelity" in not_here:
        checks["kl"].update(not_here["fidelity"])
    elif kl > policy.max_kl:
        fails.append(f"KL {policy.kl_percentile} {kl:.4f} > {policy.max_kl}")
    checks["growth_excess_pct"] = {"value": growth, "limit": policy.max_growth_excess_pct}
    if "memory" in not_here:
        checks["growth_excess_pct"].update(not_here["memory"])
    elif growth > policy.max_growth_excess_pct:
        fails.append(f"memory grows {growth:.2f} % of fp16's footprint more than fp16 (limit {policy.max_growth_excess_pct} %)")
    if memory.get("leak"):
        fails.append("memory keeps growing under repeated traffic (leak)")
    fails += out_of_memory + task_fails
    if fails:
        return "fail", fails, checks
    unmeasured = not_here_lines(not_here, judged_elsewhere=False)
    if accuracy == sequential.UNDECIDED or task_open or unmeasured:
        return "inconclusive", ([why] if accuracy == sequential.UNDECIDED else []) + task_open + unmeasured \
            + not_here_lines(not_here, judged_elsewhere=True), checks
    return "pass", [f"{why}; every limit {'measured here ' if not_here else ''}met"
                    + (f"; task rows {', '.join(tasks)} pass" if tasks else "")] \
        + not_here_lines(not_here, judged_elsewhere=True), checks


def no_signal(paired: dict, margin: float) -> str | None:
    """Why the row cannot be judged for lack of signal, or None: fp16's own accuracy is not above the probe's chance
    level (the low end of its score interval, at the look's confidence, is at or below the mean chance of the items:
    1/choices for multiple choice, 0 for generation), or is so low that no variant could lose the margin (fp16 right
    on 1 of 200 generation items: a loss of 0.05 is impossible, so the accuracy rule could only pass). Two models
    guessing agree that nothing was lost, and non-inferiority between two coin flips says nothing about the variant."""
    low, chance = paired["accuracy_fp16_low"], paired["chance"]
    if low > chance and paired["accuracy_fp16"] > margin:
        return None
    return (f"no signal: fp16 answers {paired['accuracy_fp16']:.3f} of {paired['items']} items (low end {low:.3f}), "
            f"not above the probe's chance level {chance:.3f}; a variant cannot be shown to keep an accuracy fp16 does "
            "not have (a stronger model, or a probe this model can do)")


def task_verdicts(tasks: dict[str, dict] | None) -> tuple[list[str], list[str]]:
    """(why the domain fails, why it is inconclusive) from its task rows' verdicts."""
    fails, open_ = [], []
    for key, row in (tasks or {}).items():
        verdict = (row or {}).get("verdict")
        why = f"task row {key} did not pass ({verdict}): {'; '.join((row or {}).get('reasons') or [])}"
        if verdict == "inconclusive":
            open_.append(why)
        elif verdict != "pass":
            fails.append(why)
    return fails, open_


def _inconsistent(paired: dict) -> list[str]:
    """Paired numbers that contradict each other (a hand-edited or corrupted row): never judged, failed."""
    n, lost, gained = paired["items"], paired.get("correct_to_wrong"), paired.get("wrong_to_correct")
    out = []
    if n <= 0:
        out.append(f"judged on {n} items")
    elif not (usable(lost) and usable(gained)) or not math.isclose(paired["difference"], (gained - lost) / n, abs_tol=1e-9):
        out.append(f"difference {paired['difference']!r} is not (wrong->correct - correct->wrong) / items "
                   f"= ({gained!r} - {lost!r}) / {n}")
    if not paired["ci_low"] <= paired["difference"] <= paired["ci_high"]:
        out.append(f"interval [{paired['ci_low']!r}, {paired['ci_high']!r}] does not contain the difference "
                   f"{paired['difference']!r}")
    return out


def rederive(paired: dict | None, fidelity: dict | None, memory: dict | None, policy: PolicyParams, identical: bool,
             problems: list[str], tasks: dict[str, dict] | None = None,
             not_here: dict[str, dict] | None = None) -> tuple[str, list[str], dict]:
    """The verdict of one compare.json row from its own numbers (and, for a domain's row, its task rows'
    verdicts it keeps under `tasks`): records that do not follow the plan fail, everything else is `judge`'s.
    compare writes it, gate re-derives it, and the two must agree."""
    verdict, why, checks = judge(paired, fidelity, memory, policy, identical, tasks, not_here)
    if problems:
        return "fail", problems + why, checks
    return verdict, why, checks


# The gate's side: compare.json's rows as found, checked against their own numbers and against the workspace.
KEY_NUMBERS = ("items", "difference", "ci_low", "ci_high", "correct_to_wrong", "wrong_to_correct", "design_effect",
               "accuracy_fp16_low", "chance")


def _required(row: dict, policy: dict) -> dict:
    """The numbers the policy needs, as compare.json holds them (less what the row's evidence cannot give here)."""
    paired = row.get("paired") or {}
    kl = ((row.get("fidelity") or {}).get("kl") or {}).get(policy["kl_percentile"])
    growth = ((row.get("checks") or {}).get("growth_excess_pct") or {}).get("value")
    out = {"accuracy": paired.get("accuracy"), "accuracy_fp16": paired.get("accuracy_fp16"),
           "difference": paired.get("difference"), "ci_low": paired.get("ci_low"), "flip_rate": paired.get("flip_rate"),
           f"kl_{policy['kl_percentile']}": kl, "growth_excess_pct": growth}
    not_here = row.get("not_checked_here") or {}
    if "fidelity" in not_here:
        out.pop(f"kl_{policy['kl_percentile']}")
    if "memory" in not_here:
        out.pop("growth_excess_pct")
    return out


def inconsistencies(name: str, domain: str, row: dict, fresh: dict | None, memory: dict | None,
                    params: Params) -> list[str]:
    """Why compare.json's row cannot be believed: its verdict is not what its own numbers give, or it is not
    what the per-item records in the workspace give today."""
    where = f"{name} {domain}"
    policy = params.compare.policy_for(domain)
    if row.get("policy") != policy.model_dump():
        return [f"{where}: compared under another policy than params.yaml's"]
    out = []
    if row.get("paired") or row.get("record_problems"):
        again, _, _ = rederive(row.get("paired"), row.get("fidelity"), memory, policy,
                               bool(row.get("identical_to_fp16")), list(row.get("record_problems") or []),
                               row.get("tasks"), row.get("not_checked_here"))
        if again != row.get("verdict"):
            out.append(f"{where}: compare.json says {row.get('verdict')!r} but its own numbers give {again!r}")
    if fresh is None:
        return out + [f"{where}: not in a comparison recomputed from the workspace"]
    if fresh.get("verdict") != row.get("verdict"):
        out.append(f"{where}: compare.json says {row.get('verdict')!r}, the per-item records in the workspace give "
                   f"{fresh.get('verdict')!r}")
    theirs, ours = row.get("paired") or {}, fresh.get("paired") or {}
    differ = [k for k in KEY_NUMBERS if not _same(theirs.get(k), ours.get(k))]
    if differ:
        out.append(f"{where}: compare.json's {', '.join(differ)} differ from the per-item records'")
    return out


def _same(a, b) -> bool:
    if usable(a) and usable(b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def check_row(name: str, domain: str, row: dict | None, params: Params) -> tuple[str, list[str]]:
    """One variant and domain of a compare.json already found consistent: `pass`, `fail` or `undecided`, and why."""
    if row is None:
        return "fail", [f"{name} {domain}: no comparison"]
    policy = params.compare.policy_for(domain).model_dump()
    if row.get("verdict") == "inconclusive" and row.get("unmeasured") and not row.get("paired"):
        # this machine could not measure (no sandbox, a library or kernel missing): no evidence either way
        return "undecided", [f"{name} {domain}: {r}" for r in row.get("reasons") or ["not measured"]]
    if row.get("verdict") == "fail" or not row.get("paired"):
        return "fail", [f"{name} {domain}: {r}" for r in row.get("reasons") or ["failed"]]
    reasons = [f"{name} {domain}: {key} is missing or not a number ({value!r})"
               for key, value in _required(row, policy).items() if not usable(value)]
    if reasons:
        return "fail", reasons
    if row.get("verdict") == "inconclusive":
        return "undecided", [f"{name} {domain}: inconclusive: {'; '.join(row.get('reasons') or [])}"]
    if row.get("verdict") != "pass":
        return "fail", [f"{name} {domain}: unknown verdict {row.get('verdict')!r}"]
    return "pass", [f"{name} {domain}: {line}" for line in not_here_lines(row.get("not_checked_here"), True)]


def shadow_failures(name: str, shadow: dict | None, table: dict | None) -> list[str]:
    """Why the shadow replay fails a variant compare passed somewhere (empty: it does not). Its replay crashed or hung
    (that variant's failure, issue: the replay is part of the evidence), or the routing table's replay check refused it
    for every row compare passed it for: its answers to production traffic differ from fp16's too often to serve any
    request type, so releasing it would release nothing. Not chosen because another variant is cheaper is no failure."""
    if shadow is None:  # no shadow stage in this pipeline (a deleted shadow.json is a DVC change: undecided before)
        return []
    model = (shadow.get("models") or {}).get(name)
    if model is not None and model.get("status") == "not_measured":  # a sample log: no model to replay (gate says so)
        return []
    if model is not None and model.get("status") != "ok":
        return [f"{name}: shadow replay failed: {model.get('error') or 'no error recorded'}"]
    rows = [c for r in (table or {}).get("rows") or [] for c in r.get("considered") or []
            if c.get("variant") == name and c.get("verdict") == "pass"]
    if rows and all(c.get("shadow_refused") for c in rows):
        return [f"{name}: the shadow replay refused it for every request type compare passed it for "
                f"(e.g. {rows[0]['shadow_refused']})"]
    return []


def worst(verdicts) -> str:
    """The gate's verdict over several: any `fail` fails; pass only when there are verdicts and every one is `pass`;
    anything else (`undecided`, a compare verdict `inconclusive`, nothing at all, a value no rule gives) is undecided."""
    verdicts = list(verdicts)
    if "fail" in verdicts:
        return "fail"
    return "pass" if verdicts and all(v == "pass" for v in verdicts) else "undecided"


def regression_against(candidate_items: list[dict], production_items: list[dict], params: Params) -> list[str]:
    """Why the candidate regresses against the production version on some row (empty: it does not): each
    domain's probes and each of its standard tasks (`<domain>:<task>`) under the domain's margin.

    Paired on the items both versions answered (each answered a prefix of the pool's evaluation order, so
    the shorter one), same ids and prompt hashes; a domain whose items do not pair, or whose score interval
    reaches below the domain's margin, refuses the promotion.
    """
    reasons = []
    rows = [(domain, domain) for domain in params.evaluate.domains] + \
        [(standard_tasks.row_key(domain, spec.name), domain)
         for domain in params.evaluate.domains for spec in params.evaluate.tasks.get(domain, [])]
    for row_name, domain in rows:  # the domains' probes and their standard-task rows, each paired on its own
        prod, cand = by_id(production_items, row_name), by_id(candidate_items, row_name)
        common = sorted(set(prod) & set(cand))
        problems = pairing_problems(prod, cand, common, "production")
        if problems or not common:
            reasons.append(f"{row_name}: the candidate's items do not pair with production's "
                           f"({'; '.join(problems) or 'no items in common'})")
            continue
        before = [prod[i]["correct"] for i in common]
        after = [cand[i]["correct"] for i in common]
        paired = stats.paired_comparison(before, after, families=[prod[i].get("family") or i for i in common],
                                         confidence=params.compare.confidence)
        # stats names the base side fp16 (as in compare.json); here the base is the production version
        paired["accuracy_production"] = paired.pop("accuracy_fp16")
        margin = params.compare.policy_for(domain).max_accuracy_drop
        if not math.isfinite(paired["ci_low"]) or paired["ci_low"] < -margin:
            reasons.append(f"{row_name}: accuracy {paired['accuracy']:.3f} vs production "
                           f"{paired['accuracy_production']:.3f} on {len(common)} common items, difference interval "
                           f"[{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}] reaches below -{margin}")
    return reasons
