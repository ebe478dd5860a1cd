"""The memory charts: every variant's memory over soak rounds and its peak against sequence length (memory-report)."""

from __future__ import annotations

from pathlib import Path


def plot_all(results: dict[str, dict], out_dir: Path) -> list[Path]:
    """Memory over soak rounds and peak against sequence length, every variant on one chart each."""
    import matplotlib.pyplot as plt

    from pipelines.core.plots import save

    ok = {n: r for n, r in results.items() if r.get("status") == "ok"}
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, r in ok.items():
        rounds = r["soak"]["rounds"]
        first = rounds[0][r["soak"]["signal"]] if rounds else 0
        line, = ax.plot([x["round"] for x in rounds], [(x[r["soak"]["signal"]] - first) / 1024 for x in rounds],
                        marker="o", markersize=3, label=f"{name}{' (LEAK)' if r['leak']['leak'] else ''}")
        warm = r["soak"].get("warmup_end_round")
        if warm:  # where growth fell to the noise floor and stayed there: what came before is warm-up
            ax.axvline(warm, color=line.get_color(), linestyle=":", linewidth=1)
    ax.text(0.01, 0.97, "dotted: end of warm-up (growth at or under the noise floor from there on)",
            transform=ax.transAxes, fontsize=7, va="top")
    ax.set_xlabel("measured soak round")
    ax.set_ylabel("growth since first round (KiB)")
    ax.set_title("Memory over repeated mixed traffic")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    rounds_png = save(fig, out_dir / "memory_over_rounds.png")

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, r in ok.items():
        pts = [(x["tokens"], x["decode_peak_increase"]) for x in r["sweep"]["lengths"] if x.get("decode_peak_increase") is not None]
        ax.plot([t for t, _ in pts], [b / 2**20 for _, b in pts], marker="o", label=name)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("decode peak above load (MiB)")
    ax.set_title("Peak memory against sequence length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [rounds_png, save(fig, out_dir / "peak_vs_length.png")]
