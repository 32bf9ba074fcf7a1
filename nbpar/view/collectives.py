"""The collectives primer's pictures: each rank a row of boxes, each box a chunk of its
tensor, coloured by the ranks whose data it holds.

The primer runs every collective on tensors that say where their data came from: rank
r starts with chunks worth 2**r (or, for all-to-all, chunk c of rank r worth 2**r and
bound for rank c), so after a sum each value is the bit set of the ranks it adds up,
and after a gather each value names its source. `contributors` reads such a value
back; `plot_collectives` draws before and after side by side.
"""

from __future__ import annotations

from nbpar.view.teaching import _RANK_COLORS


def contributors(value: float) -> list[int]:
    """The ranks a bit-set value (a sum of 2**rank) adds up; [] for 0 (nothing yet)."""
    bits = int(round(value))
    return [r for r in range(bits.bit_length()) if bits >> r & 1]


def plot_collectives(results: dict, world: int):
    """``results``: {name: (before, after)}, each a list per rank of chunk values (bit
    sets). One row per collective: its ranks' chunks before and after. Returns the
    Figure."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    fig = Figure(figsize=(9, 1.25 * len(results) + 0.6), layout="constrained")
    axes = fig.subplots(len(results), 2, squeeze=False)
    for row, (name, (before, after)) in enumerate(results.items()):
        for col, (label, state) in enumerate((("before", before), ("after", after))):
            ax = axes[row][col]
            width = max(len(chunks) for chunks in state) or 1
            for r, chunks in enumerate(state):
                for c, value in enumerate(chunks):
                    who = contributors(value)
                    _box(ax, Rectangle, c, world - 1 - r, who, world)
            ax.set_xlim(-0.1, width + 0.1)
            ax.set_ylim(-0.15, world)
            ax.set_yticks([world - 1 - r + 0.42 for r in range(world)])
            ax.set_yticklabels([f"rank {r}" for r in range(world)], fontsize=7)
            ax.set_xticks([])
            for side in ("top", "right", "bottom", "left"):
                ax.spines[side].set_visible(False)
            ax.set_title(f"{name}: {label}", fontsize=8, loc="left")
    fig.legend(
        handles=[Patch(color=_RANK_COLORS[r], label=f"rank {r}'s data") for r in range(world)]
        + [Patch(facecolor="white", edgecolor="0.6", label="empty")],
        loc="outside lower center",
        ncol=world + 1,
        fontsize=7,
    )
    return fig


def _box(ax, Rectangle, x: float, y: float, who: list[int], world: int) -> None:
    """One chunk: a white box when empty, else striped in its contributors' colours,
    with 'Σ' when it is the sum of every rank."""
    if not who:
        ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.76, fc="white", ec="0.6"))
        return
    stripe = 0.92 / len(who)
    for i, r in enumerate(who):
        ax.add_patch(
            Rectangle((x + 0.04 + i * stripe, y + 0.04), stripe, 0.76, color=_RANK_COLORS[r])
        )
    if len(who) > 1:
        text = "Σ" if len(who) == world else "+".join(map(str, who))
        ax.text(x + 0.5, y + 0.42, text, ha="center", va="center", fontsize=7, color="white")
