"""Figure panels that redraw in place: loss, memory, step split and throughput.

Each panel owns its artists (one line per rank, one bar segment per rank and
part) and `set(groups)` only changes their data, so a live dashboard costs a
few milliseconds per update plus one render; static plots use the same panels
once. ``groups`` is `nbpar.view.history.by_rank(history)`.
"""
from __future__ import annotations

from nbpar.estimate import format_bytes
from nbpar.view.history import COMM_HEALTH, memory_parts, step_split, throughput

MEMORY_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green",
                 "other": "0.75"}
SPLIT_COLORS = {"comm": "tab:red", "compute": "tab:gray"}


def figure_png(figure) -> bytes:
    """A matplotlib Figure as PNG bytes (every figure nbpar shows goes through here)."""
    import io

    buf = io.BytesIO()
    figure.savefig(buf, format="png")
    return buf.getvalue()


def bytes_axis(ax) -> None:
    """Label the y axis in B/kB/MB/GB while the data stays in bytes."""
    from matplotlib.ticker import EngFormatter

    ax.yaxis.set_major_formatter(EngFormatter(unit="B"))


def _rescale(ax) -> None:
    ax.relim()
    ax.autoscale_view()


class LossPanel:
    """Loss against step, one line per rank."""

    def __init__(self, ax, ranks):
        self.ax = ax
        self.lines = {r: ax.plot([], [], label=f"rank {r}", lw=1.2)[0] for r in ranks}
        ax.set_title("loss per rank", fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if len(self.lines) > 1:
            ax.legend(fontsize="small")

    def set(self, groups) -> None:
        for rank, line in self.lines.items():
            recs = [r for r in groups.get(rank, []) if r.get("loss") is not None]
            line.set_data([r["step"] for r in recs], [r["loss"] for r in recs])
        _rescale(self.ax)


class MemoryPanel:
    """Latest memory per rank: stacked params / grads / optimizer / other bytes."""

    def __init__(self, ax, ranks):
        self.ax, self.ranks = ax, list(ranks)
        x = range(len(self.ranks))
        self.bars = {part: ax.bar(x, [0] * len(self.ranks), color=color, label=part)
                     for part, color in MEMORY_COLORS.items()}
        self.texts = [ax.text(i, 0, "", ha="center", va="bottom", fontsize="small")
                      for i in x]
        ax.set_xticks(list(x), [f"rank {r}" for r in self.ranks])
        ax.set_title("memory per rank (latest step)", fontsize="medium")
        bytes_axis(ax)
        ax.legend(fontsize="small", loc="upper center", ncols=4)

    def set(self, groups) -> None:
        top = 0.0
        for i, rank in enumerate(self.ranks):
            recs = groups.get(rank)
            parts = memory_parts(recs[-1]) if recs else dict.fromkeys(MEMORY_COLORS, 0)
            bottom = 0.0
            for part, container in self.bars.items():
                patch = container.patches[i]
                patch.set_y(bottom)
                patch.set_height(parts[part])
                bottom += parts[part]
            states = parts["params"] + parts["grads"] + parts["optimizer"]
            self.texts[i].set_position((i, bottom))
            self.texts[i].set_text(f"states {format_bytes(states)}" if recs else "")
            top = max(top, bottom)
        # from the data, not get_ylim(): set_ylim turns autoscaling off, so reading the
        # old limit back would only ever grow it and push the labels off the axes
        self.ax.set_ylim(0, max(top, 1.0) * 1.3)  # room for the legend


class SplitPanel:
    """Compute vs communication share of the step per rank, with the 20% health line.

    Communication is the bottom segment, so a red bar above the dashed line means
    this rank spends more than 20% of its step in collectives.
    """

    def __init__(self, ax, ranks, window: int = 10):
        self.ax, self.ranks, self.window = ax, list(ranks), window
        x = range(len(self.ranks))
        self.comm = ax.bar(x, [0] * len(self.ranks), color=SPLIT_COLORS["comm"],
                           label="communication")
        self.compute = ax.bar(x, [0] * len(self.ranks), color=SPLIT_COLORS["compute"],
                              label="compute")
        self.health = ax.axhline(COMM_HEALTH, ls="--", color="k", lw=1,
                                 label=f"{COMM_HEALTH:.0%} comm")
        self.texts = [ax.text(i, 1.01, "", ha="center", va="bottom", fontsize="small")
                      for i in x]
        ax.set_xticks(list(x), [f"rank {r}" for r in self.ranks])
        ax.set_ylim(0, 1.3)
        ax.set_ylabel("share of step time")
        ax.set_title(f"step time split (mean of last {window} steps)", fontsize="medium")
        ax.legend(fontsize="small", loc="upper center", ncols=3)

    def seconds(self, groups) -> dict[int, tuple[float, float]]:
        """rank -> (compute_s, comm_s) as drawn."""
        return {r: step_split(groups.get(r, []), self.window) for r in self.ranks}

    def set(self, groups) -> None:
        for i, (compute, comm) in enumerate(self.seconds(groups).values()):
            total = compute + comm
            comm_share = comm / total if total > 0 else 0.0
            self.comm.patches[i].set_height(comm_share)
            self.compute.patches[i].set_y(comm_share)
            self.compute.patches[i].set_height(1.0 - comm_share if total > 0 else 0.0)
            self.texts[i].set_text(f"{total:.3g} s" if total > 0 else "")


class ThroughputPanel:
    """Samples (or tokens) per second per step, limited by the slowest rank."""

    def __init__(self, ax):
        self.ax = ax
        (self.line,) = ax.plot([], [], color="tab:purple", lw=1.2)
        ax.set_title("throughput", fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel("samples/s")

    def set(self, history) -> None:
        steps, values, unit = throughput(history)
        self.line.set_data(steps, values)
        self.ax.set_ylabel(unit)
        _rescale(self.ax)
