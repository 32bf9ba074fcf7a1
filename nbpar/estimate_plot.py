"""Stacked-bar figure of a MemoryEstimate (one bar per rank's device memory, one for host).

Built on matplotlib.figure.Figure rather than pyplot, so it works under Agg and in notebooks
without touching the global figure manager.
"""

from __future__ import annotations

_PARTS = ("params", "grads", "optim", "activations")
_GB = 1e9


def plot_estimate(est, ax=None):
    """Draw `est` (a MemoryEstimate) on `ax` (or a new Figure) in GB; return the Figure."""
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(4.5, 4))
        ax = fig.add_subplot()
    nbytes = est.per_rank_bytes
    labels = ["device (each rank)"]
    bottom = 0.0
    for part in _PARTS:
        if part in nbytes:
            height = nbytes[part] / _GB
            ax.bar(0, height, bottom=bottom, label=part)
            bottom += height
    if "host" in nbytes:
        ax.bar(1, nbytes["host"] / _GB, label="host (offloaded)", color="0.6")
        labels.append("host (each rank)")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("GB (1e9 bytes)")
    ax.set_title(
        f"{est.strategy}: dp={est.dp} tp={est.tp} pp={est.pp}, {est.precision}", fontsize="medium"
    )
    ax.legend(fontsize="small")
    return ax.figure
