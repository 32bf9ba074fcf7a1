"""Static figures of finished runs: losses, memory (measured next to the estimate), step split.

Each function takes a Run, its history, or the CLI's result dict, draws on ``ax`` (or a new
`matplotlib.figure.Figure`, no pyplot state) and returns the Figure.
"""

from __future__ import annotations

from nbpar.measure.records import model_states
from nbpar.view.history import as_history, by_rank, memory_parts, run_label
from nbpar.view.panels import MEMORY_COLORS, SplitPanel, bytes_axis

_ESTIMATE_PARTS = {
    "params": "params",
    "grads": "grads",
    "optim": "optimizer",
    "activations": "activations",
}


def _axes(ax, figsize=(6, 4)):
    if ax is not None:
        return ax
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, layout="constrained").add_subplot()


def _is_history(obj) -> bool:
    return (
        isinstance(obj, list)
        and bool(obj)
        and all(isinstance(r, dict) and "step" in r for r in obj)
    )


def _items(obj) -> list:
    """One run-like object, or a list of them, as a list."""
    if _is_history(obj) or not isinstance(obj, (list, tuple)):
        return [obj]
    return list(obj)


def _loss_series(item, per_rank: bool):
    """[(suffix, steps, losses)] of a result dict or a history-bearing object."""
    if isinstance(item, dict) and "losses" in item:
        return [("", list(range(len(item["losses"]))), list(item["losses"]))]
    groups = by_rank(as_history(item))
    if not groups:
        return []
    chosen = groups.items() if per_rank else [list(groups.items())[-1]]
    return [
        (f" rank {r}" if per_rank else "", [x["step"] for x in recs], [x["loss"] for x in recs])
        for r, recs in chosen
    ]


def plot_losses(runs_or_histories, ax=None, *, per_rank: bool = False, labels=None):
    """Loss per step, one line per run (the last rank's losses), or
    one per (run, rank) with ``per_rank=True``. Labels default to "strategy/backend"."""
    items = _items(runs_or_histories)
    if labels is not None and len(labels) != len(items):
        raise ValueError(f"labels has {len(labels)} entries for {len(items)} runs")
    ax = _axes(ax)
    for i, item in enumerate(items):
        base = labels[i] if labels is not None else run_label(item)
        if base == "run" and len(items) > 1:
            base = f"run {i}"
        for suffix, steps, losses in _loss_series(item, per_rank):
            ax.plot(steps, losses, label=base + suffix, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss", fontsize="medium")
    ax.legend(fontsize="small")
    return ax.figure


def plot_loss_difference(losses, reference, labels=("run", "reference")):
    """Two loss curves that should agree (lists of floats, one per step): left, both
    (the reference as a wide grey line, the run as crosses on it, so neither hides the
    other); right, run minus reference per step. Returns the Figure."""
    from matplotlib.figure import Figure

    if len(losses) != len(reference):
        raise ValueError(
            f"the runs have {len(losses)} and {len(reference)} losses; "
            f"compare runs of the same length"
        )
    fig = Figure(figsize=(10, 3), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(reference, color="tab:gray", lw=3, label=labels[1])
    left.plot(losses, "x", color="tab:blue", label=labels[0])
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.legend(fontsize="small")
    right.plot([a - b for a, b in zip(losses, reference)], "o-", color="tab:blue", ms=3)
    right.axhline(0, color="k", lw=0.5)
    right.set_xlabel("step")
    right.set_ylabel(f"{labels[0]} minus {labels[1]}")
    right.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    return fig


def _measured(obj) -> tuple[list[int], list[dict], list[float | None]]:
    """(ranks, parts per rank, peak bytes per rank) from a result dict or a history."""
    if isinstance(obj, dict) and isinstance(obj.get("ranks"), list):
        rows = obj["ranks"]
        parts = [model_states(r) for r in rows]
        return [r["rank"] for r in rows], parts, [r.get("peak_bytes") for r in rows]
    groups = by_rank(as_history(obj))
    return (
        list(groups),
        [memory_parts(recs[-1]) for recs in groups.values()],
        [max(x.get("peak_bytes") or 0 for x in recs) or None for recs in groups.values()],
    )


def plot_memory(result_or_history, estimate=None, ax=None):
    """Measured per-rank bytes (stacked params/grads/optimizer[/other]; a black tick at the
    peak) next to a `nbpar.estimate.MemoryEstimate`'s device bytes per rank."""
    ranks, parts, peaks = _measured(result_or_history)
    ax = _axes(ax)
    colors = {**MEMORY_COLORS, "activations": "tab:cyan"}
    columns = list(parts)
    if estimate is not None:
        columns.append(
            {
                _ESTIMATE_PARTS[k]: v
                for k, v in estimate.per_rank_bytes.items()
                if k in _ESTIMATE_PARTS
            }
        )
    names = [p for p in colors if any(p in col for col in columns)]
    bottoms = [0.0] * len(columns)
    for name in names:
        xs = [i for i, col in enumerate(columns) if name in col]
        heights = [columns[i][name] for i in xs]
        ax.bar(xs, heights, bottom=[bottoms[i] for i in xs], color=colors[name], label=name)
        for i, h in zip(xs, heights):
            bottoms[i] += h
    if any(p is not None for p in peaks):
        xs = [i for i, p in enumerate(peaks) if p is not None]
        ax.scatter(xs, [peaks[i] for i in xs], marker="_", s=400, color="k", label="peak", zorder=3)
    ticks = [f"rank {r}" for r in ranks] + (["estimate"] if estimate is not None else [])
    ax.set_xticks(range(len(ticks)), ticks)
    bytes_axis(ax)
    ax.set_title(
        "memory per rank" + (f" vs estimate ({estimate.strategy})" if estimate is not None else ""),
        fontsize="medium",
    )
    ax.legend(fontsize="small")
    return ax.figure


def plot_step_split(run_or_history, ax=None):
    """Each rank's latest metered step split into exposed communication, waiting for a
    slower rank, communication hidden by compute and compute alone, as shares of that
    step (measured, never scaled: `nbpar.measure.step_split`), with the 20% exposed
    line; the step's seconds above each bar, and a black tick at the rank's blocked share
    of a normal step (measured on every step, `nbpar.measure.blocked`)."""
    groups = by_rank(as_history(run_or_history))
    panel = SplitPanel(_axes(ax), list(groups))
    panel.set(groups)
    return panel.ax.figure
