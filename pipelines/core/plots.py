"""Charts the stages write as PNG (for MLflow and people) beside the JSON data `dvc plots` reads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, path: Path) -> Path:
    """Save through a temp file and rename, like every other output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def grouped_bars(path: Path, labels: list[str], series: dict[str, list[float]], title: str, ylabel: str) -> Path:
    """One group of bars per label, one bar per series."""
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(labels), 3.6))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)
