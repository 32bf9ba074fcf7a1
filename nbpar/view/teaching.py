"""Figures the teaching notebooks draw, kept out of the notebooks.

`plot_tp_split` draws how Megatron-LM (Shoeybi et al. 2019) cuts one transformer
block's weight matrices across tensor-parallel ranks; `plot_zero_table` draws the
ZeRO paper's memory staircase (Rajbhandari et al. 2020, Fig. 1). (The data-loader
experiment lives with the data: `nbpar.model.loader_experiment`.)
"""

from __future__ import annotations

from nbpar.checks import positive_int

#: (name, split, out rows, in cols) of one Block in units of (d, f) for plot_tp_split
_TP_MATRICES = (
    ("wq", "col", "d", "d"),
    ("wk", "col", "d", "d"),
    ("wv", "col", "d", "d"),
    ("wo", "row", "d", "d"),
    ("w1", "col", "f", "d"),
    ("w2", "row", "d", "f"),
)
_RANK_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
)


def plot_tp_split(d_model: int, ffn_dim: int, tp: int, ax=None):
    """Each weight of a Block as an (out, in) rectangle coloured by the rank that holds it.

    Column-parallel weights (wq, wk, wv, w1) are cut along their output rows;
    row-parallel ones (wo, w2) along their input columns. Returns the Figure.
    """
    for name, v in (("d_model", d_model), ("ffn_dim", ffn_dim), ("tp", tp)):
        positive_int(name, v)
    if tp > len(_RANK_COLORS) or d_model % tp or ffn_dim % tp:
        raise ValueError(
            f"tp={tp} must divide d_model={d_model} and ffn_dim={ffn_dim} "
            f"and be at most {len(_RANK_COLORS)}"
        )
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    if ax is None:
        ax = Figure(figsize=(9, 2.8), layout="constrained").add_subplot()
    size = {"d": d_model, "f": ffn_dim}
    x = 0.0
    for name, split, rows_key, cols_key in _TP_MATRICES:
        rows, cols = size[rows_key], size[cols_key]
        for r in range(tp):
            if split == "col":  # nn.Linear weight is (out, in): output rows are split
                box = (x, rows - (r + 1) * rows / tp, cols, rows / tp)
            else:  # row parallel: input columns are split
                box = (x + r * cols / tp, 0, cols / tp, rows)
            ax.add_patch(
                Rectangle(
                    box[:2],
                    box[2],
                    box[3],
                    facecolor=_RANK_COLORS[r],
                    edgecolor="black",
                    linewidth=0.6,
                    alpha=0.8,
                )
            )
        ax.text(
            x + cols / 2,
            rows + 0.04 * ffn_dim,
            f"{name}\n{split}wise\n({rows}, {cols})",
            ha="center",
            va="bottom",
            fontsize=8,
        )
        x += cols + 0.15 * d_model
    ax.set_xlim(-0.05 * d_model, x)
    ax.set_ylim(0, 1.45 * ffn_dim)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(
        handles=[Patch(color=_RANK_COLORS[r], label=f"rank {r}") for r in range(tp)],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    ax.set_title(
        f"one transformer block split over tp={tp} ranks (weights are (out, in))", fontsize="medium"
    )
    return ax.figure


_STATE_COLORS = (
    ("params_gb", "params", "tab:blue"),
    ("grads_gb", "grads", "tab:orange"),
    ("optim_gb", "optimizer", "tab:green"),
)


def plot_zero_table(rows: list[dict], ax=None, title: str | None = None):
    """Stacked GB per device of `nbpar.estimate.zero_table` rows (ZeRO paper, Fig. 1).

    One bar per stage (baseline, P_os, P_os+g, P_os+g+p), params/grads/optimizer
    stacked, the total written above. Returns the Figure.
    """
    if not rows or not all(isinstance(r, dict) and "name" in r and "total_gb" in r for r in rows):
        raise ValueError(
            "rows must be the non-empty list returned by nbpar.estimate.zero_table(params, dp)"
        )
    from matplotlib.figure import Figure

    if ax is None:
        ax = Figure(figsize=(6, 3.5), layout="constrained").add_subplot()
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label, color in _STATE_COLORS:
        heights = [r[key] for r in rows]
        ax.bar(x, heights, bottom=bottom, color=color, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, r in enumerate(rows):
        ax.text(i, r["total_gb"], f"{r['total_gb']:.1f} GB", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["name"] for r in rows])
    ax.set_ylabel("GB per device")
    ax.set_ylim(0, max(r["total_gb"] for r in rows) * 1.15)
    ax.legend(fontsize="small")
    ax.set_title(title or "model states per device by ZeRO stage", fontsize="medium")
    return ax.figure
