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
# # 04 · Tensor parallelism: splitting the matrices of a transformer block
#
# **Time:** about 30 minutes, 10 of them exercises ([the workshop day](../docs/workshop.md)).
#
# Data parallelism copies the whole model to every rank. When one layer is too big for
# one device, Megatron-LM (Shoeybi et al. 2019) splits the *matrices inside each layer*
# instead: every rank holds a slice of each weight and computes a slice of each
# product, and all-reduces stitch the results together: two per block in forward (after
# attention and after the MLP, Megatron's *g*) and two in backward (their mirror *f*,
# on the inputs' gradients).
#
# **Goal:** cut a matrix product both ways, apply the cut to a transformer block, check
# the numbers against one process, and measure what each rank holds and sends.

# %%
# %matplotlib inline
import nbpar
import nbpar.view.plots
import nbpar.view.teaching
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# ## Two ways to cut a matrix product
#
# For `Y = X @ A`:
# * **column-parallel**: cut `A` into column blocks `[A0 | A1]`; rank r computes
#   `X @ Ar`, a slice of `Y`'s columns. No communication in forward.
# * **row-parallel**: cut `A` into row blocks and `X` into the matching column blocks;
#   rank r computes a *partial sum* `Xr @ Ar`, and an `all_reduce` adds them up.
#
# A feed-forward layer `gelu(X @ A) @ B` chains them: `A` column-wise, `B` row-wise, so
# the slice of `gelu(X @ A)` that rank r computed is exactly the input its slice of `B`
# needs: **one** all-reduce for the whole MLP. Checked here against the full product:

# %%
# %%dist
import torch
import torch.distributed as dist
import torch.nn.functional as F

rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                         # same full matrices on every rank
X, A, B = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8)
full = F.gelu(X @ A) @ B                      # (4, 8) @ (8, 16) @ (16, 8) -> (4, 8)

A_r = A.chunk(world, dim=1)[rank]             # column block (8, 16/world)
B_r = B.chunk(world, dim=0)[rank]             # row block (16/world, 8)
partial = F.gelu(X @ A_r) @ B_r               # (4, 8) partial sum on this rank
dist.all_reduce(partial)                      # Megatron's "g": sum the partials
torch.testing.assert_close(partial, full)
print(f"A slice {tuple(A_r.shape)}, B slice {tuple(B_r.shape)}: all-reduced result == full product")

# %% [markdown]
# ## The same cut on every matrix of a TinyGPT block
#
# Attention is split by heads: `wq`, `wk`, `wv` column-wise (each rank gets
# `n_heads / tp` whole heads), the output projection `wo` row-wise. The MLP: `w1` (up)
# column-wise, `w2` (down) row-wise. (An `nn.Linear` stores its weight as (out, in),
# the transpose of the `X @ A` above: a column-wise split of `A` is a split of the
# stored weight's rows, which is why the placements printed below read `Shard(dim=0)`
# for the column-parallel layers and `Shard(dim=1)` for the row-parallel ones.) For `d_model = 32`, 4 heads, FFN width 128, tp = 2:

# %%
nbpar.view.teaching.plot_tp_split(d_model=32, ffn_dim=128, tp=2)

# %% [markdown]
# PyTorch applies such a plan with `parallelize_module`: a dict from submodule to
# `ColwiseParallel()` or `RowwiseParallel()`, over a one-dimensional `DeviceMesh` of
# the tensor-parallel ranks. Each weight becomes a `DTensor` and each rank now stores
# only its shard. Type the plan, apply it to every block:

# %%
# %%dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from nbpar.config import TrainConfig
from nbpar.model.models import build_model

cfg = TrainConfig(model="tiny_gpt", strategy="tp", micro_batch=8, steps=20, lr=3e-3, seed=0)
tp_mesh = init_device_mesh("cpu", (world,))   # all ranks: one tensor-parallel group
plan = {
    "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),             # heads in, partial sums out: all-reduced
    "ffn.w1": ColwiseParallel(),
    "ffn.w2": RowwiseParallel(),              # the MLP's one all-reduce in forward
}
reference = build_model(cfg)                  # the unsplit model (same seed on every rank)
model = build_model(cfg)
for block in model.layers.values():
    parallelize_module(block, tp_mesh, plan)

block = model.layers["0"]
for name in ("attn.wq", "attn.wo", "ffn.w1", "ffn.w2"):
    w = block.get_submodule(name).weight
    print(f"{name:8s} full {tuple(w.shape)} -> local {tuple(w.to_local().shape)}  {w.placements}")

# %% [markdown]
# ## Same numbers as one device
#
# The split model must compute what the unsplit one does, forward *and* backward. Feed
# both the same tokens; compare the logits, then the gradient: each rank's local
# gradient shard must equal the matching slice of the reference gradient.

# %%
# %%dist
tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
targets = torch.roll(tokens, -1, dims=1)
out, ref_out = model(tokens), reference(tokens)       # (b, s, vocab) each
torch.testing.assert_close(out, ref_out)

loss_fn = lambda logits: F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
loss_fn(out).backward()
loss_fn(ref_out).backward()
g = block.attn.wq.weight.grad.to_local()              # this rank's rows of wq's gradient
ref_g = reference.layers["0"].attn.wq.weight.grad.chunk(world, dim=0)[rank]
torch.testing.assert_close(g, ref_g)
print(f"logits match, loss {loss_fn(out).item():.2f}; wq grad shard {tuple(g.shape)} matches")

# %% [markdown]
# ## Training: your split, then `strategy="tp"`
#
# Every rank reads the *same* batch: tensor parallelism divides the model, not the
# data. The optimizer gets `foreach=False`: the split weights are DTensors, the
# embeddings and norms plain tensors, and torch's default multi-tensor Adam cannot step
# both kinds in one call. Twenty steps on a freshly split model:

# %%
# %%dist
from nbpar.model.data import build_loader
from nbpar.model.models import next_token_loss

model = build_model(cfg)
for block in model.layers.values():
    parallelize_module(block, tp_mesh, plan)
optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, foreach=False)
tp_losses = []
for step, (x, y) in zip(range(cfg.steps), build_loader(cfg, dp_rank=0, dp_size=1)):
    loss = next_token_loss(model(x), y)      # the same on every rank: the batch is
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    tp_losses.append(loss.item())
if rank == 0:
    print("losses:", [round(v, 2) for v in tp_losses[::5]])

# %% [markdown]
# `pool.train` runs the same split on the same batches. Its losses equal yours, and
# both match the one-process reference `strategy="single"`, step for step:

# %%
common = dict(model="tiny_gpt", micro_batch=8, steps=20, lr=3e-3, seed=0)
run_tp = pool.train(nbpar.TrainConfig(strategy="tp", **common)).wait()
run_single = pool.train(nbpar.TrainConfig(strategy="single", **common)).wait()
tp_losses, single_losses = run_tp.result()["losses"], run_single.result()["losses"]


def your_losses():
    return tp_losses  # runs on an engine, in its namespace


typed = pool.run(your_losses)[0]
print("yours  :", [round(x, 2) for x in typed[:: 5]])
print("tp     :", [round(x, 2) for x in tp_losses[:: 5]])
print("single :", [round(x, 2) for x in single_losses[:: 5]])
gaps = [max(abs(a - b) for a, b in zip(other, single_losses)) for other in (typed, tp_losses)]
print("yours and tp within 1e-5 of single at every step:", max(gaps) < 1e-5)
assert len(typed) == len(tp_losses) == len(single_losses) == 20 and max(gaps) < 1e-5

# %% [markdown]
# Two identical curves would hide each other, so the right panel plots their difference:

# %%
nbpar.view.plots.plot_loss_difference(tp_losses, single_losses, labels=("tp=2", "single"))

# %% [markdown]
# ## What each rank holds and sends
#
# Tensor parallelism splits only what the plan splits: in nbpar's plan, the blocks'
# weight matrices, the token embedding by vocabulary rows (Megatron's
# VocabParallelEmbedding) and the output layer by columns (its logits gathered, as
# transformers' own plan does). The position embedding, the norms and the row-parallel
# biases stay whole on every rank. The estimate counts them (`tp_replicated`);
# Megatron's `Psi / tp` assumes there are none:

# %%
from nbpar.comm_estimate import comm_bytes_per_step
from nbpar.estimate import estimate_memory, format_bytes
from nbpar.model.models import build_model
from nbpar.model.plan import tp_replicated_parameters

model = build_model(nbpar.TrainConfig(**common))
n, whole = sum(p.numel() for p in model.parameters()), tp_replicated_parameters(model)
held = run_tp.result()["ranks"][0]["param_bytes"]
print(f"{n} parameters, {whole} of them left whole by the plan")
print(f"rank 0 holds {format_bytes(held)} of parameters; estimate "
      f"{format_bytes(estimate_memory(n, 2, 'tp', tp_replicated=whole).per_rank_bytes['params'])}; "
      f"Psi / tp would say {format_bytes(4 * n / 2)}")
assert held == estimate_memory(n, 2, "tp", tp_replicated=whole).per_rank_bytes["params"]

# %% [markdown]
# And what one step sends, counted at the c10d layer: activations only (no gradient
# all-reduce: the split weights differ per rank, and the whole ones get the same
# gradient on every rank, since every rank sees the same batch and f and g give each the
# full activations and input gradients). Megatron's four all-reduces per block (two
# forward, two backward) each move `2 (tp-1)/tp` of a `batch x seq x d_model`
# activation; nbpar's separate `wq`, `wk`, `wv` projections each need their input's
# gradient summed in backward, which adds two per block. The split ends add one
# all-reduce of the embedding's partial lookups and one all-gather of the logits:

# %%
g = nbpar.GPTConfig()
act = common["micro_batch"] * g.seq_len * g.d_model * 4               # bytes, fp32
megatron = 4 * g.n_layers * act * 2 * (2 - 1) / 2
sent = run_tp.result()["ranks"][0]["comm_bytes_by_op"]
logits = common["micro_batch"] * g.seq_len * g.vocab_size * 4          # bytes, fp32
model_says = comm_bytes_per_step("tp", param_bytes=0, tp=2, activation_bytes=act,
                                 layers=g.n_layers, logits_bytes=logits)
print(f"sent per step by rank 0: {sent}")
print(f"Megatron's 4 per block: {megatron:.0f} B; with the 2 for separate q, k, v and "
      f"the split ends: {model_says:.0f} B")
assert set(sent) == {"all_reduce", "all_gather"}
assert abs(sum(sent.values()) / model_says - 1) < 0.1

# %% [markdown]
# ## Exercise: a column- then a row-parallel linear
#
# `w1_shard` holds this rank's rows of W1 (column parallel: its share of the hidden
# features), `w2_shard` the matching columns of W2 (row parallel). Compute the MLP
# `relu(x @ W1.T) @ W2.T` with one all-reduce in the right place: the ReLU works on the
# shard as it is, and only the row-parallel output is a partial sum. `make student`
# removes the solution.

# %% tags=["solution"]
# %%dist
import torch, torch.distributed as dist, nbpar.exercises


def tp_mlp(x, w1_shard, w2_shard):
    # BEGIN SOLUTION
    y = torch.relu(x @ w1_shard.T) @ w2_shard.T
    dist.all_reduce(y)
    return y
    # END SOLUTION


assert nbpar.exercises.check("tp_mlp", tp_mlp)

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - A column cut and a row cut reproduced the full product after one all-reduce, first
#   on one matrix, then on every matrix of a TinyGPT block.
# - Each rank stored a slice of every block matrix (the printed local shapes), and the
#   split model's logits and gradient shards matched one process; `strategy="tp"`
#   trained to the losses of `strategy="single"`, step for step.
# - In nbpar's plan the embeddings, norms and head stay whole on every rank: the parameters rank 0 held
#   matched the estimate that counts them, above the paper's `Psi / tp`.
# - A step sent activation all-reduces only, in every block, forward and backward, as
#   counted at the c10d layer: tensor parallelism belongs where ranks share fast links,
#   inside a node.
