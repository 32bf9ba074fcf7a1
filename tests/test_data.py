"""Data sets in their real formats, and the DistributedSampler sharding contract."""

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from nbpar.config import TrainConfig
from nbpar.model.data import (
    CIFAR10,
    build_dataset,
    build_loader,
    cifar10_root,
    digits_dataset,
    pysource_bytes,
    write_cifar10_format,
)


def test_cifar10_reader_reads_written_format(tmp_path):
    root = write_cifar10_format(str(tmp_path), n_per_batch=20, seed=1)
    assert sorted(os.listdir(root)) == ["batches.meta"] + [
        f"data_batch_{i}" for i in range(1, 6)
    ] + ["test_batch"]
    with open(os.path.join(root, "data_batch_1"), "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert raw[b"data"].dtype == np.uint8 and raw[b"data"].shape == (20, 3072)
    train, test = CIFAR10(root, train=True), CIFAR10(root, train=False)
    assert len(train) == 100 and len(test) == 20
    x, y = train[7]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    assert y == raw[b"labels"][7]
    assert set(train.labels) <= set(range(10)) and len(set(train.labels)) > 5
    # pixel 0 of channel 0 round-trips through the normalisation
    torch.testing.assert_close(
        x[0, 0, 0] * 0.2470 + 0.4914,
        torch.tensor(raw[b"data"][7, 0] / 255.0, dtype=torch.float32),
        atol=1e-4,
        rtol=0,
    )


def test_synthetic_set_is_reused_and_deterministic(tmp_path):
    a = write_cifar10_format(str(tmp_path / "a"), n_per_batch=10, seed=3)
    b = write_cifar10_format(str(tmp_path / "b"), n_per_batch=10, seed=3)
    assert torch.equal(CIFAR10(a).images, CIFAR10(b).images)
    mtime = os.path.getmtime(os.path.join(a, "data_batch_1"))
    assert cifar10_root(a, seed=3, n_per_batch=10) == a
    assert os.path.getmtime(os.path.join(a, "data_batch_1")) == mtime  # not rewritten


def test_missing_and_corrupt_files_give_clear_errors(tmp_path):
    root = write_cifar10_format(str(tmp_path), n_per_batch=10, seed=0)
    path = os.path.join(root, "data_batch_3")
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="data_batch_3 is corrupt"):
        CIFAR10(root)
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(ValueError, match=r"expected uint8 data \(N, 3072\)"):
        CIFAR10(root)
    os.remove(path)
    with pytest.raises(FileNotFoundError, match="data_batch_3 is missing"):
        CIFAR10(root)


def test_digits_and_pysource():
    d = digits_dataset()
    x, y = d[5]
    assert len(d) == 1797 and x.shape == (3, 32, 32) and 0 <= int(y) <= 9
    assert x.min() >= -1 and x.max() <= 1
    cfg = TrainConfig(model="tiny_gpt")
    ds = build_dataset(cfg)
    x, y = ds[3]
    assert x.shape == (32,) and y.shape == (32,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one byte
    text = pysource_bytes()
    assert 100_000 < len(text) <= 256 * 1024 and b"import" in text
    assert bytes(ds[0][0].tolist()) == text[:32]


def _batches(cfg, dp_rank, dp_size, n, dataset, epoch=0):
    loader = build_loader(cfg, dp_rank, dp_size, epoch=epoch, dataset=dataset)
    return [xb for (xb,), _ in zip(loader, range(n))]


def test_dp_micro_batches_union_equals_single_batch():
    ds = TensorDataset(torch.arange(103))
    single = _batches(TrainConfig(micro_batch=8, seed=5), 0, 1, 10, ds)
    ranks = [_batches(TrainConfig(micro_batch=4, seed=5), r, 2, 10, ds) for r in range(2)]
    assert len(single) == len(ranks[0]) == 10
    for s in range(10):
        union = torch.cat([ranks[0][s], ranks[1][s]])
        assert torch.equal(union.sort().values, single[s].sort().values)
        assert len(set(ranks[0][s].tolist()) & set(ranks[1][s].tolist())) == 0


def test_union_property_on_real_data():
    cfg1, cfg2 = TrainConfig(micro_batch=8), TrainConfig(micro_batch=4)
    ds = build_dataset(cfg1)
    one = next(iter(build_loader(cfg1, 0, 1, dataset=ds)))[0]
    two = torch.cat([next(iter(build_loader(cfg2, r, 2, dataset=ds)))[0] for r in range(2)])
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(one) == key(two)


def test_set_epoch_reshuffles_and_forgetting_it_repeats():
    ds = TensorDataset(torch.arange(64))
    cfg = TrainConfig(micro_batch=8, seed=0)
    loader = build_loader(cfg, 0, 2, dataset=ds)
    first = torch.cat([b for (b,) in loader])
    again = torch.cat([b for (b,) in loader])  # no set_epoch: the classic pitfall
    assert torch.equal(first, again)
    loader.sampler.set_epoch(1)
    third = torch.cat([b for (b,) in loader])
    assert not torch.equal(first, third)
    assert torch.equal(third, torch.cat(_batches(cfg, 0, 2, 100, ds, epoch=1)))


def test_micro_batch_larger_than_shard_is_rejected():
    with pytest.raises(ValueError, match="micro_batch=64 is larger"):
        build_loader(TrainConfig(micro_batch=64), 0, 2, dataset=TensorDataset(torch.arange(50)))
