"""PNG plots of a benchmark run (matplotlib, no screen needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")             # files only: these machines have no display
import matplotlib.pyplot as plt  # noqa: E402


LADDER_SIZE, DPI = (9, 4), 110      # inches, dots per inch: the PNG is 990 x 440 pixels


def ladder_plot(rows: list[dict], title: str, path: Path) -> Path:
    """Output tok/s per rung, a bar each; prefix runs hatched. Writes `path` (PNG)."""
    fig = ladder_figure(rows, title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def ladder_figure(rows: list[dict], title: str):
    fig, ax = plt.subplots(figsize=LADDER_SIZE)
    names = [r["name"] for r in rows]
    bars = ax.bar(names, [r["output_tps"] for r in rows], color="#4c72b0")
    for bar, r in zip(bars, rows):
        if r["requests"] < r["of"]:
            bar.set_hatch("//")
        ax.annotate(f"{r['output_tps']:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title + "  (hatched: ran a prefix of the workload)", fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def latency_plot(series: dict[str, list[dict]], path: Path) -> Path:
    """Median and p99 of TTFT, TPOT, E2EL against the request rate, and throughput; one colour
    per server (series: name -> its sweep), so two servers measured in one run share the axes."""
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    for colour, (name, sweep) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], series.items()):
        sweep = sorted(sweep, key=lambda s: s["rate"])          # load grows left to right
        labels = ["all at once" if s["rate"] == float("inf") else f"{s['rate']:g}" for s in sweep]
        for ax, metric in zip(axes, ["ttft", "tpot", "e2el"]):
            for stat, style in (("median", "o-"), ("p99", "s--")):
                ax.plot(labels, [s["result"][metric][stat] for s in sweep], style, color=colour,
                        label=f"{name} {stat}")
        axes[3].plot(labels, [s["result"]["output_throughput"] for s in sweep], "o-", color=colour, label=name)
    for ax, title in zip(axes, ["TTFT (ms)", "TPOT (ms)", "E2EL (ms)", "output tok/s"]):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def distribution_plot(ttft_ms: list[float], itl_ms: list[float], title: str, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, values, name in ((axes[0], ttft_ms, "TTFT"), (axes[1], itl_ms, "ITL")):
        ax.hist(values, bins=40, color="#55a868")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
