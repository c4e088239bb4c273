"""Plots of the experiments, one PNG each, in the style of the THC paper's figures."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from sim.experiments import Labelled

WINDOW = 5  # the paper plots accuracy with a sliding window of 5


def smooth(values: list[float], window: int = WINDOW) -> np.ndarray:
    """Trailing sliding-window mean (shorter at the start)."""
    v = np.asarray(values, dtype=float)
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_training(name: str, runs: list[Labelled], title: str, path: Path, note: str = "") -> Path:
    """Test accuracy of worker 0 vs update steps, one panel per group."""
    groups = list(dict.fromkeys(r.group for r in runs))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, group in zip(axes[0], groups, strict=True):
        for r in (r for r in runs if r.group == group):
            steps = [rec["step"] for rec in r.result.records]
            acc = smooth([rec["accuracy"] for rec in r.result.records])
            style = "--" if r.result.config.compression == "none" else "-"
            ax.plot(steps, acc, style, label=r.label, linewidth=1.6)
        ax.set_title(group)
        ax.set_xlabel("update steps")
        ax.set_ylabel(f"test accuracy (sliding window of {WINDOW})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_nmse(rows: list[dict], path: Path) -> Path:
    """NMSE vs granularity and vs workers, one line per bit budget (Appendix C.1, Figure 10)."""
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for ax, panel, xkey, xlabel in ((axes[0], "granularity", "granularity", "granularity g (10 workers, p = 1/1024)"),
                                    (axes[1], "workers", "workers", "workers n (g = 36/36/38, p = 1/32)")):
        for bits in (2, 3, 4):
            pts = [r for r in rows if r["panel"] == panel and r["bits"] == bits]
            ax.plot([r[xkey] for r in pts], [r["nmse"] for r in pts], "o-", label=f"{bits} bits")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("NMSE of one THC round")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle("THC NMSE on a LogNormal(0,1) gradient (THC paper, Appendix C.1)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_time(rows: list[dict], path: Path) -> Path:
    """The link-rate model's step time against the number of workers: flat, two tiers, a worker's link."""
    fig, ax = plt.subplots(figsize=(6.2, 4.2))
    n = [r["workers"] for r in rows]
    for key, label in (("flat_s", "flat: one software aggregator"),
                       ("two_tiers_s", "two tiers: software leaves (32 workers each) and spine"),
                       ("worker_link_s", "a worker's link (switches at line rate, either design)")):
        ax.plot(n, [r[key] for r in rows], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("seconds per allreduce (busiest NIC)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    r = rows[0]
    ax.set_title(f"Link-rate model: {r['coords']:,} coordinates, 4-bit THC, {r['rate_gbps']:g} Gbit/s NICs",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
