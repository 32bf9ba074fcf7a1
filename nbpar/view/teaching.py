"""Small experiments and figures the teaching notebooks use, kept out of the notebooks.

`plot_tp_split` draws how Megatron-LM (Shoeybi et al. 2019) cuts one transformer
block's weight matrices across tensor-parallel ranks; `plot_zero_table` draws the
ZeRO paper's memory staircase (Rajbhandari et al. 2020, Fig. 1). `SlowDataset`,
`write_packed` / `PackedDataset` and `loader_throughput` are the data-loader
experiment of the pitfalls notebook: a Dataset that decodes each sample slowly
(as JPEG decoding or Python-side tokenising does), the same samples packed into
one numpy memmap file, and samples/s through a DataLoader with given settings.
"""

from __future__ import annotations

import os
import time

import numpy as np

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


class SlowDataset:
    """``n`` samples of ``shape`` float32 made on demand, each after ``delay_s`` of sleep.

    Stands in for per-sample decoding (JPEG, tokenising) done in Python. Sample i is
    ``np.random.default_rng(i)`` noise, so every loader setting sees the same data.
    """

    def __init__(self, n: int = 256, shape=(3, 32, 32), delay_s: float = 0.002):
        positive_int("n", n)
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0 seconds, got {delay_s!r}")
        self.n, self.shape, self.delay_s = n, tuple(shape), delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        time.sleep(self.delay_s)  # the "decoding" cost
        x = np.random.default_rng(i).standard_normal(self.shape, dtype=np.float32)
        return x, i % 10


def write_packed(dataset, path: str) -> str:
    """Decode every sample of ``dataset`` once and store them as one .npy file at ``path``.

    The file is a plain (N, *shape) float32 array plus a labels file next to it, which
    `PackedDataset` maps into memory: reading a sample is a slice, no decoding.
    """
    if not str(path).endswith(".npy"):
        raise ValueError(f"path must end in .npy (numpy's format), got {path!r}")
    samples = [dataset[i] for i in range(len(dataset))]  # decode once
    xs = np.stack([np.asarray(x, dtype=np.float32) for x, _ in samples])  # (N, *shape)
    ys = np.asarray([int(y) for _, y in samples], dtype=np.int64)  # (N,)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.save(path, xs)
    np.save(_labels_path(path), ys)
    return path


def _labels_path(path: str) -> str:
    return f"{os.path.splitext(path)[0]}.labels.npy"


class PackedDataset:
    """Samples of a `write_packed` file, read through a read-only numpy memmap."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"packed file {path} does not exist; write it with write_packed(dataset, path)"
            )
        self.path = path
        self.x = np.load(path, mmap_mode="r")  # (N, *shape), not read yet
        self.y = np.load(_labels_path(path))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return np.array(self.x[i]), int(self.y[i])  # copy: a writable array for torch


def loader_throughput(
    dataset,
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    epochs: int = 2,
) -> float:
    """Samples per second through a DataLoader over ``epochs`` full passes.

    Worker start-up is part of the cost: with ``persistent_workers`` it is paid once
    instead of every epoch, which is why that flag matters for short epochs.
    """
    from torch.utils.data import DataLoader

    if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
        raise ValueError("persistent_workers and prefetch_factor need num_workers > 0")
    kwargs = (
        {}
        if num_workers == 0
        else {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor or 2}
    )
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)
    start, n = time.perf_counter(), 0
    for _ in range(epochs):
        for x, _y in loader:
            n += x.shape[0]
    elapsed = time.perf_counter() - start
    del loader  # stops persistent workers
    return n / elapsed
