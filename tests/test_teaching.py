"""The notebooks' helper experiments and figures (nbpar.view.teaching)."""

from __future__ import annotations

import numpy as np
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


def test_slow_dataset_is_deterministic_and_validated():
    ds = teaching.SlowDataset(n=4, shape=(2, 3), delay_s=0.0)
    x, y = ds[1]
    assert len(ds) == 4 and x.shape == (2, 3) and x.dtype == np.float32 and y == 1
    np.testing.assert_array_equal(x, teaching.SlowDataset(n=4, shape=(2, 3), delay_s=0)[1][0])
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(ValueError):
        teaching.SlowDataset(n=0)
    with pytest.raises(ValueError):
        teaching.SlowDataset(n=2, delay_s=-1)


def test_packed_file_holds_the_same_samples(tmp_path):
    ds = teaching.SlowDataset(n=6, shape=(3, 4), delay_s=0.0)
    path = teaching.write_packed(ds, str(tmp_path / "packed.npy"))
    packed = teaching.PackedDataset(path)
    assert len(packed) == 6
    for i in range(6):
        np.testing.assert_array_equal(packed[i][0], ds[i][0])
        assert packed[i][1] == ds[i][1]
    with pytest.raises(FileNotFoundError):
        teaching.PackedDataset(str(tmp_path / "missing.npy"))
    with pytest.raises(ValueError):
        teaching.write_packed(ds, str(tmp_path / "packed.bin"))


def test_loader_throughput_packed_beats_slow_decoding(tmp_path):
    slow = teaching.SlowDataset(n=32, shape=(3, 8, 8), delay_s=0.005)  # >= 0.16 s per epoch
    packed = teaching.PackedDataset(teaching.write_packed(slow, str(tmp_path / "p.npy")))
    slow_rate = teaching.loader_throughput(slow, batch_size=8, epochs=1)
    packed_rate = teaching.loader_throughput(packed, batch_size=8, epochs=1)
    assert 0 < slow_rate < 32 / 0.16
    assert packed_rate > slow_rate


@pytest.mark.spawn  # DataLoader worker processes
def test_loader_throughput_with_persistent_workers(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    clock = iter([10.0, 12.0])  # the loop takes 2 s on this clock
    monkeypatch.setattr(
        teaching, "time", SimpleNamespace(perf_counter=lambda: next(clock), sleep=time.sleep)
    )
    ds = teaching.SlowDataset(n=8, shape=(2,), delay_s=0.0)
    rate = teaching.loader_throughput(
        ds, batch_size=4, num_workers=1, persistent_workers=True, prefetch_factor=2, epochs=2
    )
    assert rate == 2 * 8 / 2.0  # both epochs, every sample, through the one worker
    with pytest.raises(ValueError):
        teaching.loader_throughput(ds, persistent_workers=True)
