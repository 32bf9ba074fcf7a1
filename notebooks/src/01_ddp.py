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
# # 01 · Distributed data parallel, cell by cell
#
# **Time:** about 50 minutes, 25 of them exercises ([the workshop day](../docs/workshop.md)).
#
# The classic PyTorch DDP recipe, typed into `%%dist` cells that run on every rank of
# a 2-engine pool: a small CNN, CIFAR-10 data read by its real loader, a
# `DistributedSampler` that gives each rank its own shard, logging from rank 0 only,
# the `DistributedDataParallel` wrapper and a few training steps. At the end the same
# experiment runs as one line, `pool.train(...)`.
#
# **Goal:** see what each piece of the DDP recipe does on real ranks: why each rank
# reads its own shard in a new order every epoch (`set_epoch`), how DDP turns two
# differently seeded replicas into identical ones, and that the whole experiment is also
# one `pool.train` call.

# %%
# %matplotlib inline
import nbpar
import nbpar.model.data
import nbpar.view.plots
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## The model
#
# `SimpleCNN`: one 3x3 convolution (3 -> 32 channels), ReLU, global average pooling and
# a linear layer to 10 classes. Each rank seeds its generator with its *own rank*, so the
# two copies start out different on purpose (we fix that below with DDP).

# %%
# %%dist
import torch
import torch.distributed as dist
from torch import nn
from nbpar.model.models import SimpleCNN

rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
model = SimpleCNN(num_classes=10)
n_params = sum(p.numel() for p in model.parameters())
print(f"{n_params} parameters, first conv weight {model.conv.weight[0, 0, 0, 0].item():.4f}")

# %% [markdown]
# ## The data: CIFAR-10 files, read by the real loader
#
# `nbpar.model.data.cifar10_root()` returns a folder in the CIFAR-10 python format
# (`data_batch_1..5`, `test_batch`, `batches.meta`). Without internet it writes a small
# *synthetic* set in exactly that format (learnable class colours and stripes), so the
# reader below is the same code that reads the real 170 MB download. Every rank reads
# the whole file set; the sampler decides which samples each rank uses.

# %%
# %%dist
from nbpar.model.data import CIFAR10, cifar10_root

dataset = CIFAR10(cifar10_root(None, seed=0), train=True)
x0, y0 = dataset[0]
if rank == 0:
    print(f"{len(dataset)} images of shape {tuple(x0.shape)}, first label {y0}")

# %% [markdown]
# ## `DistributedSampler` and why `set_epoch` matters
#
# The sampler shuffles the indices with a seed and hands rank *r* every *world*-th of
# them, so the ranks never see the same sample in one epoch (when the data set divides
# by the world size, as 1,000 by 2 here; otherwise the sampler pads by repeating a few
# indices, or drops the tail with `drop_last=True`). The shuffle is seeded with
# `seed + epoch`: if you never call `sampler.set_epoch(epoch)`, the epoch stays 0 and
# **every epoch repeats the same order**. Here are the first indices each rank would
# see in three epochs, without and with `set_epoch`:

# %%
# %%dist
from torch.utils.data import DataLoader, DistributedSampler

sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
for epoch in range(3):
    print(f"no set_epoch, epoch {epoch}: {list(sampler)[:6]}")
for epoch in range(3):
    sampler.set_epoch(epoch)
    print(f"set_epoch({epoch}):        {list(sampler)[:6]}")


# %% [markdown]
# Without `set_epoch` the three lines are identical on each rank: the model sees the
# data in one fixed order forever. With it, each epoch is a fresh permutation, still
# split without overlap between the ranks.
#
# ## Logging from rank 0 only
#
# Every rank runs the same code, so a plain `print` prints `world` times. The usual
# pattern is a helper that prints on rank 0 only; values that differ per rank (like
# the loss of each rank's shard) are first averaged with an `all_reduce`.

# %%
# %%dist
def log0(*args):
    """print on rank 0 only"""
    if dist.get_rank() == 0:
        print(*args)

def mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()

log0("only rank 0 prints this")

# %% [markdown]
# ## Wrap the model in DDP and train
#
# `DistributedDataParallel` broadcasts rank 0's weights when it is built (so the
# different seeds above no longer matter) and, during `backward()`, averages the
# gradients over the ranks with bucketed all-reduces. Each optimizer step therefore
# applies the same update everywhere and the copies stay identical. Each rank has 500
# samples, 31 batches of 16: 40 steps cross into a second epoch, where `set_epoch`
# gives the new order.

# %%
# %%dist
from torch.nn.parallel import DistributedDataParallel as DDP

ddp_model = DDP(model)
print(f"first conv weight after wrapping {model.conv.weight[0, 0, 0, 0].item():.4f}")

loader = DataLoader(dataset, batch_size=16, sampler=sampler, drop_last=True)
optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)
loss_fn = nn.CrossEntropyLoss()

ddp_losses = []                              # the mean over ranks, every step
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        if len(ddp_losses) == 40:
            break
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(x), y)
        loss.backward()                      # gradients all-reduced here
        optimizer.step()
        ddp_losses.append(mean_over_ranks(loss))
        if len(ddp_losses) % 10 == 1:
            log0(f"epoch {epoch} step {len(ddp_losses) - 1:2d}  mean loss {ddp_losses[-1]:.1f}")

# %% [markdown]
# Both replicas hold exactly the same weights after training: gather every rank's
# parameters and compare them, element by element, with rank 0's.

# %%
# %%dist
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
copies = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(copies, flat)
identical = all(torch.equal(c, copies[0]) for c in copies)
log0(f"all {flat.numel()} weights identical on all ranks:", identical)
assert identical

# %% [markdown]
# ## The same experiment in one line
#
# `pool.train(TrainConfig(...))` runs nbpar's training loop on the engines: the same
# CIFAR-10 loader and `DistributedSampler` (with `set_epoch`), DDP around `SimpleCNN`
# (its weights drawn with seed 0, as rank 0's above), Adam at the same learning rate,
# and the loss averaged over the ranks. It returns a `Run` at once; `run.wait()` blocks
# until it is done (displaying `run` instead shows a live dashboard). It is the run you
# typed above, step for step: `pool.run` calls a function on every rank, here one that
# hands back the losses of your loop.

# %%
cfg = nbpar.TrainConfig(model="simple_cnn", strategy="ddp", micro_batch=16, steps=40,
                        lr=1e-2, seed=0)
run = pool.train(cfg).wait()
res = run.result()
print(nbpar.model.data.global_batch_line(cfg.micro_batch, cfg.grad_accum, pool.n))


def your_losses():
    return ddp_losses  # runs on an engine, in its namespace


typed = pool.run(your_losses)[0]
gap = max(abs(a - b) for a, b in zip(typed, res["losses"]))
print(f"your loop and pool.train, {len(typed)} steps: the same losses within 1e-5: {gap < 1e-5}")
assert len(typed) == len(res["losses"]) == cfg.steps and gap < 1e-5
first, last = sum(res["losses"][:3]) / 3, sum(res["losses"][-3:]) / 3
print(f"mean loss of the first 3 steps {first:.1f}, of the last 3 {last:.1f}")
assert last < first / 3

# %%
nbpar.view.plots.plot_losses(run, labels=["ddp, 2 ranks"])

# %% [markdown]
# ## Exercises: write it yourself
#
# Complete the function between `BEGIN SOLUTION` and `END SOLUTION` (the student
# version, `make student`, has `raise NotImplementedError` there) and run the cell:
# `nbpar.exercises.check` runs your function on every rank, compares it with torch's own
# result and with what nbpar's c10d meter saw, and rank 0 answers `passed` or the one
# thing to look at.
#
# **1 · A ring all-reduce from send and recv.** Split the tensor into N chunks; in N-1
# steps each rank sends one chunk to its right neighbour and adds the one it receives
# from its left (a reduce-scatter), then in N-1 more steps passes the finished chunks on
# (an all-gather). Each rank sends 2(N-1)/N of the tensor: the reason ring all-reduce's
# cost hardly grows with N.

# %% tags=["solution"]
# %%dist
import torch, torch.distributed as dist, nbpar.exercises


def ring_all_reduce(t):
    # BEGIN SOLUTION
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(t.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty_like(chunks[0])
    for step in range(world - 1):  # reduce-scatter
        req = dist.isend(chunks[(rank - step) % world].contiguous(), right)
        dist.recv(buf, left)
        req.wait()
        chunks[(rank - step - 1) % world] += buf
    for step in range(world - 1):  # all-gather of the finished chunks
        req = dist.isend(chunks[(rank + 1 - step) % world].contiguous(), right)
        dist.recv(buf, left)
        req.wait()
        chunks[(rank - step) % world].copy_(buf)
    return t
    # END SOLUTION


assert nbpar.exercises.check("ring_all_reduce", ring_all_reduce)

# %% [markdown]
# **2 · All-reduce = reduce-scatter + all-gather.** The same sum from two collectives:
# `dist.reduce_scatter_single` leaves each rank the sum of its 1/N slice,
# `dist.all_gather_single` brings the slices back. ZeRO is built on exactly this split.

# %% tags=["solution"]
# %%dist
def all_reduce_from_halves(t):
    # BEGIN SOLUTION
    part = torch.empty(t.numel() // dist.get_world_size())
    dist.reduce_scatter_single(part, t)
    dist.all_gather_single(t, part)
    return t
    # END SOLUTION


assert nbpar.exercises.check("all_reduce_from_halves", all_reduce_from_halves)

# %% [markdown]
# **3 · A DistributedSampler by hand.** Return the indices `rank` reads in `epoch`:
# shuffle all `n` with a generator seeded `seed + epoch` (what `set_epoch` does), pad to a
# multiple of the world size with the first indices, take every `world`-th from `rank`.

# %% tags=["solution"]
# %%dist
def shard_indices(n, rank, world, epoch, seed):
    # BEGIN SOLUTION
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    order += order[: -(-n // world) * world - n]
    return order[rank::world]
    # END SOLUTION


assert nbpar.exercises.check("shard_indices", shard_indices)

# %% [markdown]
# **4 · DDP by hand.** After `loss.backward()`, make every parameter's gradient the mean
# over ranks: what DDP's hooks do, bucket by bucket, during backward.

# %% tags=["solution"]
# %%dist
def average_gradients(model):
    # BEGIN SOLUTION
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    # END SOLUTION


assert nbpar.exercises.check("average_gradients", average_gradients)

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - The two replicas started from different weights; DDP broadcast rank 0's when
#   wrapping, and after training every weight was identical on all ranks (the check
#   printed `True`).
# - `DistributedSampler` gave the ranks different samples; without `set_epoch` each
#   epoch repeated the same order, with it each epoch was a new permutation.
# - Printing from rank 0 only, with values averaged by an `all_reduce` first, gives one
#   line per step instead of one per rank.
# - `pool.train(TrainConfig(strategy="ddp"))` runs the same recipe in one call, the
#   same losses as your loop at every step; the loss fell from its first printed values
#   to its last, as the plot shows.
