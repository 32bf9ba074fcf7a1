"""Static figure panels: loss, memory, step split and throughput (matplotlib).

Each panel owns its artists and `set(groups)` only changes their data; the dashboard's
exported figure (`Dashboard.figure`, `save`) and the static plots draw with them. The
live view draws in the browser instead (`nbpar.view.livechart`). ``groups`` is
`nbpar.view.history.by_rank(history)`.
"""

from __future__ import annotations

from nbpar.estimate import format_bytes
from nbpar.measure.records import held_bytes
from nbpar.measure.step_split import blocked_share
from nbpar.view.history import COMM_HEALTH, comm_split, memory_parts, throughput
from nbpar.view.live import global_loss

MEMORY_COLORS = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "other": "0.75",
}
SPLIT_COLORS = {
    "exposed": "tab:red",
    "wait": "tab:orange",
    "hidden": "#f4a6a6",
    "compute": "tab:gray",
}


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
    """The run's loss (averaged over ranks: one line) and, when the records carry
    ``local_loss``, each rank's loss on its data-parallel replica's micro-batches
    before averaging (ranks of one tp group or pipeline share one)."""

    def __init__(self, ax, ranks):
        self.ax = ax
        (self.line,) = ax.plot([], [], color="0.15", lw=2, label="loss (mean over ranks)")
        self.local = {
            r: ax.plot([], [], lw=1, ls="--", label=f"rank {r} replica batch")[0] for r in ranks
        }
        ax.set_title("loss", fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")

    def set(self, groups) -> None:
        steps = sorted({rec["step"] for recs in groups.values() for rec in recs})
        at = {s: [] for s in steps}
        for rank in sorted(groups):
            for rec in groups[rank]:
                at[rec["step"]].append(rec)
        points = [(s, global_loss(at[s])) for s in steps]
        points = [(s, v) for s, v in points if v is not None]
        self.line.set_data([p[0] for p in points], [p[1] for p in points])
        for rank, line in self.local.items():
            recs = [r for r in groups.get(rank, []) if r.get("local_loss") is not None]
            line.set_data([r["step"] for r in recs], [r["local_loss"] for r in recs])
        shown = [ln for ln in (self.line, *self.local.values()) if len(ln.get_xdata())]
        if len(shown) > 1:
            self.ax.legend(handles=shown, fontsize="small")
        _rescale(self.ax)


class MemoryPanel:
    """Latest memory per rank, two scales side by side in one cell: the model states
    (stacked params / grads / optimizer, often kB) and the process they live in (RSS,
    or allocated device memory on GPUs, often hundreds of MB), with its peak."""

    def __init__(self, ax, ranks):
        self.ax, self.ranks = ax, list(ranks)
        ax.set_axis_off()
        ax.set_title("memory per rank (latest step)", fontsize="medium")
        self.states_ax = ax.inset_axes([0.0, 0.0, 0.42, 0.88])
        self.process_ax = ax.inset_axes([0.58, 0.0, 0.42, 0.88])
        x = list(range(len(self.ranks)))
        ticks = [f"rank {r}" for r in self.ranks]
        self.bars = {
            part: self.states_ax.bar(x, [0] * len(x), color=color, label=part)
            for part, color in MEMORY_COLORS.items()
            if part != "other"
        }
        self.process = self.process_ax.bar(
            x, [0] * len(x), color=MEMORY_COLORS["other"], label="process"
        )
        self.peaks = self.process_ax.scatter(
            x, [0] * len(x), marker="_", s=300, color="k", label="peak", zorder=3
        )
        for sub, title in ((self.states_ax, "model states"), (self.process_ax, "process")):
            sub.set_xticks(x, ticks, fontsize="small")
            sub.set_title(title, fontsize="small")
            bytes_axis(sub)
            sub.tick_params(axis="y", labelsize="small")
        self.states_ax.legend(fontsize="x-small", loc="upper center", ncols=3)
        self.texts = [
            self.states_ax.text(i, 0, "", ha="center", va="bottom", fontsize="x-small") for i in x
        ]

    def set(self, groups) -> None:
        top = process_top = 0.0
        for i, rank in enumerate(self.ranks):
            recs = groups.get(rank)
            parts = memory_parts(recs[-1]) if recs else dict.fromkeys(MEMORY_COLORS, 0)
            bottom = 0.0
            for part, container in self.bars.items():
                patch = container.patches[i]
                patch.set_y(bottom)
                patch.set_height(parts[part])
                bottom += parts[part]
            self.texts[i].set_position((i, bottom))
            self.texts[i].set_text(format_bytes(bottom) if recs else "")
            top = max(top, bottom)
            held = (held_bytes(recs[-1]) or 0) if recs else 0
            peak = max([held] + [r.get("peak_bytes") or 0 for r in recs or []])
            self.process.patches[i].set_height(held)
            offsets = self.peaks.get_offsets()
            offsets[i] = (i, peak)
            self.peaks.set_offsets(offsets)
            process_top = max(process_top, held, peak)
        # from the data, not get_ylim(): set_ylim turns autoscaling off, so reading the
        # old limit back would only ever grow it and push the labels off the axes
        self.states_ax.set_ylim(0, max(top, 1.0) * 1.35)  # room for the legend
        self.process_ax.set_ylim(0, max(process_top, 1.0) * 1.1)


def set_blocked_ticks(line, shares: list[float | None]) -> None:
    """Put a tick at bar ``i`` at height ``shares[i]``; a None share draws none."""
    ticks = [(i, b) for i, b in enumerate(shares) if b is not None]
    line.set_data([i for i, _ in ticks], [b for _, b in ticks])


def blocked_ticks(ax, shares: list[float | None], label: str, size: float = 28):
    """A black tick on each bar at its blocked share of a normal step (every step,
    `nbpar.measure.blocked`); the dashboard's step panel and `compare` draw the same one."""
    (line,) = ax.plot([], [], ls="none", marker="_", ms=size, mew=2.5, color="k", label=label)
    set_blocked_ticks(line, shares)
    return line


class SplitPanel:
    """The metered step per rank split into exposed communication, waiting for a slower
    rank, communication hidden by compute, and compute alone, from the rank's latest
    metered step, with the 20% line.

    Exposed communication is the bottom segment, so a red bar above the dashed line means
    this rank spends more than 20% of its step in collectives that compute does not hide
    (the rule of thumb is about exposed time: overlapped communication costs nothing).
    Waiting for a slower rank inside a collective is drawn apart: it is imbalance between
    ranks, which more bandwidth would not fix.
    """

    def __init__(self, ax, ranks):
        self.ax, self.ranks = ax, list(ranks)
        x = range(len(self.ranks))
        labels = {
            "exposed": "communication, exposed",
            "wait": "waiting for a slower rank",
            "hidden": "communication hidden by compute",
            "compute": "compute only",
        }
        self.bars = {
            part: ax.bar(x, [0] * len(self.ranks), color=color, label=labels[part])
            for part, color in SPLIT_COLORS.items()
        }
        self.health = ax.axhline(
            COMM_HEALTH, ls="--", color="k", lw=1, label=f"{COMM_HEALTH:.0%} exposed"
        )
        # each rank's blocked share of a normal step (every step, `nbpar.measure.blocked`)
        self.blocked_line = blocked_ticks(ax, [], label="blocked, a normal step (every step)")
        self.texts = [ax.text(i, 1.01, "", ha="center", va="bottom", fontsize="small") for i in x]
        ax.set_xticks(list(x), [f"rank {r}" for r in self.ranks])
        ax.set_ylim(0, 1.75)  # room for the legend above the bars
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_ylabel("share of the metered step")
        ax.set_title("step time split (latest metered step)", fontsize="medium")
        ax.legend(fontsize="small", loc="upper center", ncols=2)

    def seconds(self, groups) -> dict[int, tuple[float, float, float, float]]:
        """rank -> (exposed_s, wait_s, hidden_s, step_s) as drawn."""
        return {r: comm_split(groups.get(r, [])) for r in self.ranks}

    def blocked(self, groups) -> dict[int, float | None]:
        """rank -> its blocked share of a normal step (the tick), None without the clock."""
        return {r: blocked_share(groups.get(r, [])) for r in self.ranks}

    def set(self, groups) -> None:
        set_blocked_ticks(self.blocked_line, list(self.blocked(groups).values()))
        for i, (*parts, step) in enumerate(self.seconds(groups).values()):
            shares = [p / step if step > 0 else 0.0 for p in parts]
            heights = {
                **dict(zip(("exposed", "wait", "hidden"), shares)),
                "compute": 1.0 - sum(shares) if step > 0 else 0.0,
            }
            bottom = 0.0
            for part, height in heights.items():
                self.bars[part].patches[i].set_y(bottom)
                self.bars[part].patches[i].set_height(height)
                bottom += height
            self.texts[i].set_text(f"{step:.3g} s" if step > 0 else "")


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
