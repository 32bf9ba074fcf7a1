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
# # 00 · Quickstart: a pool of engines, one process group
#
# **Time:** about 20 minutes ([the workshop day](../docs/workshop.md)).
#
# `nbpar.Pool(2)` starts two ipyparallel engines and joins them into one
# `torch.distributed` process group (gloo on CPU, nccl with one engine per GPU).
# `%%dist` then runs a cell on every rank; the output of each rank is grouped under
# `[rank N]`, in rank order.
#
# **Goal:** start a pool, run one collective on every rank and read its grouped output,
# pick ranks with `--targets`, see how a failure on one rank comes back, and ask the
# pool what its engines are doing.

# %%
import nbpar
# %load_ext nbpar

# %%
# NBVAL_IGNORE_OUTPUT
pool = nbpar.Pool(2)
pool

# %% [markdown]
# Every rank runs the same cell. `all_reduce` sums a tensor across ranks: rank 0
# contributes 0, rank 1 contributes 1, so every rank ends with 1.

# %%
# %%dist
import torch
import torch.distributed as dist

t = torch.ones(1) * dist.get_rank()
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum = {t.item()}")

# %% [markdown]
# `--targets` picks ranks; engines keep their variables between cells, like a kernel.

# %%
# %%dist --targets 1
print("only rank 1 runs this; t is still", t.item())

# %% [markdown]
# A failing rank shows its own traceback, prefixed with its rank:

# %% tags=["raises-exception"]
# %%dist
# NBVAL_RAISES_EXCEPTION
if dist.get_rank() == 1:
    raise ValueError("something went wrong on rank 1 only")

# %% [markdown]
# `pool.status()` (and `%dist status`) tell what each engine is doing without
# interrupting it.

# %%
[(row["rank"], row["device"], row["state"]) for row in pool.status()]

# %% [markdown]
# Re-running the cell that makes the pool is safe: the old engines are shut down
# first. When you are done:

# %%
pool.shutdown()

# %% [markdown]
# **Takeaway.**
#
# - `nbpar.Pool(2)` gave two engines in one gloo process group; the `all_reduce` cell
#   printed the same sum on both ranks.
# - Each rank's output comes back under `[rank N]`, in rank order, however fast the
#   ranks were.
# - Engines keep their variables between cells, like a kernel: `--targets 1` ran on rank
#   1 alone and still saw `t`.
# - A failure on one rank came back as a `RankError` naming that rank, with its own
#   traceback.
# - `pool.status()` told each rank's device and state without interrupting it;
#   `pool.shutdown()` ends the engines.
