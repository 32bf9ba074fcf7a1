"""The data-loader experiment of the pitfalls notebook, kept out of the notebook.

`SlowDataset` decodes each sample slowly (as JPEG decoding or Python-side tokenising
does), `write_packed` / `PackedDataset` hold the same samples in one numpy memmap file,
and `loader_throughput` measures samples/s through a DataLoader with given settings.
"""

from __future__ import annotations

import os
import time

import numpy as np

from nbpar.checks import positive_int


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
