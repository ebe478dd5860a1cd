"""Write tests/data/unknown_requests.jsonl: labelled requests that no shipped request type describes (seeded).

    .venv/bin/python scripts/make_unknown_requests.py

Structured payloads, queries, configs, logs, shell, stack traces, tables, markup, diffs, HTTP, other programming
languages and instruction-style text tasks: what a production endpoint also receives. The shipped probes never
measured any of it, so the classifier must leave it `unknown` (served by fp16); tests/test_unknown_traffic.py
measures the share that it does, per kind. About a third of the requests carry a short question in front, as a
user would send them. tests/test_unknown_traffic.py also checks that the committed file equals what this writes.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.core.io import write_jsonl  # noqa: E402

OUT = Path("tests/data/unknown_requests.jsonl")
SEED, PER_KIND = 2718, 20

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
CITIES = ["Berlin", "Austin", "Osaka", "Lyon", "Porto", "Denver", "Leeds", "Turin"]
TABLES = ["orders", "customers", "invoices", "shipments", "users", "events", "payments"]
COLUMNS = ["id", "created_at", "status", "amount", "customer_id", "email", "country", "updated_at"]
SERVICES = ["api", "worker", "billing", "auth", "gateway", "scheduler"]
ASKS = {
    "json": ["Is this JSON valid?", "Pretty-print this:", "What's wrong with this payload?"],
    "sql": ["Why is this query slow?", "Optimize this:", "Does this query do what I think?"],
    "yaml": ["Why won't this deploy?", "Check this config:", "What's wrong with this file?"],
    "config": ["Is this config right?", "Review this:", "Why is this setting ignored?"],
    "log": ["What do these logs mean?", "Can you explain these lines?", "Why is this failing?"],
    "shell": ["What does this do?", "Make this faster:", "Is this safe to run?"],
    "traceback": ["What does this error mean?", "How do I fix this?", "Got this, any idea?"],
    "csv": ["Clean up this data:", "Any duplicates here?", "What's the total?"],
    "markup": ["Fix this markup:", "Why doesn't this render?", "Validate this:"],
    "other_code": ["Why doesn't this compile?", "Review this:", "What's the bug here?"],
    "diff": ["Review this patch:", "Is this change safe?", "What does this diff do?"],
    "http": ["Why do I get a 401?", "What's wrong with this request?", "Explain this response:"],
}


def _ts(rng: random.Random) -> str:
    return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"


def _ip(rng: random.Random) -> str:
    return ".".join(str(rng.randint(1, 254)) for _ in range(4))


def json_payload(rng: random.Random) -> str:
    user = {"id": rng.randint(1, 99999), "name": rng.choice(NAMES), "city": rng.choice(CITIES),
            "active": rng.random() < 0.5, "tags": rng.sample(["vip", "beta", "trial", "eu", "us"], 2)}
    shapes = [user, {"event": rng.choice(["click", "purchase", "signup"]), "ts": _ts(rng), "user": user},
              [{"sku": f"SKU-{rng.randint(100, 999)}", "qty": rng.randint(1, 9), "price": round(rng.uniform(1, 90), 2)}
               for _ in range(rng.randint(2, 4))],
              {"status": "error", "code": rng.choice([400, 404, 422, 500]), "message": "validation failed",
               "errors": [{"field": rng.choice(COLUMNS), "reason": "required"}]}]
    return json.dumps(rng.choice(shapes), indent=rng.choice([None, 2]))


def sql_query(rng: random.Random) -> str:
    t, c1, c2 = rng.choice(TABLES), rng.choice(COLUMNS), rng.choice(COLUMNS)
    return rng.choice([
        f"SELECT {c1}, COUNT(*) AS n\nFROM {t}\nWHERE {c2} >= '2024-01-01'\nGROUP BY {c1}\nORDER BY n DESC\nLIMIT {rng.randint(5, 50)};",
        f"select * from {t} where {c1} = {rng.randint(1, 999)};",
        f"UPDATE {t} SET {c1} = 'closed', updated_at = NOW() WHERE id IN (SELECT id FROM {rng.choice(TABLES)} WHERE {c2} IS NULL);",
        f"INSERT INTO {t} ({c1}, {c2}) VALUES ('{rng.choice(NAMES)}', {rng.randint(1, 500)});",
        f"CREATE TABLE {t} (\n  id BIGSERIAL PRIMARY KEY,\n  {c1} TEXT NOT NULL,\n  {c2} TIMESTAMPTZ DEFAULT now()\n);",
        f"SELECT o.id, c.email FROM orders o JOIN customers c ON c.id = o.customer_id WHERE o.amount > {rng.randint(10, 900)} AND c.country = 'DE';",
        f"DELETE FROM {t} WHERE {c1} < NOW() - INTERVAL '{rng.randint(2, 90)} days';",
        f"WITH recent AS (\n  SELECT * FROM {t} WHERE {c1} > current_date - {rng.randint(1, 30)}\n)\nSELECT {c2}, sum(amount) FROM recent GROUP BY 1;",
    ])


def yaml_config(rng: random.Random) -> str:
    svc, port = rng.choice(SERVICES), rng.choice([8000, 8080, 5432, 6379, 3000])
    return rng.choice([
        f"apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {svc}\nspec:\n  replicas: {rng.randint(1, 6)}\n"
        f"  template:\n    spec:\n      containers:\n        - name: {svc}\n          image: registry.example.com/{svc}:1.{rng.randint(0, 9)}\n"
        f"          ports:\n            - containerPort: {port}",
        f"version: '3.8'\nservices:\n  {svc}:\n    image: {svc}:latest\n    ports:\n      - \"{port}:{port}\"\n"
        f"    environment:\n      - LOG_LEVEL=debug\n    depends_on:\n      - db",
        f"name: CI\non:\n  push:\n    branches: [main]\njobs:\n  test:\n    runs-on: ubuntu-latest\n    steps:\n"
        f"      - uses: actions/checkout@v4\n      - run: make test",
        f"# {svc} settings\nserver:\n  host: 0.0.0.0\n  port: {port}\ndatabase:\n  url: postgres://db:5432/{svc}\n  pool: {rng.randint(2, 20)}",
    ])


def config_file(rng: random.Random) -> str:
    svc, n = rng.choice(SERVICES), rng.randint(2, 64)
    return rng.choice([
        f"[tool.poetry]\nname = \"{svc}\"\nversion = \"0.{n}.0\"\n\n[tool.poetry.dependencies]\npython = \"^3.11\"\nrequests = \"^2.31\"",
        f"[database]\nhost = db.internal\nport = 5432\nuser = {rng.choice(NAMES)}\n\n[cache]\nttl = {n * 60}\nbackend = redis",
        f"# {svc} environment\nDATABASE_URL=postgres://{rng.choice(NAMES)}@db:5432/{svc}\nREDIS_URL=redis://cache:6379/0\nWORKERS={n}\nDEBUG=false",
        f"[Unit]\nDescription={svc} service\nAfter=network.target\n\n[Service]\nExecStart=/usr/bin/{svc} --port 80{n:02d}\nRestart=always",
        f"server {{\n    listen 80;\n    server_name {svc}.example.com;\n    location / {{\n        proxy_pass http://127.0.0.1:{8000 + n};\n    }}\n}}",
        f"max_connections = {n * 10}\nshared_buffers = {n}GB\nwork_mem = 64MB\nlog_min_duration_statement = 500",
    ])


def log_lines(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 5)):
        lines.append(rng.choice([
            f"{_ts(rng)} {rng.choice(['INFO', 'WARN', 'ERROR', 'DEBUG'])} [{rng.choice(SERVICES)}] request_id={rng.randint(10**5, 10**6)} "
            f"latency_ms={rng.randint(1, 4000)} status={rng.choice([200, 201, 404, 500, 503])}",
            f'{_ip(rng)} - - [12/Mar/2024:{rng.randint(10, 23)}:{rng.randint(10, 59)}:07 +0000] "GET /api/v1/{rng.choice(TABLES)}?page={rng.randint(1, 9)} HTTP/1.1" '
            f'{rng.choice([200, 304, 404, 502])} {rng.randint(200, 90000)} "-" "curl/8.4.0"',
            f"Mar {rng.randint(1, 28)} 0{rng.randint(1, 9)}:1{rng.randint(0, 9)}:4{rng.randint(0, 9)} host{rng.randint(1, 9)} "
            f"kernel: Out of memory: Killed process {rng.randint(1000, 9999)} ({rng.choice(SERVICES)})",
            json.dumps({"level": rng.choice(["info", "error"]), "ts": _ts(rng), "msg": "connection reset", "peer": _ip(rng)}),
        ]))
    return "\n".join(lines)


def shell(rng: random.Random) -> str:
    svc, n = rng.choice(SERVICES), rng.randint(2, 30)
    return rng.choice([
        f"cat /var/log/{svc}.log | grep -i error | awk '{{print $4}}' | sort | uniq -c | sort -rn | head -{n}",
        f"find . -name '*.tmp' -mtime +{n} -print0 | xargs -0 rm -f",
        f"#!/usr/bin/env bash\nset -euo pipefail\nfor f in data/*.csv; do\n  gzip -k \"$f\"\ndone\necho done",
        f"docker run --rm -p 80{n:02d}:80 -v $(pwd):/app {svc}:latest",
        f"kubectl -n prod logs deploy/{svc} --since={n}m | grep -c timeout",
        f"tar czf backup-$(date +%F).tar.gz /srv/{svc} && scp backup-*.tar.gz {rng.choice(NAMES)}@backup:/backups/",
        f"export PATH=$HOME/.local/bin:$PATH\nif [ -f ~/.bashrc ]; then\n  source ~/.bashrc\nfi",
        f"git log --oneline --since='{n} days ago' | wc -l",
        f"curl -s https://api.example.com/v1/{rng.choice(TABLES)} | jq '.[] | .id'",
        f"ps aux --sort=-%mem | head -n {n}",
    ])


def traceback(rng: random.Random) -> str:
    fn, t = rng.choice(["load", "handle", "parse_row", "fetch"]), rng.choice(TABLES)
    return rng.choice([
        f"Traceback (most recent call last):\n  File \"/app/{t}.py\", line {rng.randint(10, 300)}, in {fn}\n"
        f"    value = int(row[\"{rng.choice(COLUMNS)}\"])\n  File \"/app/util.py\", line {rng.randint(5, 90)}, in convert\n"
        f"    return mapping[key]\nKeyError: '{rng.choice(COLUMNS)}'",
        f"Exception in thread \"main\" java.lang.NullPointerException: Cannot invoke \"String.length()\"\n"
        f"\tat com.example.{t.title()}Service.{fn}({t.title()}Service.java:{rng.randint(10, 300)})\n"
        f"\tat com.example.App.main(App.java:{rng.randint(5, 40)})",
        f"TypeError: Cannot read properties of undefined (reading '{rng.choice(COLUMNS)}')\n"
        f"    at {fn} (/srv/app/src/{t}.js:{rng.randint(5, 200)}:{rng.randint(3, 40)})\n    at process.processTicksAndRejections (node:internal/process/task_queues:95:5)",
        f"thread 'main' panicked at 'called `Option::unwrap()` on a `None` value', src/{t}.rs:{rng.randint(5, 200)}:{rng.randint(3, 40)}\n"
        f"note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
        f"panic: runtime error: index out of range [{rng.randint(1, 9)}] with length {rng.randint(0, 1)}\n\ngoroutine 1 [running]:\n"
        f"main.{fn}(...)\n\t/app/{t}.go:{rng.randint(5, 200)} +0x1d",
    ])


def csv_table(rng: random.Random) -> str:
    cols = rng.sample(COLUMNS, rng.randint(3, 5))
    sep = rng.choice([",", ",", "\t", ";"])
    rows = [sep.join(cols)]
    for _ in range(rng.randint(2, 6)):
        rows.append(sep.join(str(rng.randint(1, 9999)) if c in ("id", "amount", "customer_id") else
                             rng.choice(NAMES + CITIES) for c in cols))
    return "\n".join(rows)


def markup(rng: random.Random) -> str:
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    return rng.choice([
        f"<div class=\"card\">\n  <h2>{name.title()}</h2>\n  <p>Lives in {city}</p>\n  <a href=\"/u/{name}\">Profile</a>\n</div>",
        f"<?xml version=\"1.0\"?>\n<order id=\"{rng.randint(100, 999)}\">\n  <customer>{name}</customer>\n  <city>{city}</city>\n</order>",
        f"<table><tr><th>Name</th><th>City</th></tr><tr><td>{name}</td><td>{city}</td></tr></table>",
        f"<form action=\"/login\" method=\"post\"><input name=\"user\" value=\"{name}\"><button>Sign in</button></form>",
        f"<project>\n  <groupId>com.example</groupId>\n  <artifactId>{rng.choice(SERVICES)}</artifactId>\n  <version>1.{rng.randint(0, 9)}</version>\n</project>",
    ])


def other_code(rng: random.Random) -> str:
    n, t = rng.randint(2, 99), rng.choice(TABLES)
    return rng.choice([
        f"function total(items) {{\n  let sum = 0;\n  for (const it of items) {{\n    sum += it.price * {n};\n  }}\n  return sum;\n}}",
        f"const {t} = await fetch('/api/{t}').then(r => r.json());\nconsole.log({t}.length);",
        f"func Sum(xs []int) int {{\n\ttotal := 0\n\tfor _, x := range xs {{\n\t\ttotal += x\n\t}}\n\treturn total\n}}",
        f"fn main() {{\n    let v: Vec<i32> = (1..{n}).collect();\n    println!(\"{{}}\", v.iter().sum::<i32>());\n}}",
        f"public class Main {{\n    public static void main(String[] args) {{\n        System.out.println({n});\n    }}\n}}",
        f"#include <stdio.h>\nint main(void) {{\n    int x = {n};\n    printf(\"%d\\n\", x * 2);\n    return 0;\n}}",
        f"def total(items)\n  items.sum {{ |i| i[:price] * {n} }}\nend",
        f"<?php\n$rows = $db->query('SELECT * FROM {t}');\nforeach ($rows as $r) {{\n  echo $r['id'];\n}}",
        f"val xs = listOf(1, 2, {n})\nprintln(xs.map {{ it * 2 }})",
        f"SUM(A2:A{n}) / COUNTIF(B2:B{n}, \">0\")",
    ])


def diff(rng: random.Random) -> str:
    f, n = rng.choice(["src/app.js", "README.md", "config/settings.yml", "Makefile"]), rng.randint(1, 90)
    return (f"diff --git a/{f} b/{f}\n--- a/{f}\n+++ b/{f}\n@@ -{n},{rng.randint(2, 5)} +{n},{rng.randint(2, 5)} @@\n"
            f"-  timeout: {rng.randint(1, 9)}0\n+  timeout: {rng.randint(1, 9)}00\n   retries: 3")


def http(rng: random.Random) -> str:
    t = rng.choice(TABLES)
    return rng.choice([
        f"POST /api/v2/{t} HTTP/1.1\nHost: api.example.com\nAuthorization: Bearer eyJhbGciOi.x.y\nContent-Type: application/json\n\n"
        f"{{\"{rng.choice(COLUMNS)}\": {rng.randint(1, 99)}}}",
        f"HTTP/1.1 {rng.choice([401, 403, 429, 502])} {rng.choice(['Unauthorized', 'Forbidden', 'Too Many Requests', 'Bad Gateway'])}\n"
        f"Content-Type: application/json\nRetry-After: {rng.randint(1, 60)}\n\n{{\"error\":\"denied\"}}",
        f"https://shop.example.com/search?q={rng.choice(CITIES).lower()}&page={rng.randint(1, 9)}&sort=price_desc&utm_source=mail",
        f"curl -X PUT -H 'Content-Type: application/json' -d '{{\"status\":\"paid\"}}' https://api.example.com/{t}/{rng.randint(1, 999)}",
    ])


SENTENCES = ["The meeting has been moved to Thursday afternoon.", "Our store opens at nine every morning.",
             "The package was delivered to the wrong address.", "I love the new design of the website.",
             "Please find the attached report for the last quarter.", "The weather in Lyon was sunny all week.",
             "Customers reported slow checkout times yesterday.", "This product exceeded all my expectations."]


def nl_task(rng: random.Random) -> str:
    s = rng.choice(SENTENCES)
    return rng.choice([
        f"Translate to {rng.choice(['French', 'German', 'Spanish', 'Japanese'])}: {s}",
        f"Translate the following into {rng.choice(['Italian', 'Portuguese'])}:\n{s}",
        f"Summarize in one sentence: {s} {rng.choice(SENTENCES)} {rng.choice(SENTENCES)}",
        f"Sentiment (positive/negative/neutral): {s}",
        f"Extract all dates and places as JSON. Text: {s}",
        f"Fix the grammar: {s.lower().replace('the ', 'teh ', 1)}",
        f"Rewrite formally: {s}",
        f"Classify the topic of this text as sports, business or weather. Text: {s}",
        f"Title: {s}\nKeywords:",
        f"Q: What is the capital of {rng.choice(['France', 'Japan', 'Peru'])}?\nA:",
    ])


KINDS = {"json": json_payload, "sql": sql_query, "yaml": yaml_config, "config": config_file, "log": log_lines,
         "shell": shell, "traceback": traceback, "csv": csv_table, "markup": markup, "other_code": other_code,
         "diff": diff, "http": http, "nl_task": nl_task}


def rows(seed: int = SEED, per_kind: int = PER_KIND) -> list[dict]:
    """`per_kind` requests of every kind; about a third with a question in front. scripts/make_sources.py draws the
    production sample's unknown requests with another seed."""
    rng = random.Random(seed)
    out = []
    for kind, make in KINDS.items():
        for _ in range(per_kind):
            text = make(rng)
            if kind in ASKS and rng.random() < 0.35:  # nl_task has its instruction already
                text = f"{rng.choice(ASKS[kind])}\n{text}"
            out.append({"text": text, "kind": kind})
    return out


if __name__ == "__main__":
    write_jsonl(OUT, rows())
    print(f"wrote {OUT} ({len(rows())} requests, {len(KINDS)} kinds)")
