"""PNG plots for the serving benchmark (matplotlib, no display needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.benchmarks.serve import RequestResult, Summary


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str, title: str) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_distributions(runs: dict[str, list[RequestResult]], path: str, title: str = "") -> None:
    """Empirical CDFs of TTFT, TPOT and ITL, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, results in runs.items():
        ok = [r for r in results if r.error is None]
        series = {
            "TTFT (ms)": [r.ttft * 1000 for r in ok],
            "TPOT (ms)": [r.tpot * 1000 for r in ok if r.tpot is not None],
            "ITL (ms)": [x * 1000 for r in ok for x in r.itls],
        }
        for ax, (name, values) in zip(axes, series.items(), strict=True):
            if not values:
                continue
            v = sorted(values)
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of samples")
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=8)
    _save(plt, fig, path, title)


def plot_sweep(summaries: list[Summary], path: str, title: str = "") -> None:
    """Output throughput against mean TTFT and mean TPOT across request rates (one line per label)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = sorted({s.label for s in summaries})
    for label in labels:
        pts = [s for s in summaries if s.label == label]
        thr = [s.output_throughput for s in pts]
        axes[0].plot(thr, [s.latency_ms["ttft"]["mean"] for s in pts], "o-", label=label or "serve")
        axes[1].plot(thr, [s.latency_ms["tpot"]["mean"] for s in pts], "o-", label=label or "serve")
    for ax, name in zip(axes, ("mean TTFT (ms)", "mean TPOT (ms)"), strict=True):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    _save(plt, fig, path, title)
