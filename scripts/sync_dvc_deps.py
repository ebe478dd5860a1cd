"""Write each dvc.yaml stage's `pipelines/` deps from the code (core/lineage.stage_code), keeping comments.

Run it after moving code between modules; tests/test_dvc_stages.py fails until dvc.yaml says what the code
imports. `--check` only reports (exit 1 when a stage's list differs).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.core.lineage import stage_code  # noqa: E402


def main(check: bool) -> int:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    yaml.indent(mapping=2, sequence=4, offset=2)
    path = ROOT / "dvc.yaml"
    doc = yaml.load(path.read_text(encoding="utf-8"))
    differ = []
    for name, stage in doc["stages"].items():
        body = stage.get("do", stage)
        verb = str(body["cmd"]).split()[1]
        deps = body.setdefault("deps", [])
        code = [str(d) for d in deps if str(d).startswith("pipelines/")]
        wanted = stage_code(verb)
        if code == wanted:
            continue
        differ.append(name)
        others = [(i, d) for i, d in enumerate(deps) if not str(d).startswith("pipelines/")]
        comments = {str(d): deps.ca.items.get(i) for i, d in others}
        data = [d for _, d in others]
        deps.clear()
        deps.ca.items.clear()
        for d in [*wanted, *data]:
            deps.append(d)
            if comments.get(str(d)):
                deps.ca.items[len(deps) - 1] = comments[str(d)]
    if check:
        print("\n".join(f"dvc.yaml stage {n}: pipelines/ deps differ from what its code imports" for n in differ))
        return 1 if differ else 0
    if differ:
        with path.open("w", encoding="utf-8") as out:
            yaml.dump(doc, out)
    print(f"dvc.yaml: {len(differ)} stages rewritten ({', '.join(differ) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))
