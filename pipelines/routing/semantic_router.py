"""The fleet plan as a vLLM Semantic Router configuration (vllm-sr 0.4, config `version: v0.3`).

One provider model per deployed variant, fp16 the default model and a catch-all decision, and one decision per
(request type, variant) the plan routes. The router's own signals cannot say what quantgate's classifier says:
its keyword signals see raw text where quantgate matches PII-masked text, they are booleans where quantgate's `when`
adds and compares match counts, it has no count of Python lines (code_lines, comment_lines) or characters, its
decisions take the highest priority where quantgate sends a tie to fp16, and it counts context with its own
tokenizer where quantgate's buckets count with the model's. So a decision routes to a quantized variant only on
the type and bucket quantgate decided: the `quantgate_type` and `quantgate_bucket` request metadata that
`quantgate route lookup` (pipelines/routing/router.py) gives the gateway in front. The type's classifier rule rides
along as far as keyword signals express it, ANDed in as a guard: an AND can only keep more traffic on fp16, never
send a request quantgate keeps on fp16 to a quantized variant. A request without that metadata is fp16's.
What a rule's guard leaves out is listed in the file's header and in each decision's description.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pipelines.routing.router import table_id

TYPE_KEY, BUCKET_KEY, TABLE_KEY = "quantgate_type", "quantgate_bucket", "quantgate_table"  # router.metadata
PORT = 8000
# Python's 4- and 8-hex-digit unicode escapes (\u4e00, \U0001f600), which RE2 spells \x{4e00}, \x{1f600}
PY_UNICODE_ESCAPE = re.compile(r"(?<!\\)\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def re2(pattern: str) -> str | None:
    """A Python pattern in RE2's spelling (the router's Go regexp is RE2's syntax), or None where RE2 refuses it
    (lookaround, backreferences, \\Z, (?x), repeats over 1,000, ...): checked by compiling it with RE2 itself."""
    import re2 as google_re2

    spelled = PY_UNICODE_ESCAPE.sub(lambda m: "\\x{" + (m.group(1) or m.group(2).lstrip("0") or "0") + "}", pattern)
    options = google_re2.Options()
    options.log_errors = False
    try:
        google_re2.compile(spelled, options=options)
    except google_re2.error:
        return None
    return spelled


LIMITS = [
    "the router matches raw text; quantgate matches PII-masked text (an SSN is not arithmetic to quantgate)",
    "match counts, sums and the built-in counts code_lines, comment_lines and chars have no router signal: a guard "
    "keeps only the rule's `pattern >= 1` terms under and/or",
    "priorities and ties: quantgate sends a tie to fp16 (`ambiguous`); the router takes the highest priority, so the "
    f"decided type travels as request metadata `{TYPE_KEY}`",
    "context buckets: the router counts tokens with its own tokenizer; quantgate's bucket (the model's tokenizer) "
    f"travels as request metadata `{BUCKET_KEY}`",
    "fallback under memory pressure (the routing table's fallback_under_memory_pressure) has no router equivalent",
    "request metadata is the caller's: a caller that sets it routes its own request (the router grants nothing on it)",
    "a request that names a model (e.g. awq4) instead of the router's auto model is not routed by these decisions: "
    "the gateway should send every request as the auto model",
    "the canary: this is the plan's end state; apply a variant's decision once its canary (results/rollout.yaml) "
    "has reached 100 %, and keep it out of the file until then",
]


def guard(when: str, patterns: dict[str, str]) -> tuple[dict | None, list[str]]:
    """The part of a `when` expression keyword signals can express, as a router rule node (None: nothing), and what
    it leaves out. Only `name >= 1` (or `> 0`, `!= 0`) of a declared pattern RE2 compiles, under `and` and `or`: the
    guard is implied by the rule as far as the regexes match alike, and an `or` with a part left out is left out
    whole (and listed whole)."""
    left_out: list[str] = []
    text = when.strip()

    def node(n: ast.AST) -> dict | None:
        if isinstance(n, ast.BoolOp):
            mark = len(left_out)
            kids = [node(v) for v in n.values]
            if isinstance(n.op, ast.Or) and any(k is None for k in kids):
                del left_out[mark:]
                left_out.append(ast.get_source_segment(text, n) or ast.dump(n))
                return None
            kids = [k for k in kids if k is not None]
            if not kids:
                return None
            return kids[0] if len(kids) == 1 else {"operator": "AND" if isinstance(n.op, ast.And) else "OR",
                                                   "conditions": kids}
        if (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.left, ast.Name)
                and n.left.id in patterns and isinstance(n.comparators[0], ast.Constant)):
            op, value = n.ops[0], n.comparators[0].value
            positive = ((isinstance(op, ast.GtE) and value == 1) or (isinstance(op, ast.Gt) and value == 0)
                        or (isinstance(op, ast.NotEq) and value == 0))
            if positive and re2(patterns[n.left.id]) is not None:
                return {"type": "keyword", "name": n.left.id}
        left_out.append(ast.get_source_segment(text, n) or ast.dump(n))
        return None

    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None, [text]
    return node(tree), left_out


def _names(rule: dict | None) -> set[str]:
    if rule is None:
        return set()
    if "type" in rule:
        return {rule["name"]}
    return set().union(*(_names(c) for c in rule["conditions"]))


def _prefixed(rule: dict, prefix: str) -> dict:
    if "type" in rule:
        return {**rule, "name": prefix + rule["name"]}
    return {**rule, "conditions": [_prefixed(c, prefix) for c in rule["conditions"]]}


def router_config(table: dict) -> tuple[dict, list[str]]:
    """The config (a plain dict) and the header notes: what each type's guard leaves out, and the router's limits."""
    plan, baseline = table["fleet"], table["baseline"]
    classifier = table.get("classifier") or {}
    served: dict[tuple[str, str], list[int]] = {}
    for row in table["rows"]:
        if row["serve"] != baseline and row["domain"] in classifier:
            served.setdefault((row["domain"], row["serve"]), []).append(row["max_context_tokens"])
    keywords, notes, decisions = [], [], []
    metadata = [{"name": "table", "key": TABLE_KEY, "predicate": {"equals": table_id(table.get("dvc_lock_sha256"))}}]
    for domain in dict.fromkeys(d for d, _ in served):
        rule = classifier[domain]
        patterns = rule.get("patterns") or {}
        node, left_out = guard(str(rule.get("when", "false")), patterns)
        prefix = f"{domain}-"
        keywords += [{"name": prefix + n, "operator": "OR", "keywords": [re2(patterns[n])], "method": "regex",
                      "case_sensitive": True} for n in sorted(_names(node))]
        metadata.append({"name": f"type-{domain}", "key": TYPE_KEY, "predicate": {"equals": domain}})
        left_out = list(dict.fromkeys(left_out))
        if left_out:
            notes.append(f"{domain}: the guard leaves out {', '.join(left_out)}")
        for (d, variant), buckets in served.items():
            if d != domain:
                continue
            metadata.append({"name": f"bucket-{domain}-{variant}", "key": BUCKET_KEY,
                             "predicate": {"in": [str(b) for b in sorted(buckets)]}})
            conditions = [{"type": "metadata", "name": f"type-{domain}"},
                          {"type": "metadata", "name": f"bucket-{domain}-{variant}"},
                          {"type": "metadata", "name": "table"}]
            if node is not None:
                conditions.append(_prefixed(node, prefix))
            decisions.append({
                "name": f"{domain}-{variant}", "priority": 100 + int(rule.get("priority", 0)),
                "description": (f"quantgate: {domain} requests of context buckets {sorted(buckets)} -> {variant}"
                                + (f"; guard leaves out {', '.join(left_out)}" if left_out else "")),
                "rules": {"operator": "AND", "conditions": conditions},
                "modelRefs": [{"model": variant, "use_reasoning": False}]})
    decisions.append({"name": f"{baseline}-default", "priority": 0,
                      "description": "everything quantgate did not route (no or other metadata, unknown, ambiguous)",
                      "rules": {"operator": "AND", "conditions": []},
                      "modelRefs": [{"model": baseline, "use_reasoning": False}]})
    deployed = plan["deployed"]
    config = {
        "version": "v0.3",
        "listeners": [{"name": "http-8899", "address": "0.0.0.0", "port": 8899, "timeout": "300s"}],
        "providers": {"defaults": {"model": baseline}, "models": [
            {"name": v, "backend_refs": [{"name": "primary", "provider": "vllm", "endpoint": f"quantgate-{v}:{PORT}",
                                          "protocol": "http", "weight": 100}]} for v in deployed]},
        "routing": {"modelCards": [{"name": v} for v in deployed],
                    "signals": {k: v for k, v in (("keywords", keywords), ("metadata", metadata)) if v},
                    "decisions": decisions},
    }
    return config, notes


def write_router_config(table: dict, path: Path) -> Path:
    """results/vllm-sr.yaml: the config with a header that says what it assumes and what it cannot express."""
    import yaml

    from pipelines.core.io import atomic_write_text

    config, notes = router_config(table)
    header = ["vLLM Semantic Router config (vllm-sr 0.4) for quantgate's fleet plan, written by `quantgate route`; "
              "check it with `vllm-sr config validate --config results/vllm-sr.yaml`.",
              f"Deployments: {', '.join(table['fleet']['deployed'])}. Endpoints quantgate-<variant>:{PORT} are "
              "placeholders: point backend_refs at your services.",
              f"A request reaches a quantized variant only with request metadata {TYPE_KEY}, {BUCKET_KEY} and "
              f"{TABLE_KEY} as `quantgate route lookup TEXT --context-tokens N --json` prints them for it "
              f"(this table's {TABLE_KEY}: {table_id(table.get('dvc_lock_sha256'))}); "
              f"without them it is {table['baseline']}'s.", "Not expressed by the router's signals:",
              *[f"  - {line}" for line in LIMITS], *[f"  - {line}" for line in notes]]
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    atomic_write_text(path, text)
    return path
