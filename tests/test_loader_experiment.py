"""The pitfalls notebook's data-loader experiment (nbpar.model.loader_experiment)."""

from __future__ import annotations

import numpy as np
import pytest

from nbpar.model import loader_experiment as lx


def test_slow_dataset_is_deterministic_and_validated():
    ds = lx.SlowDataset(n=4, shape=(2, 3), delay_s=0.0)
    x, y = ds[1]
    assert len(ds) == 4 and x.shape == (2, 3) and x.dtype == np.float32 and y == 1
    np.testing.assert_array_equal(x, lx.SlowDataset(n=4, shape=(2, 3), delay_s=0)[1][0])
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(ValueError):
        lx.SlowDataset(n=0)
    with pytest.raises(ValueError):
        lx.SlowDataset(n=2, delay_s=-1)


def test_packed_file_holds_the_same_samples(tmp_path):
    ds = lx.SlowDataset(n=6, shape=(3, 4), delay_s=0.0)
    path = lx.write_packed(ds, str(tmp_path / "packed.npy"))
    packed = lx.PackedDataset(path)
    assert len(packed) == 6
    for i in range(6):
        np.testing.assert_array_equal(packed[i][0], ds[i][0])
        assert packed[i][1] == ds[i][1]
    with pytest.raises(FileNotFoundError):
        lx.PackedDataset(str(tmp_path / "missing.npy"))
    with pytest.raises(ValueError):
        lx.write_packed(ds, str(tmp_path / "packed.bin"))


def test_loader_throughput_packed_beats_slow_decoding(tmp_path):
    slow = lx.SlowDataset(n=32, shape=(3, 8, 8), delay_s=0.005)  # >= 0.16 s per epoch
    packed = lx.PackedDataset(lx.write_packed(slow, str(tmp_path / "p.npy")))
    slow_rate = lx.loader_throughput(slow, batch_size=8, epochs=1)
    packed_rate = lx.loader_throughput(packed, batch_size=8, epochs=1)
    assert 0 < slow_rate < 32 / 0.16
    assert packed_rate > slow_rate


@pytest.mark.spawn  # DataLoader worker processes
def test_loader_throughput_with_persistent_workers(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    clock = iter([10.0, 12.0])  # the loop takes 2 s on this clock
    monkeypatch.setattr(
        lx, "time", SimpleNamespace(perf_counter=lambda: next(clock), sleep=time.sleep)
    )
    ds = lx.SlowDataset(n=8, shape=(2,), delay_s=0.0)
    rate = lx.loader_throughput(
        ds, batch_size=4, num_workers=1, persistent_workers=True, prefetch_factor=2, epochs=2
    )
    assert rate == 2 * 8 / 2.0  # both epochs, every sample, through the one worker
    with pytest.raises(ValueError):
        lx.loader_throughput(ds, persistent_workers=True)
