"""The notebooks' figures (nbpar.view.teaching)."""

from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from nbpar.estimate import zero_table
from nbpar.view import teaching


def _rects(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_tp_split_draws_one_box_per_matrix_and_rank():
    fig = teaching.plot_tp_split(d_model=32, ffn_dim=128, tp=2)
    boxes = _rects(fig)
    assert len(boxes) == 6 * 2
    # w1 (128, 32) column-parallel: two (out/2)-row slices of full width 32
    tall = [b for b in boxes if b.get_height() == 64]
    assert len(tall) == 2 and all(b.get_width() == 32 for b in tall)
    # w2 (32, 128) row-parallel: two slices of 64 input columns
    wide = [b for b in boxes if b.get_width() == 64]
    assert len(wide) == 2 and all(b.get_height() == 32 for b in wide)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(d_model=32, ffn_dim=128, tp=3),
        dict(d_model=32, ffn_dim=128, tp=0),
        dict(d_model=32, ffn_dim=100, tp=8),
    ],
)
def test_tp_split_rejects_degrees_that_do_not_divide(kwargs):
    with pytest.raises(ValueError):
        teaching.plot_tp_split(**kwargs)


def test_zero_table_figure_stacks_the_papers_numbers():
    rows = zero_table(7.5e9, dp=64)
    fig = teaching.plot_zero_table(rows)
    bars = _rects(fig)
    assert len(bars) == 3 * len(rows)  # params, grads, optimizer per stage
    tops = {}
    for b in bars:
        x = round(b.get_x() + b.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), b.get_y() + b.get_height())
    assert [round(tops[i], 2) for i in range(4)] == [120.0, 31.41, 16.64, 1.88]
    with pytest.raises(ValueError):
        teaching.plot_zero_table([])
