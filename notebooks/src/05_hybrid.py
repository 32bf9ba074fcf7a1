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
# # 05 · Hybrid parallelism: data x tensor x pipeline on one device mesh
#
# **Time:** about 30 minutes, 10 of them exercises ([the workshop day](../docs/workshop.md)).
#
# Large runs combine all three: tensor parallelism inside a node (it communicates in
# every layer and needs the fastest links), pipeline stages across nodes (only
# activations at stage boundaries cross the network), and data parallelism (with ZeRO)
# over whatever is left. A **device mesh** names each rank's place in that grid.
#
# **Goal:** see how a device mesh names each rank's place in a dp x tp x pp grid and
# which ranks talk to whom, use the estimator to choose a combination from 1B to 175B
# parameters, and run two 4-engine hybrids that compute the same losses.

# %%
# %matplotlib inline
import nbpar
import nbpar.view.plots
from matplotlib.figure import Figure
# %load_ext nbpar

# %% [markdown]
# ## The mesh
#
# `ParallelDims(dp, tp, pp, world_size)` checks that the degrees multiply to the world
# size and lays ranks out with tp fastest and pp slowest
# (`rank = (pp_i * dp + dp_j) * tp + tp_k`), so a tensor-parallel group is made of
# neighbouring ranks: on GPUs, the same node. For 8 ranks as 2 x 2 x 2:

# %%
dims = nbpar.ParallelDims(dp=2, tp=2, pp=2, world_size=8)
for rank in range(dims.world_size):
    print(f"rank {rank}: {dims.coords(rank)}")

# %%
try:
    nbpar.ParallelDims(dp=2, tp=2, pp=2, world_size=6)
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# ## A real mesh on 4 engines
#
# Four engines are fine on a small machine for a tiny model. `build_mesh` creates
# the `DeviceMesh` with dims `("pp", "dp", "tp")`; each named slice is a process group.
# With dp = 2 and tp = 2: who talks to whom?

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(4)
pool

# %%
# %%dist
import torch.distributed as dist
from nbpar.dims import ParallelDims

dims = ParallelDims(dp=2, tp=2, world_size=dist.get_world_size())
mesh = dims.build_mesh("cpu")
ranks_of = lambda dim: dist.get_process_group_ranks(mesh[dim].get_group())
print(dims.coords(dist.get_rank()), "| tp group", ranks_of("tp"), "| dp group", ranks_of("dp"))

# %% [markdown]
# Ranks 0 and 1 split the same layers (tp group), and ranks 0 and 2 hold the same
# shard of the model and average their gradients (dp group).
#
# ## Which combination, when?
#
# Rules of thumb, with the estimator's per-GPU model-state bytes (mixed-precision Adam):
#
# * **Small experiments (up to a few billion parameters): DDP, plus ZeRO-1.** Sharding
#   the optimizer states removes most of the memory. In the ZeRO paper's scheme it sends
#   DDP's 2Psi (reduce-scatter, then all-gather); PyTorch's ZeroRedundancyOptimizer and
#   DeepSpeed's stage 1 as run here send 3Psi, 1.5x (notebook 08 counts it).

# %%
for s in ("ddp", "zero1"):
    print(nbpar.estimate_memory(1.3e9, 8, s, precision="mixed").table(), end="\n\n")

# %% [markdown]
# * **Tens of billions: TP inside the node, ZeRO-3 across nodes.** A 30B model on
#   64 GPUs (8 nodes of 8): tensor parallel over the 8 GPUs of a node alone still needs
#   60 GB per GPU; ZeRO-3 over the 8 data-parallel replicas brings it to 7.5 GB.

# %%
for s in ("ddp", "zero3"):
    print(nbpar.estimate_memory(30e9, 64, s, tp=8, precision="mixed").table(), end="\n\n")

# %% [markdown]
# * **Hundreds of billions: add pipeline stages.** GPT-3-sized (175B, 96 layers, hidden
#   12288) on 1024 GPUs. Memory alone would allow TP x ZeRO-3, but ZeRO-3 gathers every
#   layer's parameters from all 128 data-parallel ranks in every forward and backward
#   pass, across the network. With 16 pipeline stages each node only sends activations
#   to its neighbour, and 8-way data parallelism with ZeRO-1 is cheap. Add the
#   activations: sequence 2048, 1 sequence per micro-batch, 1F1B keeping up to 16
#   micro-batches in flight on the first stage, every activation kept for backward (no
#   recomputation) and *sequence parallelism* (Korthikanti et al. 2022: the parts of a
#   layer that tensor parallelism leaves whole, its norms and dropouts, split along the
#   sequence, so everything divides by t):

# %%
activations = dict(batch=1, seq_len=2048, hidden=12288, layers=96, heads=96)
tp8 = nbpar.estimate_memory(175e9, 1024, "zero3", tp=8, precision="mixed",
                            activations=activations)
tp8pp16 = nbpar.estimate_memory(175e9, 1024, "zero1", tp=8, pp=16, precision="mixed",
                                activations={**activations, "in_flight": 16})
print(tp8.table(), end="\n\n")
print(tp8pp16.table())

# %% [markdown]
# The pipelined layout holds *more* per GPU (its ZeRO-1 keeps whole parameters and
# gradients of its stage). It is chosen for what crosses the network each step, per GPU,
# with bf16 parameters and gradients (2 bytes): ZeRO-3 all-gathers its parameters in
# forward and again in backward and reduce-scatters the gradients over 128 replicas on
# other nodes; ZeRO-1 over 8 replicas moves its stage's gradients once (the ZeRO paper's
# 2 Psi), and the stages pass each micro-batch's boundary activations forward and their
# gradients back (split by the 8 tp ranks, sequence parallel):

# %%
psi, tp, pp, gpus = 175e9, 8, 16, 1024
dp_zero3, dp_pp = gpus // tp, gpus // (tp * pp)
zero3_net = 3 * 2 * psi / tp * (dp_zero3 - 1) / dp_zero3
zero1_net = 2 * 2 * psi / (tp * pp) * (dp_pp - 1) / dp_pp
boundary = activations["batch"] * activations["seq_len"] * activations["hidden"] * 2 / tp
pipe_net = 2 * 16 * boundary  # 16 micro-batches: activations forward, gradients back
print(f"TP8 x ZeRO-3:        {zero3_net / 1e9:6.1f} GB a GPU a step across nodes, "
      f"{tp8.per_rank_bytes['total'] / 1e9:.1f} GB held")
print(f"TP8 x PP16 x ZeRO-1: {(zero1_net + pipe_net) / 1e9:6.1f} GB ({zero1_net / 1e9:.1f} "
      f"gradients + {pipe_net / 1e9:.1f} activations), "
      f"{tp8pp16.per_rank_bytes['total'] / 1e9:.1f} GB held")
print(f"the pipelined layout sends {zero3_net / (zero1_net + pipe_net):.0f}x less")
assert zero3_net > 20 * (zero1_net + pipe_net)
assert tp8pp16.per_rank_bytes["total"] > tp8.per_rank_bytes["total"]

# %% [markdown]
# Both layouts hold the same activations per GPU, and this is no accident: without
# stages a GPU keeps all 96 layers of one micro-batch; with 16 stages it keeps 96/16 = 6
# layers, but of up to 16 micro-batches in flight (1F1B's first stage), again 96
# layer-micro-batches. What changes them is how each layer is stored:

# %%
from nbpar.estimate import format_bytes

variants = {"as above (sequence parallel, no recomputation)": {},
            "without sequence parallelism": {"sequence_parallel": False},
            "with full recomputation (activation checkpointing)": {"recompute": True}}
for name, extra in variants.items():
    est = nbpar.estimate_memory(175e9, 1024, "zero1", tp=8, pp=16, precision="mixed",
                                activations={**activations, "in_flight": 16, **extra})
    print(f"{name:52s} {format_bytes(est.per_rank_bytes['activations'])} per GPU")
assert tp8.per_rank_bytes["activations"] == tp8pp16.per_rank_bytes["activations"]

# %% [markdown]
# Activation checkpointing keeps only each layer's input and runs the layer's forward
# again during backward (about a third more compute) to rebuild the rest. nbpar runs it
# with `TrainConfig(activation_checkpointing=True)`; what autograd saved for backward,
# measured on the same tiny model both ways:

# %%
ckpt = {}
for on in (False, True):
    cfg = nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=8, steps=2,
                            seed=0, activation_checkpointing=on)
    res = pool.train(cfg).result()
    ckpt[on] = (res["ranks"][0]["activation_bytes"], res["losses"])
print(f"saved for backward: {format_bytes(ckpt[False][0])} without, "
      f"{format_bytes(ckpt[True][0])} with activation checkpointing")
assert ckpt[True][0] < ckpt[False][0]
assert max(abs(a - b) for a, b in zip(ckpt[True][1], ckpt[False][1])) < 1e-5  # same math

# %%
from matplotlib.ticker import EngFormatter, MaxNLocator

big = {name: nbpar.estimate_memory(175e9, 1024, "zero1", tp=8, pp=16, precision="mixed",
                                   activations={**activations, "in_flight": 16, **extra})
       for name, extra in (("without", {}), ("with", {"recompute": True}))}
fig = Figure(figsize=(9, 2.4), layout="constrained")
left, right = fig.subplots(1, 2)
left.barh(["without", "with"], [ckpt[False][0], ckpt[True][0]], color=["tab:blue", "tab:green"])
left.set_title("tiny_gpt, measured: saved for backward per rank", fontsize="medium")
right.barh(list(big), [e.per_rank_bytes["activations"] for e in big.values()],
           color=["tab:blue", "tab:green"])
right.set_title("175B on TP8 x PP16, estimated: activations per GPU", fontsize="medium")
for ax in (left, right):
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))  # decimal: kB, MB, GB
    ax.xaxis.set_major_locator(MaxNLocator(4))
    ax.set_ylabel("checkpointing")
fig

# %%
fig = Figure(figsize=(10, 3.2), layout="constrained")
cases = [("1.3B, 8 GPUs\nZeRO-1", nbpar.estimate_memory(1.3e9, 8, "zero1", precision="mixed")),
         ("30B, 64 GPUs\nTP8 x ZeRO-3", nbpar.estimate_memory(30e9, 64, "zero3", tp=8,
                                                              precision="mixed")),
         ("175B, 1024 GPUs\nTP8 x PP16 x ZeRO-1",
          nbpar.estimate_memory(175e9, 1024, "zero1", tp=8, pp=16, precision="mixed",
                                activations={**activations, "in_flight": 16}))]
for ax, (title, est) in zip(fig.subplots(1, 3), cases):
    est.plot(ax=ax)
    ax.set_title(title, fontsize="medium")
fig

# %% [markdown]
# ## A 4-engine hybrid run
#
# `strategy="hybrid"` takes explicit degrees. Two splits of the 4 engines, 2 pipeline
# stages each, replicated twice (pp x dp) or tensor-parallel inside each stage
# (pp x tp). Both use 4 micro-batches per step and a global batch of 32 sequences, so
# they compute the same losses, and each rank only holds a part of the model:

# %%
common = dict(model="tiny_gpt", strategy="hybrid", steps=10, lr=3e-3, seed=0, grad_accum=4)
run_ppdp = pool.train(nbpar.TrainConfig(pp=2, dp=2, micro_batch=4, **common)).wait()
run_pptp = pool.train(nbpar.TrainConfig(pp=2, tp=2, micro_batch=8, **common)).wait()
for name, run in (("pp2 x dp2", run_ppdp), ("pp2 x tp2", run_pptp)):
    res = run.result()
    print(f"{name}: losses {[round(x, 1) for x in res['losses'][::3]]}, params per rank "
          f"{[r['param_bytes'] for r in res['ranks']]} B")
ppdp_losses, pptp_losses = run_ppdp.result()["losses"], run_pptp.result()["losses"]
assert max(abs(a - b) for a, b in zip(ppdp_losses, pptp_losses)) < 1e-5  # fp32 rounding

# %%
nbpar.view.plots.plot_loss_difference(pptp_losses, ppdp_losses,
                                      labels=("pp2 x tp2", "pp2 x dp2"))

# %% [markdown]
# pp x dp: each rank holds one stage (half the layers, embeddings on the first stage,
# head on the last). pp x tp: each stage is further split in two by its Megatron
# matrices. In a real cluster the tp pairs would sit on one node, the pipeline stages
# on different nodes.

# %% [markdown]
# ## Exercise: a dp x tp DeviceMesh
#
# Build the 2-D mesh a hybrid run trains on: shape (dp, tp), dimensions named "dp" and
# "tp", tp the inner one so a tp group's ranks are consecutive (one node's GPUs, where
# the links are fast). The checker reads the groups back. `make student` removes the
# solution.

# %% tags=["solution"]
# %%dist
import nbpar.exercises
from torch.distributed.device_mesh import init_device_mesh


def mesh(dp, tp):
    # BEGIN SOLUTION
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    # END SOLUTION


assert nbpar.exercises.check("mesh", mesh)

# %% [markdown]
# ## dp x tp typed: your mesh, TP inside, FSDP2 across
#
# The 2-D recipe of torchtitan, on the mesh you just built: each block split over
# `mesh["tp"]` with `parallelize_module` (notebook 04's plan), then sharded over
# `mesh["dp"]` with `fully_shard`, which turns each tensor-parallel weight into a 2-D
# `DTensor`, split by tp and sharded by dp (torch prints the dp half as `_StridedShard`:
# a shard of a dimension tp has already split). Each dp rank reads its own shard of the
# data; the two ranks of a tp pair read the same.

# %%
# %%dist
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from nbpar.config import TrainConfig
from nbpar.model.data import build_loader
from nbpar.model.models import build_model, next_token_loss

cfg = TrainConfig(model="tiny_gpt", strategy="hybrid", dp=2, tp=2, fsdp_reshard=True,
                  micro_batch=8, steps=10, lr=3e-3, seed=0)
grid = mesh(cfg.dp, cfg.tp)                  # your DeviceMesh of the exercise
plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
        "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel()}
model = build_model(cfg)
for block in model.layers.values():
    parallelize_module(block, grid["tp"], plan)
    fully_shard(block, mesh=grid["dp"])
fully_shard(model, mesh=grid["dp"])
optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)

w1 = model.layers["0"].ffn.w1.weight
if dist.get_rank() == 0:
    print(f"ffn.w1 {tuple(w1.shape)} on mesh {w1.device_mesh.mesh_dim_names}: "
          f"{w1.placements}, this rank stores {tuple(w1.to_local().shape)}")
dp_rank, dp_group = grid["dp"].get_local_rank(), grid["dp"].get_group()
hybrid_losses = []
for step, (x, y) in zip(range(cfg.steps), build_loader(cfg, dp_rank, cfg.dp)):
    loss = next_token_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=dp_group)    # the global batch: both dp halves
    hybrid_losses.append(mean.item() / cfg.dp)
if dist.get_rank() == 0:
    print("losses:", [round(v, 2) for v in hybrid_losses[::3]])

# %% [markdown]
# The same through `pool.train` (`fsdp_reshard=True`: FSDP2 over dp, ZeRO-3 on each
# tensor-parallel shard), and the one-process reference on the same global batch of 16:

# %%
typed_cfg = dict(model="tiny_gpt", steps=10, lr=3e-3, seed=0)
run_dptp = pool.train(nbpar.TrainConfig(strategy="hybrid", dp=2, tp=2, fsdp_reshard=True,
                                        micro_batch=8, **typed_cfg)).wait()
run_one = pool.train(nbpar.TrainConfig(strategy="single", micro_batch=8, grad_accum=2,
                                       **typed_cfg)).wait()


def your_losses():
    return hybrid_losses  # runs on an engine, in its namespace


typed = pool.run(your_losses)[0]
dptp, one = run_dptp.result()["losses"], run_one.result()["losses"]
print("yours       :", [round(x, 2) for x in typed[::3]])
print("dp2 x tp2   :", [round(x, 2) for x in dptp[::3]])
print("one process :", [round(x, 2) for x in one[::3]])
gap = max(max(abs(a - b) for a, b in zip(other, one)) for other in (typed, dptp))
print("yours and pool.train's within 1e-5 of one process at every step:", gap < 1e-5)
assert len(typed) == len(dptp) == len(one) == 10 and gap < 1e-5

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - `ParallelDims` refuses degrees that do not multiply to the world size and lays out
#   tp fastest, so a tensor-parallel group is neighbouring ranks (one node on GPUs); the
#   4-engine mesh printed each rank's tp and dp group.
# - The estimator's tables, and a count of what crosses the network, give the rule by
#   scale: data parallelism with ZeRO-1 for a few billion parameters, TP inside the node
#   and ZeRO-3 across nodes for tens of billions, pipeline stages added for hundreds of
#   billions: for 175B they hold more per GPU than TP8 x ZeRO-3 (42 against 37 GB) but
#   send 26 times fewer bytes across nodes each step.
# - At GPT-3 size activations, not model states, fill the GPU; sequence parallelism and
#   activation checkpointing move them the most, and checkpointing's saving was measured
#   on the tiny model.
# - pp x dp and pp x tp on 4 engines trained to the same losses while each rank held a
#   different part of the model.
# - Your own dp x tp run (your mesh, `parallelize_module` inside, `fully_shard` across)
#   gave `pool.train`'s losses and one process's.
