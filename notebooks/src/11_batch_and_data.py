# ---
# jupyter:
#   jupytext:
#     formats: ipynb,src//py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Large global batches and feeding them
#
# **Time:** about 35 minutes, 10 of them exercises ([the workshop day](../docs/workshop.md)).
#
# **Goal.** Two things every data-parallel run meets once it grows:
#
# 1. **The learning rate of a large global batch.** More ranks (or more accumulation)
#    make the global batch K times larger and give K times fewer optimizer steps per
#    epoch. The *linear scaling rule* and *gradual warm-up* of Goyal et al. (2017)
#    say how to set the learning rate then, and where that heuristic stops working.
# 2. **Keeping the model fed.** The same samples read one file per sample, from one
#    packed HDF5 file, or staged in RAM, and the "GPU utilisation under 30%" symptom:
#    steps that spend most of their time waiting for data, measured, and fixed.

# %%
# %matplotlib inline
import nbpar
import nbpar.model.data
import nbpar.model.packed
from matplotlib.figure import Figure

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## 1 · The linear scaling rule and warm-up
#
# Goyal et al., *Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour* (2017):
# **when the minibatch is multiplied by K, multiply the learning rate by K.** One SGD
# step on K·B samples with rate K·η then moves the weights about as far as K steps on
# B samples with rate η, as long as the gradient changes little over those K small
# steps. Early in training it changes fast, so they also **warm up**: start near η
# and raise the rate linearly to K·η over the first epochs (5 of 90 for ResNet-50).
#
# The experiment, with SGD and momentum 0.9 as in the paper: `simple_cnn` on the
# synthetic CIFAR-10-format set, fp32, seed 0, 2 DDP ranks, 2,560 samples in every run.
# The small global batch is 4 x 1 x 2 = 8 with η = 0.01; the large one accumulates
# K = 8 micro-batches per step (global batch 64, eight times fewer steps), with (a) the
# same η, (b) 8η from the first step, (c) 8η reached by a linear warm-up over the first
# quarter of the run (DeepSpeed's `WarmupLR` format, run alike on every backend); and,
# going further, K = 16 (global batch 128) with 16η and the same warm-up.

# %%
SAMPLES, BASE_LR = 2560, 0.01
common = dict(model="simple_cnn", strategy="ddp", optimizer="sgd", micro_batch=4,
              optimizer_params={"momentum": 0.9}, seed=0)


def warmup(k, steps):
    """Goyal et al.'s gradual warm-up: linear from BASE_LR to k * BASE_LR over a quarter of the run."""
    return {"type": "WarmupLR", "params": {"warmup_min_lr": BASE_LR, "warmup_max_lr": k * BASE_LR,
                                          "warmup_num_steps": steps // 4, "warmup_type": "linear"}}


def config(k, lr, schedule=False):
    steps = SAMPLES // (4 * k * pool.n)
    return nbpar.TrainConfig(grad_accum=k, steps=steps, lr=lr,
                             lr_schedule=warmup(k, steps) if schedule else None, **common)


configs = {"batch 8, lr 0.01": config(1, BASE_LR),
           "batch 64, same lr 0.01": config(8, BASE_LR),
           "batch 64, lr 0.08": config(8, 8 * BASE_LR),
           "batch 64, lr 0.08 + warm-up": config(8, 8 * BASE_LR, schedule=True),
           "batch 128, lr 0.16 + warm-up": config(16, 16 * BASE_LR, schedule=True)}
for name, cfg in configs.items():
    print(f"{name:29s} {nbpar.model.data.global_batch_line(cfg.micro_batch, cfg.grad_accum, pool.n)}, "
          f"{cfg.steps} steps")
losses = {name: pool.train(cfg).result()["losses"] for name, cfg in configs.items()}

# %% [markdown]
# The warm-up as the update rule really applies it: the learning rate read back from
# the optimizer after each step of the schedule (`nbpar.model.lr_schedule`, the same
# code the engines ran), and the loss of every run against the samples it has seen:

# %%
from nbpar.parallel import build_runner
from nbpar.model.models import build_model


def lr_per_step(cfg):
    """The lr the runner's update rule sets on the optimizer at each of cfg's steps."""
    single = nbpar.TrainConfig.from_dict({**cfg.to_dict(), "strategy": "single"})
    runner = build_runner(build_model(single), single, None)
    runner.set_update_rule(single)
    out = []
    for _ in range(single.steps):
        runner.optimizer_step()  # no gradients: SGD leaves the weights alone
        out.append(runner.optimizer.param_groups[0]["lr"])
    return out


def tail_mean(values):
    """mean loss over the last quarter of the samples"""
    return sum(values[-len(values) // 4:]) / (len(values) // 4)


# NBVAL_IGNORE_OUTPUT
# (some means sit within 0.1% of a rounding step; the next cell asserts)
fig = Figure(figsize=(11, 3.6), layout="constrained")
left, right = fig.subplots(1, 2, width_ratios=(1, 2))
for name in ("batch 64, lr 0.08 + warm-up", "batch 128, lr 0.16 + warm-up"):
    lrs = lr_per_step(configs[name])
    left.plot(range(1, len(lrs) + 1), lrs, marker=".", label=name.split(",")[0])
left.set_xlabel("optimizer step")
left.set_ylabel("learning rate")
left.set_title("linear warm-up (WarmupLR)", fontsize="medium")
left.legend(fontsize="small")
styles = ["-", "-", "--", "-", ":"]
for (name, values), style in zip(losses.items(), styles):
    batch = configs[name].global_batch(pool.n)
    window = max(1, 64 // batch)  # the batch-8 curve as a running mean over 64 samples
    smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
              for i in range(len(values))]
    right.plot([(i + 1) * batch for i in range(len(values))], smooth, style, label=name)
right.set_xlabel("samples seen")
right.set_ylabel("training loss")
right.set_yscale("log")
right.set_title("same samples, different global batch (batch 8: running mean over 64 samples)",
                fontsize="medium")
right.legend(fontsize="small")
for name, values in losses.items():
    print(f"{name:29s} mean loss over the last {SAMPLES // 4} samples: {tail_mean(values):.2f}")
fig

# %%
tail = {name: tail_mean(values) for name, values in losses.items()}
small, same = tail["batch 8, lr 0.01"], tail["batch 64, same lr 0.01"]
scaled, warm = tail["batch 64, lr 0.08"], tail["batch 64, lr 0.08 + warm-up"]
k16 = tail["batch 128, lr 0.16 + warm-up"]
assert same > 5 * small and scaled < same / 3 and warm < same / 3
assert same - scaled > 0.75 * (same - small) and same - warm > 0.75 * (same - small)
assert k16 - small > 1.5 * (warm - small) > 0
first = losses["batch 64, lr 0.08"][0]
assert max(losses["batch 64, lr 0.08"][1:]) < first

# %%
# NBVAL_IGNORE_OUTPUT
# (ratios near a rounding step; the cell above asserts the claims)
print(f"same lr, 8x the batch: the loss after {SAMPLES} samples is "
      f"{same / small:.0f}x the small batch's (8x fewer steps of the same size)")
print(f"8x the lr: the loss ends {same / scaled:.0f}x lower than with the same lr "
      f"(with warm-up: {same / warm:.0f}x lower), over three quarters of the way to the small batch")
print("without warm-up the loss never rose above its first value: this small model "
      "is stable at 8x the lr from the first step")
print(f"16x the batch with 16x the lr and warm-up ends {(k16 - small) / (warm - small):.0f}x as "
      f"far above the small batch as 8x did, in its 20 steps (5 of them warm-up)")

# %% [markdown]
# What the outputs show:
#
# - **Same learning rate, larger batch**: the run takes 8 times fewer steps of the same
#   size, so after the same samples it is far behind. Part of what is reported as
#   "large batches generalise worse" is this: too few updates (Hoffer et al. 2017,
#   *Train longer, generalize better*); here it already shows in the training loss.
# - **Learning rate x K** recovers most of the gap, as the rule predicts, but not all of
#   it: one step of 64 samples is not the same as eight steps of 8.
# - **Warm-up** costs a little at this scale (its first steps are smaller) because this
#   shallow model is already stable at 8η on the first step. Its purpose is the deep
#   network at the very start of training, whose gradients change fast: without it,
#   Goyal et al.'s ResNet-50 at batch 8k trained worse; with it, it matched batch 256.
# - **At larger K, here, further off**: the K = 16 run ends further from the small
#   batch than K = 8; but it has only 20 steps, the first 5 of them warm-up, so this is
#   a hint, not a measurement of where the rule stops. On ImageNet the rule held up to 8k images per batch, and accuracy
#   fell beyond. Even larger batches need a per-layer learning rate: **LARS** (You,
#   Gitman and Ginsburg 2017, *Large Batch Training of Convolutional Networks*) for SGD,
#   **LAMB** (You et al. 2020, *Large Batch Optimization for Deep Learning: Training
#   BERT in 76 minutes*) for Adam. For Adam itself a square-root rule (lr x √K) is the
#   usual starting point (Malladi et al. 2022). The "global batch ≥ 2048" some tutorials
#   give as a target is no rule: the batch that trains well depends on the model and
#   the data (McCandlish et al. 2018, *An Empirical Model of Large-Batch Training*).

# %% [markdown]
# ## Exercise: gradient accumulation with `no_sync`
#
# Run forward and backward on each micro-batch so that the gradients equal one step on
# all of them at once (each loss divided by their number), with DDP's all-reduce only
# after the last: `model.no_sync()` around the others. `make student` removes the part
# between `BEGIN SOLUTION` and `END SOLUTION`.

# %%
# %load_ext nbpar

# %% tags=["solution"]
# %%dist
import contextlib
import torch, nbpar.exercises


def accumulate(model, micro_batches):
    # BEGIN SOLUTION
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (torch.nn.functional.mse_loss(model(x), y) / k).backward()
    # END SOLUTION


assert nbpar.exercises.check("accumulate", accumulate)

# %%
pool.shutdown()

# %% [markdown]
# ## 2 · Feeding the model: one file per sample, a packed HDF5 file, RAM
#
# Many data sets arrive as one file per sample (a folder of JPEGs per class). Each
# sample then costs an open, a read and a close; on a network file system each open is
# also a metadata round trip. **Packed formats** store all samples in one file that a
# reader slices: **HDF5** (via `h5py`), **LMDB** (a memory-mapped key-value store),
# WebDataset's tar shards, a plain numpy memory map. And a data set that fits in RAM can
# be **staged** there once (or on a node-local SSD, when the shared file system is slow).
#
# The notebook writes the same 2,048 images (3x32x32 bytes, 6 MB) both ways into a
# temporary folder and reads them through a `DataLoader` (batch 64, 2 epochs):
# one file per sample; the HDF5 file sample by sample; the HDF5 file in contiguous
# batches (one read per batch, batches in shuffled order: what fast readers of packed
# formats do); and the HDF5 file staged in RAM.

# %%
import os
import tempfile

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

torch.set_num_threads(1)  # one core for the training process, as each rank of a 2-rank run here

rng = np.random.default_rng(0)
images = rng.integers(0, 256, size=(2048, 3, 32, 32), dtype=np.uint8)
labels = rng.integers(0, 10, size=2048)
workdir = tempfile.mkdtemp()
folder = nbpar.model.packed.write_files(images, labels, os.path.join(workdir, "files"))
h5_path = nbpar.model.packed.write_hdf5(images, labels, os.path.join(workdir, "data.h5"))
n_files = sum(len(files) for _, _, files in os.walk(folder))
print(f"{n_files} files ({n_files - 1} samples + meta), one HDF5 file of "
      f"{os.path.getsize(h5_path) / 2**20:.0f} MiB")
per_file = nbpar.model.packed.FileDataset(folder)
hdf5 = nbpar.model.packed.HDF5Dataset(h5_path)
in_ram = nbpar.model.packed.HDF5Dataset(h5_path, in_memory=True)
assert all(bool((per_file[i][0] == hdf5[i][0]).all()) and per_file[i][1] == hdf5[i][1] == in_ram[i][1]
           for i in (0, 1000, 2047))
print("the same samples in every store")

# %%
# NBVAL_IGNORE_OUTPUT
import time


def throughput(loader, epochs=2):
    """samples per second through ``loader``"""
    start, n = time.perf_counter(), 0
    for epoch in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        n += sum(len(y) for _, y in loader)
    return n / (time.perf_counter() - start)


def batches_of(dataset, batch_size):
    """a loader that hands the dataset whole batches of indices (no per-sample calls)"""
    if dataset.in_memory:  # any order: one gather from RAM
        sampler = BatchSampler(RandomSampler(dataset), batch_size, drop_last=True)
    else:  # shuffled order of contiguous batches: one read each
        sampler = nbpar.model.packed.BlockBatchSampler(len(dataset), batch_size)
    return DataLoader(dataset, sampler=sampler, batch_size=None)


loaders = {"one file\nper sample": DataLoader(per_file, batch_size=64, shuffle=True),
           "HDF5, sample\nby sample": DataLoader(hdf5, batch_size=64, shuffle=True),
           "HDF5,\ncontiguous batches": batches_of(hdf5, 64),
           "HDF5 staged\nin RAM": batches_of(in_ram, 64)}
rate = {name: throughput(loader) for name, loader in loaders.items()}
for name, r in rate.items():
    print(f"{name.replace(chr(10), ' '):26s} {r:9,.0f} samples/s  ({r / rate['one file' + chr(10) + 'per sample']:.1f}x per-file)")
ax = Figure(figsize=(8, 3), layout="constrained").add_subplot()
ax.bar(range(len(rate)), list(rate.values()), color=["tab:red", "tab:orange", "tab:green", "tab:blue"])
ax.set_xticks(range(len(rate)), list(rate))
ax.set_ylabel("samples / s")
ax.set_title("the same 2,048 samples through a DataLoader (timings vary from run to run)",
             fontsize="medium")
ax.figure

# %%
files_rate = rate["one file\nper sample"]
assert rate["HDF5,\ncontiguous batches"] > 3 * files_rate and rate["HDF5 staged\nin RAM"] > 3 * files_rate
print("contiguous reads from the HDF5 file and the copy staged in RAM: each more than "
      "3x the samples/s of one file per sample")

# %% [markdown]
# The timings above are not checked (they change with the machine and its load); the
# last cell checks the one claim that holds by a wide margin everywhere. Here the files
# were just written, so they sit in the operating system's page cache and no disk is
# touched: the per-file cost is the system calls and Python around each open. On a cold
# disk or a shared network file system every open adds a seek or a metadata round trip,
# and the gap grows. Reading a packed file sample by sample saves the opens but not the
# per-sample calls; reading contiguous runs, or from RAM, saves both.
#
# ## 3 · "GPU utilisation under 30%": steps that wait for data
#
# When a device shows low utilisation and the step time is long, the first suspect is
# input: every step waits for its batch. Notebook 06 measured a `SlowDataset` (10 ms of
# Python "decoding" per sample, standing in for JPEG decoding or tokenising) through a
# bare loader ([06_pitfalls](06_pitfalls.ipynb), section 2). Here the same kind of data
# set feeds training steps of `SimpleCNN` (batch 32, 8 SGD steps, one core), and
# `nbpar.model.packed.time_input_pipeline` times apart the wait for each batch and the
# compute (forward, backward, update). The share of the step spent computing is what a
# GPU's utilisation counter would show. Three attempts at a fix: 2 worker processes with
# prefetch, decoding once into an HDF5 file read in contiguous batches, and that file
# staged in RAM.

# %%
from nbpar.model.models import SimpleCNN
from nbpar.model.loader_experiment import SlowDataset

slow = SlowDataset(n=256, delay_s=0.01)
decoded = [slow[i] for i in range(len(slow))]  # decode once ...
packed_path = nbpar.model.packed.write_hdf5(np.stack([x for x, _ in decoded]), [y for _, y in decoded],
                                            os.path.join(workdir, "decoded.h5"))  # ... and pack
packed = nbpar.model.packed.HDF5Dataset(packed_path)
assert all(bool((packed[i][0].numpy() == slow[i][0]).all()) for i in (0, 255))
print("decoded once into", os.path.basename(packed_path), "- the same samples as the slow set")

# %%
# NBVAL_IGNORE_OUTPUT
feeds = {"decode per sample,\n0 workers": DataLoader(slow, batch_size=32, shuffle=True),
         "decode per sample,\n2 workers, prefetch 4": DataLoader(slow, batch_size=32, shuffle=True,
                                                              num_workers=2, prefetch_factor=4),
         "decoded once, HDF5\ncontiguous batches": batches_of(packed, 32),
         "decoded once,\nstaged in RAM": batches_of(
             nbpar.model.packed.HDF5Dataset(packed_path, in_memory=True), 32)}
split = {}
for name, loader in feeds.items():
    torch.manual_seed(0)
    split[name] = nbpar.model.packed.time_input_pipeline(SimpleCNN(), loader, steps=8)
for name, s in split.items():
    print(f"{name.replace(chr(10), ' '):40s} waiting for data {s['wait_fraction']:4.0%}, "
          f"computing {1 - s['wait_fraction']:4.0%} of {1000 * (s['data_s'] + s['compute_s']) / s['steps']:5.1f} ms/step")
ax = Figure(figsize=(8, 3), layout="constrained").add_subplot()
names = list(split)
ms = {n: (1000 * split[n]["compute_s"] / split[n]["steps"], 1000 * split[n]["data_s"] / split[n]["steps"])
      for n in names}
ax.barh(range(len(names)), [ms[n][0] for n in names], color="tab:blue", label="computing")
ax.barh(range(len(names)), [ms[n][1] for n in names], left=[ms[n][0] for n in names],
        color="tab:red", label="waiting for data")
for i, n in enumerate(names):
    ax.text(sum(ms[n]), i, f" computing {1 - split[n]['wait_fraction']:.0%}", va="center",
            fontsize="small")
ax.set_yticks(range(len(names)), names, fontsize="small")
ax.invert_yaxis()
ax.set_xlim(0, 1.3 * max(sum(v) for v in ms.values()))
ax.set_xlabel("ms per training step")
ax.legend(fontsize="small", loc="lower right")
ax.set_title("where SimpleCNN's steps go (timings vary from run to run)", fontsize="medium")
ax.figure

# %%
wait = {name: s["wait_fraction"] for name, s in split.items()}
step = {name: (s["data_s"] + s["compute_s"]) / s["steps"] for name, s in split.items()}
zero, two = "decode per sample,\n0 workers", "decode per sample,\n2 workers, prefetch 4"
fixed = ("decoded once, HDF5\ncontiguous batches", "decoded once,\nstaged in RAM")
assert wait[zero] > 0.7 and step[two] < 0.75 * step[zero] and wait[two] > 0.5
assert all(wait[name] < min(0.5, wait[zero] / 2) for name in fixed)
print("decoding every sample in the training process: computing under 30% of the step")
print("2 worker processes: steps over 25% shorter, yet still waiting for data over half the step")
print("decoded once (HDF5 read in contiguous batches, or RAM): waiting under half the step")

# %% [markdown]
# With every sample decoded in the training process, the model computes in under a
# third of each step: on a GPU this is the "utilisation under 30%" symptom, and a
# faster GPU would not help at all. Worker processes decode in parallel with the step
# (at most as many as there are cores per rank, and each rank of a data-parallel run
# has its own loader and workers): 2 workers make the step shorter, but while decoding
# a batch takes longer than computing it the model still waits most of the time, so
# the utilisation hardly moves. Decoding once, ahead of training, and storing the result
# packed removes the work instead of spreading it. (The decoding here is a `time.sleep`,
# as in notebook 06, so that its cost does not depend on the machine; real decoding also
# competes with the compute for the same cores.)

# %%
import shutil

shutil.rmtree(workdir)  # the files, the HDF5 files

# %% [markdown]
# ## Takeaway
#
# - A K times larger global batch gives K times fewer steps: keep the learning rate and
#   the run falls behind. Scale the rate by K (Goyal et al. 2017) and warm it up from
#   the small-batch value over the first part of training. Measured here, scaling the
#   rate recovers most of the gap at K = 8 (warm-up cost a little on this shallow model;
#   it is for deep networks early in training) and, with warm-up, less of it at K = 16. The rule is a heuristic
#   for SGD that breaks down at very large batches, where LARS and LAMB take over.
# - Plot the loss against **samples seen**, not steps, when comparing batch sizes.
# - Input pipelines starve accelerators quietly: time the wait for each batch next to
#   the compute. Decode once and store packed (HDF5, LMDB, shards), read contiguous
#   runs, stage in RAM or on local SSD, and use worker processes with prefetching for
#   the work that must stay per sample.
