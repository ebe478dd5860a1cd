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


LATENCY_PANELS = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"))
CLIENT_PANEL = ("client_ms", "request seen from the client (endpoints)")  # queue, network and generation together


def latency_chart(path: Path, timings: dict[str, dict[str, list[float]]]) -> Path:
    """Empirical CDFs of time to first token and time per output token, one line per model replayed here, and, when
    a model was replayed through its endpoint, a third panel of each request's latency seen from the client."""
    panels = LATENCY_PANELS + ((CLIENT_PANEL,) if any(t.get(CLIENT_PANEL[0]) for t in timings.values()) else ())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4))
    for ax, (key, title) in zip(axes, panels):
        for name, t in timings.items():
            values = sorted(t.get(key) or [])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
        ax.set_xlabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests / steps")
    for ax in axes:
        if ax.get_lines():  # the client panel holds other models than the first two
            ax.legend(fontsize=8)
    return save(fig, path)
