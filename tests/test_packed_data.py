"""One file per sample vs one HDF5 file vs RAM (nbpar.model.packed): the same samples
through real DataLoaders, with and without worker processes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from nbpar.model import packed
from nbpar.model.loader_experiment import SlowDataset


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 3, 4, 5), dtype=np.uint8)
    labels = rng.integers(0, 3, size=40)
    return images, labels


@pytest.fixture(scope="module")
def stores(samples, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    folder = packed.write_files(*samples, str(root / "files"))
    path = packed.write_hdf5(*samples, str(root / "data.h5"), chunk=8)
    return folder, path


def _all(loader):
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


def test_every_store_gives_back_the_written_samples(samples, stores):
    images, labels = samples
    folder, path = stores
    for ds in (
        packed.FileDataset(folder),
        packed.HDF5Dataset(path),
        packed.HDF5Dataset(path, in_memory=True),
    ):
        assert len(ds) == len(labels)
        for i in (0, 17, 39):
            x, y = ds[i]
            assert x.dtype == torch.float32
            torch.testing.assert_close(x, torch.from_numpy(images[i]).float())
            assert y == labels[i]


def test_batched_read_equals_reads_one_by_one(stores):
    for ds, indices in itertools.product(
        (packed.HDF5Dataset(stores[1]), packed.HDF5Dataset(stores[1], in_memory=True)),
        ([9, 3, 14, 4], [7, 5, 6, 4], [0, 39]),  # scattered, close, far apart
    ):
        x, y = ds[indices]
        assert x.shape == (len(indices), 3, 4, 5) and y.dtype == torch.int64
        for k, i in enumerate(indices):
            torch.testing.assert_close(x[k], ds[i][0])
            assert y[k] == ds[i][1]


# DataLoader workers are processes
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.spawn)])
def test_loaders_over_files_and_hdf5_agree(stores, samples, workers):
    folder, path = stores
    kw = {"batch_size": 8, "num_workers": workers}
    xf, yf = _all(DataLoader(packed.FileDataset(folder), **kw))
    xh, yh = _all(DataLoader(packed.HDF5Dataset(path), **kw))  # handle opened per worker
    torch.testing.assert_close(xf, xh)
    torch.testing.assert_close(yf, yh)
    torch.testing.assert_close(xf, torch.from_numpy(samples[0]).float())


@pytest.mark.spawn  # DataLoader workers
@pytest.mark.parametrize("in_memory", [False, True])
def test_block_sampler_reads_each_sample_once_in_contiguous_batches(stores, samples, in_memory):
    sampler = packed.BlockBatchSampler(len(samples[1]), batch_size=8, seed=0)
    ds = packed.HDF5Dataset(stores[1], in_memory=in_memory)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert all(b == list(range(b[0], b[0] + 8)) for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(40))
        orders.append([b[0] for b in batches])
        x, y = _all(DataLoader(ds, sampler=sampler, batch_size=None, num_workers=epoch * 2))
        starts = orders[-1]
        expect = np.concatenate([samples[0][s : s + 8] for s in starts])
        torch.testing.assert_close(x, torch.from_numpy(expect).float())
        assert y.tolist() == [int(samples[1][i]) for s in starts for i in range(s, s + 8)]
    assert orders[0] != orders[1]  # a new block order every epoch


def test_bad_arguments():
    with pytest.raises(ValueError, match="one label each"):
        packed.write_hdf5(np.zeros((3, 2)), [0, 1], "x.h5")
    with pytest.raises(FileNotFoundError, match="write_hdf5"):
        packed.HDF5Dataset("/nonexistent/x.h5")
    with pytest.raises(ValueError, match="batch_size"):
        packed.BlockBatchSampler(4, 8)
    with pytest.raises(ValueError, match="steps"):
        packed.time_input_pipeline(torch.nn.Linear(1, 1), [], steps=0)


def test_time_input_pipeline_counts_the_wait_for_data():
    # every sample sleeps 10 ms in __getitem__: 3 steps of 4 samples wait >= 0.12 s
    loader = DataLoader(SlowDataset(n=8, shape=(6,), delay_s=0.01), batch_size=4)
    model = torch.nn.Linear(6, 10)
    before = model.weight.detach().clone()
    split = packed.time_input_pipeline(model, loader, steps=3)
    assert split["data_s"] >= 3 * 4 * 0.01
    assert split["compute_s"] > 0
    assert split["wait_fraction"] == pytest.approx(
        split["data_s"] / (split["data_s"] + split["compute_s"])
    )
    assert not torch.equal(model.weight, before)  # it trained
