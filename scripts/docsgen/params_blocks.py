"""`params SECTION` blocks: the hand-written table keeps its keys and meanings; its default column is params.yaml's."""

from __future__ import annotations

import re

import yaml

from .sources import Context


def _parts(cell: str) -> list[str]:
    """A table cell's comma-separated values, commas inside brackets kept."""
    parts, depth, cur = [], 0, ""
    for ch in cell:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def _value_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return str(value)


def _same(text: str, value) -> bool:
    try:
        parsed = yaml.safe_load(text.replace("`", ""))
    except yaml.YAMLError:
        return False
    if isinstance(parsed, (int, float)) and isinstance(value, (int, float)) and not isinstance(parsed, bool):
        return float(parsed) == float(value)
    if isinstance(parsed, list) and isinstance(value, list):
        return len(parsed) == len(value) and all(_same(_value_text(p), v) for p, v in zip(parsed, value))
    return parsed == value


MISSING = object()


def _get(section: dict, key: str):
    """A key of the section, dotted for a nested one (`fleet.kv_pool_tokens`); MISSING when absent."""
    for part in key.split("."):
        if not isinstance(section, dict) or part not in section:
            return MISSING
        section = section[part]
    return section


def render_params(ctx: Context, arg: str, old: list[str]) -> list[str]:
    """The table in the block keeps its keys and meanings; its `default` column is params.yaml's values."""
    params = ctx.yaml("params.yaml")
    section = params
    for key in arg.split("."):
        section = (section or {}).get(key) if isinstance(section, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"params.yaml has no section {arg!r}")
    body = [line for line in old if line.startswith("|")]
    if len(body) < 2:
        raise ValueError("a params block holds a table with `key | default | meaning` columns")
    header = [c.strip() for c in body[0].strip("|").split("|")]
    k, d = header.index("key"), header.index("default")
    out = body[:2]
    for line in body[2:]:
        cells = line.strip()[1:-1].split("|")
        keys = [x.strip().strip("`") for x in cells[k].split(",")]
        values = _parts(cells[d].strip())
        if all(_get(section, key) is not MISSING for key in keys) and len(values) == len(keys):
            new = []
            for key, text in zip(keys, values):
                lead = re.match(r"^(\[[^\]]*\]|[^\s(]+)(.*)$", text)
                head, tail = (lead.group(1), lead.group(2)) if lead else (text, "")
                value = _get(section, key)
                if isinstance(value, dict) or _same(head, value):
                    new.append(text)
                else:  # the value changed: its old note (e.g. "(12 h)") no longer holds
                    new.append(_value_text(value))
            cells[d] = f" {', '.join(new)} "
        out.append("|" + "|".join(cells) + "|")
    return out
