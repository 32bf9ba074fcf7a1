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
# # 00b · The collectives: who sends what to whom
#
# **Time:** about 30 minutes ([the workshop day](../docs/workshop.md)).
#
# **Goal:** see the seven operations every strategy of this workshop is made of
# (broadcast, reduce, all-reduce, reduce-scatter, all-gather, all-to-all, send/recv),
# each run on 4 ranks and drawn; measure the bytes each rank really puts on the wire
# beside the textbook formula; time an all-reduce against message size and read off
# latency and bandwidth as nccl-tests reports them; and see why a ring all-reduce sends
# 2(N-1)/N of the data whatever N is.
#
# DDP is an all-reduce of the gradients; ZeRO a reduce-scatter and an all-gather;
# pipeline stages send and receive; tensor parallelism all-reduces activations; expert
# parallelism is all-to-all. (After the Ultra-Scale Playbook's own primer.)

# %%
# %matplotlib inline
import nbpar
import nbpar.view.collectives
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(4)
pool

# %% [markdown]
# ## Seven collectives, drawn from what they did
#
# Each rank starts with a tensor of 4 chunks whose values say where the data came from:
# rank r's chunks are worth 2**r. A sum then yields the set of ranks it adds up (0b1011:
# ranks 0, 1 and 3), a gather moves those markers around. For all-to-all, chunk c of
# rank r is the piece bound for rank c. The cell runs the real `torch.distributed` calls
# on every rank; the figure is drawn from what each rank holds afterwards.

# %%
# %%dist
import torch
import torch.distributed as dist

rank, world = dist.get_rank(), dist.get_world_size()


def mine():
    return torch.full((world,), float(2**rank))


def run(name):
    """(before, after) of collective ``name`` on this rank, as lists of chunk values."""
    t = mine()
    before = t.tolist()
    if name == "broadcast":  # rank 0's tensor to every rank
        dist.broadcast(t, src=0)
    elif name == "reduce":  # the sum, on rank 0 only
        dist.reduce(t, dst=0)
        if rank != 0:
            t = torch.zeros(world)  # (what other ranks hold afterwards is unspecified)
    elif name == "all_reduce":  # the sum, on every rank
        dist.all_reduce(t)
    elif name == "reduce_scatter":  # chunk r of the sum, on rank r
        out = torch.zeros(1)
        dist.reduce_scatter_single(out, t)
        t = torch.cat([out if c == rank else torch.zeros(1) for c in range(world)])
    elif name == "all_gather":  # every rank's own chunk, on every rank
        before = [float(2**rank) if c == rank else 0.0 for c in range(world)]
        t = torch.zeros(world)
        dist.all_gather_single(t, torch.tensor([float(2**rank)]))
    elif name == "all_to_all":  # chunk c of rank r goes to rank c
        out = torch.zeros(world)
        dist.all_to_all_single(out, t)
        t = out
    elif name == "send/recv":  # rank 0 to rank 1, nobody else
        if rank == 0:
            dist.send(t, dst=1)
        elif rank == 1:
            t = torch.zeros(world)
            dist.recv(t, src=0)
    return before, t.tolist()


NAMES = ["broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather",
         "all_to_all", "send/recv"]
drawn = {name: run(name) for name in NAMES}

# %%
per_rank = pool.run(lambda: __import__("__main__").drawn)
NAMES = ["broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather",
         "all_to_all", "send/recv"]
results = {n: ([r[n][0] for r in per_rank], [r[n][1] for r in per_rank]) for n in NAMES}
nbpar.view.collectives.plot_collectives(results, pool.n)

# %%
who = nbpar.view.collectives.contributors
assert all(who(v) == [0, 1, 2, 3] for v in results["all_reduce"][1][2])
assert [who(results["reduce_scatter"][1][r][r]) for r in range(4)] == [[0, 1, 2, 3]] * 4
assert results["all_to_all"][1][2] == [1.0, 2.0, 4.0, 8.0]  # rank 2 got chunk 2 of each
for name in results:
    print(f"{name:15s} rank 2 after: {[who(v) for v in results[name][1][2]]}")

# %% [markdown]
# ## What each rank puts on the wire
#
# gloo sends over TCP sockets, and the kernel counts every byte a process writes
# (`wchar` of `/proc/self/io`, read by `nbpar.device.bytes_written`). Around each
# collective of a 1 MiB tensor (262,144 fp32 values), the difference is what that rank
# sent. Beside it, what the textbook algorithm sends per rank: a ring all-reduce 2(N-1)/N
# of the tensor, a reduce-scatter and an all-gather (N-1)/N of the whole, an all-to-all
# (N-1)/N of its input.

# %%
# %%dist
from nbpar import device

MIB = 2**20


def sent(op):
    t = torch.ones(MIB // 4)
    op(t.clone())  # warm: the first call of each op sets up buffers
    dist.barrier()
    before = device.bytes_written()
    op(t)
    after = device.bytes_written()
    dist.barrier()
    return (after - before) / MIB


wire = {
    "all_reduce": sent(lambda t: dist.all_reduce(t)),
    "reduce_scatter": sent(lambda t: dist.reduce_scatter_single(torch.empty(t.numel() // world), t)),
    "all_gather": sent(lambda t: dist.all_gather_single(torch.empty(t.numel() * world), t)),
    "all_to_all": sent(lambda t: dist.all_to_all_single(torch.empty_like(t), t)),
    "broadcast": sent(lambda t: dist.broadcast(t, src=0)),
}

# %%
wire = pool.run(lambda: __import__("__main__").wire)
n = pool.n
formula = {  # MiB each rank sends for a 1 MiB input, by the textbook's ring algorithms
    "all_reduce": 2 * (n - 1) / n,
    "reduce_scatter": (n - 1) / n,
    "all_gather": (n - 1) * 1.0,  # (N-1)/N of the N MiB gathered
    "all_to_all": (n - 1) / n,
    "broadcast": (n - 1) / n,  # a pipelined ring; a tree sends more from its root
}
print(f"{'op':15s} {'formula':>8s}  measured per rank (MiB)")
for op, f in formula.items():
    print(f"{op:15s} {f:8.2f}  {'  '.join(f'{w[op]:.2f}' for w in wire)}")

# %%
for op in ("all_reduce", "all_gather", "all_to_all"):  # gloo runs these as the textbook
    assert all(abs(w[op] - formula[op]) < 0.01 for w in wire), op
# gloo's reduce-scatter sends what its all-reduce sends, twice the formula
assert all(abs(w["reduce_scatter"] - formula["all_reduce"]) < 0.01 for w in wire)
# gloo's broadcast is a tree: the root and one inner rank send, the leaves nothing
assert [round(w["broadcast"]) for w in wire] == [2, 1, 0, 0]

# %% [markdown]
# Three collectives send exactly what the formula says, to within gloo's message
# headers. Two differ, and the difference is the library's choice of algorithm, not a
# measuring error:
#
# - **reduce-scatter** sends 2(N-1)/N, what an all-reduce sends: gloo computes it by
#   reducing everything and keeping each rank's slice, where NCCL's ring sends (N-1)/N.
#   So on gloo, ZeRO's reduce-scatter + all-gather moves 1.5x what DDP's all-reduce
#   moves; on NCCL the two together move what one all-reduce moves. nbpar's c10d meter
#   (`nbpar.measure.comm`) counts the textbook algorithm's bytes, the figure that
#   carries over to GPUs.
# - **broadcast** is a binary tree: rank 0 sends to two ranks, rank 1 on to the last,
#   `log2 N` rounds instead of a ring's N-1 steps, and the root sends more.

# %% [markdown]
# ## Time against message size
#
# A message of n bytes takes about `α + n / β`: a latency α (start-up, one round trip)
# and a bandwidth β. nccl-tests reports two bandwidths: the **algorithm bandwidth**,
# size / time, and the **bus bandwidth**, algbw x 2(N-1)/N for an all-reduce, the rate
# the links really ran at, comparable across N. Here the "links" are loopback sockets of
# one machine whose 2 cores the 4 ranks share: the figures describe this laptop, and a
# busy one at that, not a network.

# %%
# %%dist
import time

SIZES = [2**k for k in range(10, 23, 2)]  # 1 KiB to 4 MiB


def timed(nbytes, repeats=5):
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


sweep = [timed(s) for s in SIZES]

# %%
# NBVAL_IGNORE_OUTPUT
# (timings: they depend on this machine and what else it runs)
import numpy as np
from matplotlib.figure import Figure

sizes = np.array(pool.run(lambda: __import__("__main__").SIZES)[0], dtype=float)
seconds = np.max(pool.run(lambda: __import__("__main__").sweep), axis=0)  # slowest rank
slope, alpha = np.polyfit(sizes, seconds, 1)  # least squares: t = alpha + size / beta
beta = 1 / slope
algbw = sizes / seconds
busbw = algbw * 2 * (n - 1) / n
print(f"latency alpha ~ {alpha * 1e6:.0f} us, bandwidth beta ~ {beta / 1e9:.2f} GB/s")
print(f"{'size':>8s} {'time':>9s} {'algbw MB/s':>11s} {'busbw MB/s':>11s}")
for s, t, a, b in zip(sizes, seconds, algbw, busbw):
    print(f"{int(s):8d} {t * 1e3:7.2f} ms {a / 1e6:11.1f} {b / 1e6:11.1f}")
fig = Figure(figsize=(6, 3), layout="constrained")
ax = fig.add_subplot()
ax.loglog(sizes, seconds * 1e3, "o", label="measured (median of 5, slowest rank)")
ax.loglog(sizes, (alpha + sizes / beta) * 1e3, "-", label="alpha + size / beta")
ax.set_xlabel("message size (bytes)")
ax.set_ylabel("all_reduce time (ms)")
ax.legend(fontsize=7)
fig

# %%
assert (seconds > 0).all() and beta > 0  # the fit is a rate; its size is this machine's

# %% [markdown]
# On this machine the latency is large (4 ranks time-share 2 cores, so every step waits
# for the scheduler) and the points scatter; on a GPU node alpha is a few microseconds
# and beta hundreds of GB/s. The shape is what carries over. Small messages cost the
# latency whatever their size (the flat left of the curve):
# that is why DDP packs its gradients into 25 MB buckets instead of one all-reduce per
# tensor. Large messages cost their size over the bandwidth (the straight right).
#
# ## Why a ring all-reduce sends 2(N-1)/N of the data
#
# Cut the tensor into N chunks and arrange the ranks in a ring. In N-1 steps each rank
# sends one chunk to its right neighbour and adds the chunk it receives from its left:
# after them, rank r holds the full sum of one chunk (a **reduce-scatter**, (N-1)/N of
# the tensor sent). In N-1 more steps the finished chunks travel once round the ring (an
# **all-gather**, another (N-1)/N). In all, 2(N-1)/N: 1.0 of the tensor on 2 ranks, 1.5
# on 4, 1.98 on 100. The bytes per rank hardly grow with N, which is what makes data
# parallelism over thousands of GPUs possible; the 2(N-1) steps each pay the latency α,
# which is why large clusters also use trees. The measured 1.50 MiB per rank above is
# this, on 4 ranks. Notebook 01's first exercise has you write the ring yourself.

# %%
pool.shutdown()
