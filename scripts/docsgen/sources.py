"""What a block reads (results, params.yaml, older commits, docs/measured/*.json) and the provenance line naming it.

Every read goes through a Context, so the block's last line can list each source with its date and what wrote it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .format import words

GENERATOR = "python scripts/docs_numbers.py"


class SourceMissing(Exception):
    """A block's source is not in this checkout: the block is left as it is, and not checked."""



def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


@dataclass
class Used:
    kind: str            # file, git, measured
    path: str
    made_by: str = ""
    commit: str = ""
    data: dict | None = None


@dataclass
class Context:
    root: Path
    used: list[Used] = field(default_factory=list)
    # another run's copy (`<!-- numbers:KIND @docs/measured/smollm2 -->`): its results/ and params.yaml are read there
    run_copy: str = ""

    def _note(self, used: Used) -> None:
        if not any(u.kind == used.kind and u.path == used.path and u.commit == used.commit for u in self.used):
            self.used.append(used)

    def read(self, path: str, made_by: str = "") -> str:
        if self.run_copy and (path.startswith("results/") or path == "params.yaml"):
            path = f"{self.run_copy}/{path}"
            made_by = "a profile's `quantgate repro`, copied by `benchmarks/real_profile.py`"
        file = self.root / path
        if not file.is_file():
            who = f"`dvc repro` (stage `{made_by[6:]}`)" if made_by.startswith("stage:") else made_by
            raise SourceMissing(f"{path} is not in this checkout" + (f" ({who} writes it)" if who else ""))
        self._note(Used("file", path, made_by))
        return file.read_text(encoding="utf-8")

    def json(self, path: str, made_by: str = "") -> dict:
        return json.loads(self.read(path, made_by))

    def yaml(self, path: str) -> dict:
        return yaml.safe_load(self.read(path))

    def at_commit(self, commit: str, path: str) -> dict:
        out = git(self.root, "show", f"{commit}:{path}")
        if out.returncode != 0:
            raise SourceMissing(f"{path} at commit {commit} is not in this clone (a shallow clone lacks it)")
        self._note(Used("git", path, commit=commit))
        return json.loads(out.stdout)

    def measured(self, name: str) -> dict:
        path = f"docs/measured/{name}.json"
        file = self.root / path
        if not file.is_file():
            raise SourceMissing(f"{path} is missing: run the benchmark that writes it")
        data = json.loads(file.read_text(encoding="utf-8"))
        self._note(Used("measured", path, data=data))
        return data


def file_date(root: Path, path: str) -> str:
    """The date of the file's last commit when it is committed unchanged, else the day it was last written."""
    if git(root, "ls-files", "--error-unmatch", "--", path).returncode == 0 \
            and git(root, "diff", "--quiet", "HEAD", "--", path).returncode == 0:
        day = git(root, "log", "-1", "--format=%cs", "--", path).stdout.strip()
        if day:
            return day
    stamp = (root / path).stat().st_mtime
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc).date().isoformat()


def commit_date(root: Path, commit: str) -> str:
    return git(root, "log", "-1", "--format=%cs", commit).stdout.strip() or "date unknown"


def machine_text(machine: dict | None) -> str:
    if not machine:
        return ""
    if machine.get("description"):
        return machine["description"]
    parts = [f"{machine['cpus']} cores" if machine.get("cpus") else "", machine.get("cpu", ""), machine.get("gpu", "")]
    return ", ".join(p for p in parts if p)


def undated(line: str) -> str:
    return re.sub(r"\(\d{4}-\d\d-\d\d(?: to \d{4}-\d\d-\d\d)?\)", "(DATE)", line)


def _grouped(paths: list[str]) -> list[tuple[str, list[str]]]:
    """Paths that differ in one name as one label, in first-seen order: files of one folder and suffix as
    `folder/{a,b}.json`, then files of one name in sibling folders as `eval/{math,code}/items.jsonl`."""
    def split(path: str) -> tuple[str, str, str]:
        folder, _, name = path.rpartition("/")
        stem, dot, suffix = name.partition(".")
        return folder, stem, dot + suffix

    by_file: dict[tuple, list[str]] = {}
    for path in paths:
        folder, _, suffix = split(path)
        by_file.setdefault((folder, suffix), []).append(path)
    groups: dict[tuple, list[str]] = {}
    for key, members in by_file.items():
        if len(members) > 1:
            groups[("file",) + key] = members
        else:
            folder, _, name = members[0].rpartition("/")
            parent, _, _ = folder.rpartition("/")
            groups.setdefault(("folder", parent, name), []).append(members[0])
    out = []
    for key, members in groups.items():
        if len(members) == 1:
            out.append((members[0], members))
        elif key[0] == "file":
            folder, suffix = key[1], key[2]
            inner = "{" + ",".join(split(m)[1] for m in members) + "}"
            out.append((f"{folder + '/' if folder else ''}{inner}{suffix}", members))
        else:
            parent, name = key[1], key[2]
            inner = "{" + ",".join(m.rpartition("/")[0].rpartition("/")[2] for m in members) + "}"
            out.append((f"{parent + '/' if parent else ''}{inner}/{name}", members))
    return out


def _stages(names: list[str]) -> str:
    """`memory-report`, `memory@<variant>`: a stage per variant named once."""
    prefixes = [n.split("@")[0] for n in names if "@" in n]
    shown = []
    for n in names:
        if "@" in n and prefixes.count(n.split("@")[0]) > 1:
            n = n.split("@")[0] + "@<variant>"
        if n not in shown:
            shown.append(n)
    return f"`dvc repro` (stage{'s' if len(shown) > 1 else ''} {', '.join(f'`{x}`' for x in shown)})"


def provenance(ctx: Context) -> str:
    """The block's last line: every source with its date, what made it, and how to regenerate the block."""
    measured = [u for u in ctx.used if u.kind == "measured"]
    others = [u for u in ctx.used if u.kind != "measured"]
    sentences = []
    for u in measured:
        d = u.data or {}
        how = f"`{d['command']}`" if d.get("command") else d.get("method") or f"`{d.get('benchmark', '?')}`"
        where = ", ".join(p for p in (machine_text(d.get("machine")),
                                      f"commit {d['commit']}" if d.get("commit") else "") if p)
        text = f"As measured on {d.get('date', 'an unknown date')} by {how}" + (f" ({where})" if where else "")
        if d.get("provenance"):
            text += f"; {d['provenance'].rstrip('.')}"
        sentences.append(text + f". From `{u.path}`")
    if others:
        parts = []
        for label, members in _grouped([u.path for u in others if u.kind == "file"]):
            days = sorted({file_date(ctx.root, m) for m in members})
            parts.append(f"`{label}` ({days[0] if len(days) == 1 else days[0] + ' to ' + days[-1]})")
        parts += [f"`{u.path}` as committed in {u.commit} ({commit_date(ctx.root, u.commit)})"
                  for u in others if u.kind == "git"]
        stages = list(dict.fromkeys(u.made_by[6:] for u in others if u.made_by.startswith("stage:")))
        made = sorted({u.made_by for u in others if u.made_by and not u.made_by.startswith("stage:")})
        if stages:
            made.insert(0, _stages(stages))
        sentences.append("From " + words(parts) + (f", written by {words(made)}" if made else ""))
    return "_" + ". ".join(sentences) + f"; regenerate with `{GENERATOR}`._"
