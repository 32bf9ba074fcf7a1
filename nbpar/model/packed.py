"""The same samples stored one file per sample, packed in one HDF5 file, or staged in RAM.

A data set of many small files costs a file-system round trip (open, read, close) per
sample; a packed format (HDF5, LMDB, a numpy memmap, WebDataset's tar shards) keeps the
samples in one file that a reader slices, and a contiguous run of samples is one read.
`write_files` / `FileDataset` are the one-file-per-sample layout (class sub-folders, as
torchvision's ImageFolder reads them); `write_hdf5` / `HDF5Dataset` the packed one, read
per sample, per contiguous batch (with `BlockBatchSampler`) or staged in RAM
(``in_memory=True``). `time_input_pipeline` splits training steps into the time spent
waiting for the next batch and the time spent computing: the "GPU utilisation under 30%"
symptom, measured.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from nbpar.checks import positive_int


def _check_samples(images: np.ndarray, labels) -> tuple[np.ndarray, np.ndarray]:
    images, labels = np.asarray(images), np.asarray(labels, dtype=np.int64)
    if images.ndim < 2 or len(images) != len(labels) or len(images) == 0:
        raise ValueError(
            f"images must be a non-empty (N, ...) array with one label each, got "
            f"{images.shape} images and {labels.shape} labels"
        )
    return images, labels


def write_files(images, labels, folder: str) -> str:
    """Store sample ``i`` as raw bytes in ``folder/<label>/<i>.bin`` (ImageFolder-style)
    and the sample shape and dtype in ``folder/meta.npy``. Returns ``folder``."""
    images, labels = _check_samples(images, labels)
    for label in np.unique(labels):
        os.makedirs(os.path.join(folder, str(label)), exist_ok=True)
    for i, (x, y) in enumerate(zip(images, labels)):
        with open(os.path.join(folder, str(y), f"{i:07d}.bin"), "wb") as f:
            f.write(np.ascontiguousarray(x).tobytes())
    np.save(os.path.join(folder, "meta.npy"), np.zeros(images.shape[1:], dtype=images.dtype))
    return folder


class FileDataset(Dataset):
    """The samples of a `write_files` folder: every access opens and reads one file.

    Sample order is the file number (the order they were written in); labels come
    from the sub-folder, as with ImageFolder. Returns (float32 tensor, int label).
    """

    def __init__(self, folder: str):
        meta = os.path.join(folder, "meta.npy")
        if not os.path.exists(meta):
            raise FileNotFoundError(f"{folder} has no meta.npy; write it with write_files")
        proto = np.load(meta)
        self.shape, self.dtype = proto.shape, proto.dtype
        entries = []
        for label in os.listdir(folder):
            sub = os.path.join(folder, label)
            if os.path.isdir(sub):
                entries += [(name, int(label)) for name in os.listdir(sub)]
        entries.sort()
        self.paths = [os.path.join(folder, str(y), name) for name, y in entries]
        self.labels = [y for _, y in entries]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as f:
            x = np.frombuffer(f.read(), dtype=self.dtype).reshape(self.shape)
        return torch.from_numpy(x.astype(np.float32)), self.labels[i]


def write_hdf5(images, labels, path: str, chunk: int = 64) -> str:
    """Store all samples in one HDF5 file: datasets "images" (N, ...) chunked ``chunk``
    samples at a time, and "labels" (N,). Returns ``path``."""
    import h5py

    images, labels = _check_samples(images, labels)
    positive_int("chunk", chunk)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=images, chunks=(min(chunk, len(images)), *images.shape[1:]))
        f.create_dataset("labels", data=labels)
    return path


class HDF5Dataset(Dataset):
    """The samples of a `write_hdf5` file.

    ``in_memory=False`` reads from the file on every access; the file is opened lazily
    in each process (an h5py handle must not cross a fork into DataLoader workers).
    ``in_memory=True`` stages the whole file in RAM once, here. ``ds[i]`` is one sample;
    ``ds[[i, j, ...]]`` a whole batch as two tensors, read in one slice when the indices
    lie close together (span at most twice the batch; from RAM: always one gather).
    Batches come that way from ``DataLoader(ds, sampler=BlockBatchSampler(...),
    batch_size=None)``: no per-sample calls and no per-sample collation.
    """

    def __init__(self, path: str, in_memory: bool = False):
        import h5py

        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} does not exist; write it with write_hdf5")
        self.path, self.in_memory = path, in_memory
        with h5py.File(path, "r") as f:
            self.labels = f["labels"][:]
            self._ram = f["images"][:] if in_memory else None
        self._images_ds, self._pid = None, None

    def __len__(self) -> int:
        return len(self.labels)

    def _images(self):
        if self._ram is not None:
            return self._ram
        if self._images_ds is None or self._pid != os.getpid():
            import h5py

            self._images_ds, self._pid = h5py.File(self.path, "r")["images"], os.getpid()
        return self._images_ds

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            x = np.asarray(self._images()[i], dtype=np.float32)
            return torch.from_numpy(x), int(self.labels[i])
        idx = np.asarray(i, dtype=np.int64)  # (B,)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        if self._ram is not None:
            x = self._ram[idx]
        elif hi - lo <= 2 * len(idx):  # close together: one read of the span
            x = self._images()[lo:hi][idx - lo]
        else:  # scattered: one read per sample
            images = self._images()
            x = np.stack([images[j] for j in idx.tolist()])
        x = torch.from_numpy(np.asarray(x, dtype=np.float32))  # (B, ...)
        return x, torch.from_numpy(self.labels[idx].astype(np.int64))

    def __getstate__(self):
        return {**self.__dict__, "_images_ds": None, "_pid": None}


class BlockBatchSampler(Sampler):
    """Batches of ``batch_size`` consecutive indices, in a new shuffled order each epoch.

    What fast readers of packed files do (WebDataset shuffles shards, FFCV reads
    "quasi-randomly"): each batch is one contiguous read. The samples of a block stay
    together across epochs, so write the file in shuffled order. The last, shorter
    block is dropped.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        if n < batch_size or batch_size < 1:
            raise ValueError(f"need 1 <= batch_size <= n, got batch_size={batch_size}, n={n}")
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        for b in torch.randperm(len(self), generator=g).tolist():
            yield list(range(b * self.batch_size, (b + 1) * self.batch_size))


def time_input_pipeline(model, loader, steps: int, lr: float = 0.01) -> dict:
    """Train ``model`` for ``steps`` SGD steps on ``loader``'s batches, timing apart the
    wait for each batch (``data_s``) and forward + backward + update (``compute_s``).

    ``wait_fraction`` = data_s / (data_s + compute_s): the share of the step the
    accelerator would sit idle. The loader is restarted when it runs out.
    """
    positive_int("steps", steps)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    it, data_s, compute_s = iter(loader), 0.0, 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        data_s, compute_s = data_s + t1 - t0, compute_s + time.perf_counter() - t1
    del it  # stops the workers of a non-persistent loader
    return {
        "data_s": data_s,
        "compute_s": compute_s,
        "wait_fraction": data_s / (data_s + compute_s),
        "steps": steps,
    }
