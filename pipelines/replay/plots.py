"""The shadow replay's two charts: exact agreement by request type and model, and latency CDFs per model."""

from __future__ import annotations

from pathlib import Path

from pipelines.core.plots import grouped_bars, plt, save


def agreement_chart(path: Path, report: dict) -> Path:
    """Exact agreement with fp16 over each type's replayed requests ("all"), one bar per model."""
    models = {n: m["agreement"] for n, m in report["models"].items() if m.get("agreement")}
    types = sorted({t for a in models.values() for t in a})
    series = {n: [a.get(t, {}).get("all", {}).get("exact", {}).get("share", 0.0) for t in types]
              for n, a in models.items()}
    return grouped_bars(path, types or ["(none)"], series or {"(no variant)": [0.0]},
                        "Shadow replay: exact agreement with fp16", "share of answers equal to fp16's")


def latency_chart(path: Path, timings: dict[str, dict[str, list[float]]]) -> Path:
    """Empirical CDFs of time to first token and time per output token, one line per model."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "tpot_ms", "time per output token")):
        for name, t in timings.items():
            values = sorted(t.get(key) or [])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
        ax.set_xlabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests / steps")
    axes[1].legend(fontsize=8)
    return save(fig, path)
