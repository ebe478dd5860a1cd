"""compare's charts: accuracy against memory per request type (the Pareto front), flips, KL percentiles.

Only the compare stage draws them; editing a colour here re-runs compare and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.paths import BASELINE
from pipelines.judging.verdict import usable

VERDICT_COLOURS = {"pass": "tab:green", "inconclusive": "tab:orange", "fail": "tab:red", "baseline": "tab:blue"}


def plot_all(report: dict, out_dir: Path) -> list[Path]:
    """Accuracy against memory per domain (Pareto front), flips per variant, KL percentiles."""
    import matplotlib.pyplot as plt

    from pipelines.core.plots import save

    domains = report["domains"]
    base = report["fp16"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        points = []
        if base.get("memory") and usable(base["accuracy"].get(domain)):
            points.append((BASELINE, base["memory"]["footprint_bytes"], base["accuracy"][domain], "baseline"))
        for name, v in report["variants"].items():
            d = v["domains"][domain]
            if v.get("memory") and d.get("paired") and usable(d["paired"]["accuracy"]):
                points.append((name, v["memory"]["footprint_bytes"], d["paired"]["accuracy"], d["verdict"]))
        front, best = [], -1.0
        for name, mem, acc, _ in sorted(points, key=lambda p: (p[1], -p[2])):
            if acc > best:
                front.append((mem, acc))
                best = acc
        if front:
            ax.step([m / 2**20 for m, _ in front], [a for _, a in front], where="post", color="grey", alpha=0.5)
        for name, mem, acc, verdict in points:
            ax.scatter(mem / 2**20, acc, color=VERDICT_COLOURS[verdict], zorder=3)
            ax.annotate(name, (mem / 2**20, acc), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(domain, fontsize=9)
        ax.set_xlabel("load footprint (MiB)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("probe accuracy")
    fig.suptitle("Accuracy against memory (green pass, orange inconclusive, red fail, blue fp16)", fontsize=9)
    paths = [save(fig, out_dir / "pareto.png")]

    names = list(report["variants"])
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(names) * len(domains) / 2, 3.6))
    labels, lost, gained = [], [], []
    for name in names:
        for domain in domains:
            paired = report["variants"][name]["domains"][domain].get("paired") or {}
            labels.append(f"{name}\n{domain}")
            lost.append(-(paired.get("correct_to_wrong") or 0))
            gained.append(paired.get("wrong_to_correct") or 0)
    xs = range(len(labels))
    ax.bar(xs, lost, color="tab:red", label="correct -> wrong")
    ax.bar(xs, gained, color="tab:green", label="wrong -> correct")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("items")
    ax.set_title("Flips against fp16 per variant and domain")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    paths.append(save(fig, out_dir / "flips.png"))

    percentiles = ["median", "p90", "p95", "p99", "p99_9", "max"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.4), squeeze=False, sharey=True)
    for ax, domain in zip(axes[0], domains):
        for name in names:
            kl = ((report["variants"][name]["domains"][domain].get("fidelity") or {}).get("kl") or {})
            values = [kl.get(p) for p in percentiles]
            if all(usable(x) and x > 0 for x in values):
                ax.plot(percentiles, values, marker="o", label=name)
        ax.set_yscale("log")
        ax.set_title(domain, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KL divergence vs fp16 (nats)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Token-level KL percentiles", fontsize=9)
    paths.append(save(fig, out_dir / "kl_percentiles.png"))
    return paths
