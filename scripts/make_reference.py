"""Train the embedded reference model from params.yaml's `reference:` recipe and ship it in reference_model/.

    .venv/bin/python scripts/make_reference.py

`quantgate reference` copies reference_model/ when params.yaml asks for exactly the recipe recorded in
reference_model/recipe.json (settings and training-text sha256), and trains anew otherwise. Run this
after changing the default recipe or the training text, then commit reference_model/.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines import reference  # noqa: E402
from pipelines.core import logs  # noqa: E402
from pipelines.core.params import load_params  # noqa: E402

if __name__ == "__main__":
    import os

    os.chdir(ROOT)
    logs.setup()
    report = reference.ship(load_params().reference)
    print(f"reference_model/: {report['parameters']:,} parameters, final loss {report['final_loss']}, "
          f"trained in {report['train_seconds']} s")
