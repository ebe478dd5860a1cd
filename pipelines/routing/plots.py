"""The fleet plan's chart: the fleet's memory saving against fp16 alone, by the number of deployments."""

from __future__ import annotations

from pathlib import Path

from pipelines.core.plots import plt, save


def fleet_plot(plan: dict, path: Path) -> Path:
    """The best plan at each deployment count as a line, and fp16 alone, row by row, the best single variant and
    the chosen plan as labelled points (pipelines/routing/fleet.py)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    curve = [(c["deployments"], c["saving_pct"]) for c in plan["by_deployments"] if c["saving_pct"] is not None]
    if curve:
        ax.plot(*zip(*curve), color="0.6", marker=".", label="best plan with N deployments")
    for alt, marker in zip(plan["alternatives"], ("s", "^", "D", "o")):
        if alt["saving_pct"] is not None:
            ax.scatter([alt["deployments"]], [alt["saving_pct"]], marker=marker, s=60, zorder=3,
                       label=f"{alt['plan']}: {' + '.join(alt['deployed'])}")
    ax.set_xlabel("deployments (fp16 included)")
    ax.set_ylabel("fleet memory saved against fp16 alone (%)")
    ax.set_title("Fleet plan: saving against deployments")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
