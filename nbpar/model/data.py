"""Offline data sets and the data-parallel loader.

* "cifar10": the CIFAR-10 python-pickle layout (Krizhevsky, 2009). Real files
  are read when ``data_dir`` holds them; otherwise a small, learnable synthetic
  set is written in exactly that format (class colour + stripe pattern + noise).
* "digits": scikit-learn's bundled 8x8 digits, upsampled to (3, 32, 32).
* "pysource": bytes of the Python standard library's own sources, cut into
  next-token windows for tiny_gpt.

`build_loader` shards with a DistributedSampler so that, per step, the union
of the dp ranks' micro-batches is one contiguous block of a single global
permutation: `single` with micro_batch B*dp sees the same samples.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
PYSOURCE_MAX_BYTES = 256 * 1024


class CIFAR10(Dataset):
    """CIFAR-10 from its python-pickle files: (3, 32, 32) normalised floats, int labels."""

    def __init__(self, root: str, train: bool = True):
        files = TRAIN_FILES if train else ("test_batch",)
        images, labels = [], []
        for name in files:
            data, lab = _read_batch(os.path.join(root, name))
            images.append(data)
            labels.extend(lab)
        x = torch.from_numpy(np.concatenate(images)).view(-1, 3, 32, 32).float() / 255.0
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        self.images = (x - mean) / std  # (N, 3, 32, 32)
        self.labels = [int(v) for v in labels]  # (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def _read_batch(path: str):
    """One CIFAR-10 batch file -> (uint8 (N, 3072) array, list of N labels)."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"CIFAR-10 file {path} is missing; point data_dir at the "
            f"extracted 'cifar-10-batches-py' folder or leave it empty "
            f"to generate a synthetic set"
        )
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data, labels = np.asarray(d[b"data"]), list(d[b"labels"])
    except Exception as e:  # truncated pickle, wrong keys, not a dict...
        raise ValueError(
            f"CIFAR-10 file {path} is corrupt or not in the CIFAR-10 "
            f"python format ({type(e).__name__}: {e})"
        ) from None
    if (
        data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
        or len(labels) != data.shape[0]
        or not all(0 <= v < 10 for v in labels)
    ):
        raise ValueError(
            f"CIFAR-10 file {path} is corrupt: expected uint8 data (N, 3072) and "
            f"N labels in 0..9, got {data.dtype} {data.shape} and "
            f"{len(labels)} labels"
        )
    return data, labels


def _atomic_pickle(obj, path: str) -> None:
    from nbpar.files import atomic_path

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _synthetic_images(n: int, rng: np.random.Generator):
    """n learnable 32x32 RGB images: class colour, class stripe direction/frequency, noise."""
    labels = rng.integers(0, 10, size=n)
    colours = (
        np.array(
            [[(c * 37) % 256, (c * 91 + 60) % 256, (c * 53 + 130) % 256] for c in range(10)],
            dtype=np.float32,
        )
        / 255.0
    )  # (10, 3)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)
    imgs = np.empty((n, 3, 32, 32), dtype=np.float32)
    for i, c in enumerate(labels):
        angle = np.pi * (c % 5) / 5 + rng.normal(0, 0.1)
        freq = 0.25 + 0.25 * (c // 5)
        phase = rng.uniform(0, 2 * np.pi)
        stripes = 0.5 + 0.5 * np.sin(freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase)
        imgs[i] = colours[c][:, None, None] * (0.5 + 0.5 * stripes)[None]
    imgs += rng.normal(0, 0.15, size=imgs.shape).astype(np.float32)
    data = (np.clip(imgs, 0, 1) * 255).round().astype(np.uint8).reshape(n, 3072)
    return data, [int(v) for v in labels]


def write_cifar10_format(root: str, n_per_batch: int = 200, seed: int = 0) -> str:
    """Write a synthetic set as data_batch_1..5, test_batch, batches.meta under ``root``.

    Each file is written to a temporary name and renamed, ``batches.meta`` last, so
    concurrent writers (all ranks) and readers never see a half-written set.
    """
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in TRAIN_FILES + ("test_batch",):
        data, labels = _synthetic_images(n_per_batch, rng)
        _atomic_pickle(
            {
                b"batch_label": name.encode(),
                b"data": data,
                b"labels": labels,
                b"filenames": [f"{name}_{i}.png".encode() for i in range(n_per_batch)],
            },
            os.path.join(root, name),
        )
    names = [
        b"airplane",
        b"automobile",
        b"bird",
        b"cat",
        b"deer",
        b"dog",
        b"frog",
        b"horse",
        b"ship",
        b"truck",
    ]
    _atomic_pickle(
        {b"label_names": names, b"num_cases_per_batch": n_per_batch, b"num_vis": 3072},
        os.path.join(root, "batches.meta"),
    )
    return root


def cifar10_root(data_dir: str | None, seed: int = 0, n_per_batch: int = 200) -> str:
    """A folder holding CIFAR-10 files: ``data_dir`` (generated there if empty) or a
    cache under the system temp dir keyed by seed and size; reused when complete."""
    root = data_dir or os.path.join(
        tempfile.gettempdir(), f"nbpar-cifar10-synthetic-s{seed}-n{n_per_batch}"
    )
    if not os.path.exists(os.path.join(root, "batches.meta")):
        write_cifar10_format(root, n_per_batch, seed)
    return root


def digits_dataset() -> TensorDataset:
    """scikit-learn's 1797 8x8 digits as (3, 32, 32) images in [-1, 1], int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    x = torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")  # (N, 1, 32, 32)
    x = (x.expand(-1, 3, -1, -1) - 0.5) / 0.5  # (N, 3, 32, 32)
    return TensorDataset(x.contiguous(), torch.tensor(d.target, dtype=torch.long))


@functools.lru_cache(maxsize=4)
def pysource_bytes(max_bytes: int = PYSOURCE_MAX_BYTES) -> bytes:
    """The first ``max_bytes`` of the stdlib's top-level .py files, in sorted order."""
    stdlib = os.path.dirname(os.__file__)
    out, total = [], 0
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(stdlib, name), "rb") as f:
            chunk = f.read(max_bytes - total)
        out.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return b"".join(out)


class ByteWindows(Dataset):
    """Non-overlapping windows of seq_len+1 bytes -> (x, y) = (w[:-1], w[1:]) int64."""

    def __init__(self, data: bytes, seq_len: int):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n = (len(t) - 1) // (seq_len + 1)
        if n < 1:
            raise ValueError(f"text of {len(t)} bytes is too short for seq_len={seq_len}")
        self.windows = t[: n * (seq_len + 1)].view(n, seq_len + 1)  # (n, s+1)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i):
        w = self.windows[i]
        return w[:-1], w[1:]


def build_dataset(cfg, train: bool = True) -> Dataset:
    """The training set named by ``cfg`` (its default for the model when unset), or the
    one a dataset factory returns (`nbpar.model.registry`)."""
    factory = dataset_factory(cfg)
    if factory is not None:
        return _call_dataset_factory(factory, cfg.dataset)
    name = cfg.dataset_name()
    if name == "cifar10":
        return CIFAR10(cifar10_root(cfg.data_dir, cfg.seed), train=train)
    if name == "digits":
        return digits_dataset()
    if name == "pysource":
        return ByteWindows(pysource_bytes(), cfg.gpt.seq_len)
    raise ValueError(f"dataset={name!r} is not supported; choose cifar10, digits or pysource")


def dataset_factory(cfg):
    """The callable that makes ``cfg``'s data set, or None for a built-in one."""
    from nbpar.model import registry

    spec = cfg.dataset
    if spec is None and registry.kind(cfg.model) == "registered":
        spec = registry.registered()[cfg.model].dataset
    if spec is None or (isinstance(spec, str) and not registry.is_factory_string(spec)):
        return None
    return registry.resolve_callable(spec, "dataset")


def _call_dataset_factory(factory, spec) -> Dataset:
    from nbpar.model.registry import display_name

    name = display_name(spec if spec is not None else factory)
    try:
        dataset = factory()
    except Exception as e:
        raise ValueError(f"dataset factory {name} raised {type(e).__name__}: {e}") from None
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(
            f"dataset factory {name} returned {type(dataset).__name__}, not a "
            f"map-style Dataset (__getitem__ and __len__)"
        )
    return dataset


def build_loader(
    cfg, dp_rank: int, dp_size: int, epoch: int = 0, dataset: Dataset | None = None
) -> DataLoader:
    """This dp rank's loader: shuffled per epoch, micro_batch samples per batch.

    Call ``loader.sampler.set_epoch(e)`` before each new epoch, or every epoch
    repeats the same order (the classic DistributedSampler pitfall).
    """
    dataset = dataset if dataset is not None else build_dataset(cfg)
    sampler = DistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    sampler.set_epoch(epoch)
    if len(sampler) < cfg.micro_batch:
        raise ValueError(
            f"micro_batch={cfg.micro_batch} is larger than this rank's share of "
            f"the data set ({len(sampler)} samples)"
        )
    return DataLoader(dataset, batch_size=cfg.micro_batch, sampler=sampler, drop_last=True)


def global_batch_line(micro: int, accum: int, dp: int) -> str:
    """'global batch = 8 x 32 x 8 = 2048 (micro x accum x dp)'."""
    return f"global batch = {micro} x {accum} x {dp} = {micro * accum * dp} (micro x accum x dp)"
